//! A process that runs jemalloc's own profiler (`prof:true`, active) has
//! its samples taken where jemalloc records them (see
//! `discover::own_sampling`): a trap per sample and per slow free instead
//! of one per free.
use std::{os::unix::fs::FileExt, path::Path};

use crate::{
    discover::{Allocator, own_sampling::ProfSwitches},
    error::Result,
    kernel::Scope,
    proc::{parse_maps, proc_path},
    run::{Sampling, Session},
};

/// jemalloc's profiler switches as a process has them now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct ProfState {
    pub opt_prof: bool,
    pub active: bool,
    pub lg_sample: u64,
}

/// Largest `lg_prof_sample` jemalloc accepts (a 64-bit size).
const MAX_LG_SAMPLE: u64 = 62;

impl Session<'_> {
    /// This copy's probes and mean sampling interval when `pid` runs
    /// jemalloc's profiler; `None` (the usual probes) otherwise.
    fn own_sampling_plan(
        &mut self,
        scope: Scope,
        path: &str,
        allocator: &Allocator,
    ) -> Option<(Allocator, u64)> {
        let Scope::Process(pid) = scope else {
            return None;
        };
        if self.options.sampling != Sampling::SlowPath {
            return None;
        }
        let own = allocator.own_sampling.as_ref()?;
        let maps = &self.tracked.get(&pid)?.maps;
        let state = read_switches(pid, maps, path, &own.switches)?;
        if state.opt_prof && !state.active && self.options.verbose {
            let _ = writeln!(
                self.status,
                "memprobe: pid {pid}: {path}: jemalloc's profiler is built in and on but not \
                 active (prof.active false): its samples are not used"
            );
        }
        let usable = state.opt_prof && state.active && state.lg_sample <= MAX_LG_SAMPLE;
        let plan = allocator.on_own_sampling().filter(|_| usable)?;
        Some((plan, 1u64 << state.lg_sample))
    }

    /// Attaches to `allocator` through its own profiler when its process
    /// runs it; `Ok(None)` when it does not (the caller attaches as usual).
    pub(super) fn attach_own_sampling(
        &mut self,
        scope: Scope,
        (path, open_path): (&str, &Path),
        allocator: &Allocator,
        instance: u16,
    ) -> Result<Option<usize>> {
        let Some((plan, interval)) = self.own_sampling_plan(scope, path, allocator) else {
            return Ok(None);
        };
        let before = self.probes.attached.len();
        let attached = self
            .probes
            .attach(scope, path, open_path, &plan, instance)?;
        self.print_verbose_probes(before);
        let note = format!(
            "{path}: jemalloc's own samples (its profiler runs: prof:true, one sample per \
             {interval} bytes on average)"
        );
        if let Scope::Process(pid) = scope
            && let Some(t) = self.tracked.get_mut(&pid)
        {
            if self.options.verbose {
                let _ = writeln!(self.status, "memprobe: pid {pid}: {note}");
            }
            t.sampling_notes.push(note);
            t.own_intervals.insert(instance, interval);
        }
        Ok(Some(attached))
    }
}

/// `opt_prof`, `prof_active_state` and `lg_prof_sample` as `pid` has them,
/// read from `/proc/PID/mem` (never written); `None` if unreadable.
pub(super) fn read_switches(
    pid: u32,
    maps: &str,
    path: &str,
    switches: &ProfSwitches,
) -> Option<ProfState> {
    let (anchor_offset, anchor_address) = switches.anchor;
    let mapping = parse_maps(maps).into_iter().find(|m| {
        m.path.as_deref() == Some(path)
            && anchor_offset >= m.offset
            && anchor_offset < m.offset + (m.end - m.start)
    })?;
    // Where the file's address 0 is in the process.
    let base = (mapping.start + (anchor_offset - mapping.offset)).checked_sub(anchor_address)?;
    let mem = std::fs::File::open(proc_path(pid, "mem")).ok()?;
    let read = |address: u64, bytes: &mut [u8]| mem.read_exact_at(bytes, base + address).ok();
    let (mut opt_prof, mut active, mut lg_sample) = ([0u8; 1], [0u8; 1], [0u8; 8]);
    read(switches.opt_prof, &mut opt_prof)?;
    read(switches.active, &mut active)?;
    read(switches.lg_sample, &mut lg_sample)?;
    Some(ProfState {
        opt_prof: opt_prof[0] != 0,
        active: active[0] != 0,
        lg_sample: u64::from_le_bytes(lg_sample),
    })
}
