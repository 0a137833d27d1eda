//! A process that runs jemalloc's own profiler (`prof:true`, active) has
//! its samples taken where jemalloc records them (see
//! `discover::own_sampling`): a trap per sample and per slow free instead
//! of one per free.
use std::{
    os::unix::fs::FileExt,
    path::{Path, PathBuf},
};

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
    pub thread_active_init: bool,
    pub lg_sample: u64,
}

impl ProfState {
    /// Whether jemalloc samples (every thread, new ones too), and if not
    /// why, when its profiler is on.
    fn samples(&self) -> Result<(), Option<&'static str>> {
        match (self.opt_prof, self.active, self.thread_active_init) {
            (false, ..) => Err(None),
            (true, false, _) => Err(Some("not active (prof.active false)")),
            (true, true, false) => Err(Some(
                "not active in new threads (prof.thread_active_init false)",
            )),
            (true, true, true) if self.lg_sample > MAX_LG_SAMPLE => Err(None),
            (true, true, true) => Ok(()),
        }
    }
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
        if let Err(Some(why)) = state.samples()
            && self.options.verbose
        {
            let _ = writeln!(
                self.status,
                "memprobe: pid {pid}: {path}: jemalloc's profiler is built in and on but {why}: \
                 its samples are not used"
            );
        }
        state.samples().ok()?;
        let plan = allocator.on_own_sampling()?;
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
        let file = (path, open_path);
        let slots = self
            .probes
            .attach_again(scope, file, &plan, instance, &[])?;
        self.print_verbose_probes(before);
        let note = own_note(path, interval);
        if let Scope::Process(pid) = scope
            && let Some(t) = self.tracked.get_mut(&pid)
        {
            if self.options.verbose {
                let _ = writeln!(self.status, "memprobe: pid {pid}: {note}");
            }
            t.sampling_notes.push(note);
            t.own_intervals.insert(instance, interval);
            t.own_sampled.push(OwnSampled {
                path: path.to_owned(),
                open_path: open_path.to_owned(),
                allocator: allocator.clone(),
                instance,
                slots: slots.clone(),
            });
        }
        Ok(Some(slots.len()))
    }

    /// Each tick: a copy whose profiler was made inactive (`prof.active`
    /// false: jemalloc takes no more samples) goes back to memprobe's own
    /// sampling; a changed `lg_prof_sample` (`prof.reset`) weighs the
    /// samples that follow.
    pub(super) fn watch_own_profilers(&mut self) {
        let pids: Vec<u32> = self
            .tracked
            .values()
            .filter(|t| !t.exited && t.detached.is_none() && !t.own_sampled.is_empty())
            .map(|t| t.pid)
            .collect();
        for pid in pids {
            let Some(t) = self.tracked.get_mut(&pid) else {
                continue;
            };
            let mut stopped = Vec::new();
            for copy in std::mem::take(&mut t.own_sampled) {
                let Some(own) = copy.allocator.own_sampling.as_ref() else {
                    continue;
                };
                // prof.thread_active_init only matters for threads
                // started later: not a reason to leave.
                match read_switches(pid, &t.maps, &copy.path, &own.switches) {
                    Some(state) if state.opt_prof && state.active => {
                        if state.lg_sample <= MAX_LG_SAMPLE {
                            t.own_intervals.insert(copy.instance, 1 << state.lg_sample);
                        }
                        t.own_sampled.push(copy);
                    }
                    // Unreadable: the process is exiting.
                    None => t.own_sampled.push(copy),
                    Some(_) => stopped.push(copy),
                }
            }
            for copy in stopped {
                self.leave_own_sampling(pid, copy);
            }
        }
    }

    /// Detaches a copy's probes on its profiler and attaches memprobe's
    /// usual ones, saying so.
    fn leave_own_sampling(&mut self, pid: u32, copy: OwnSampled) {
        self.probes.detach_probes(&copy.slots);
        let note = own_note(&copy.path, 0);
        if let Some(t) = self.tracked.get_mut(&pid) {
            t.sampling_notes.retain(|n| !n.starts_with(&note));
            t.own_intervals.remove(&copy.instance);
        }
        self.clear_progress();
        let _ = writeln!(
            self.status,
            "memprobe: pid {pid}: {}: jemalloc's profiler was made inactive (prof.active \
             false); memprobe samples its allocations itself from now on",
            copy.path
        );
        let file = (copy.path.as_str(), copy.open_path.as_path());
        let scope = Scope::Process(pid);
        let result = self
            .instance()
            .and_then(|instance| self.attach_usual(scope, file, &copy.allocator, instance));
        if let Err(error) = result {
            let _ = writeln!(
                self.status,
                "memprobe: warning: pid {pid}: {}: {}; its allocations are no longer sampled",
                copy.path,
                crate::error::chain(&error)
            );
        }
    }
}

/// A copy sampled through jemalloc's profiler, watched in case it stops.
#[derive(Debug)]
pub(super) struct OwnSampled {
    path: String,
    open_path: PathBuf,
    allocator: Allocator,
    instance: u16,
    /// Its probes' indexes.
    slots: Vec<usize>,
}

/// The profile's note for a copy sampled through jemalloc's profiler; its
/// start alone (up to the interval) with `interval` 0.
fn own_note(path: &str, interval: u64) -> String {
    let start = format!("{path}: jemalloc's own samples (its profiler runs: prof:true");
    if interval == 0 {
        return start;
    }
    format!("{start}, one sample per {interval} bytes on average)")
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
    let flag = |address: u64| {
        let mut byte = [0u8; 1];
        read(address, &mut byte).map(|_| byte[0] != 0)
    };
    let mut lg_sample = [0u8; 8];
    read(switches.lg_sample, &mut lg_sample)?;
    Some(ProfState {
        opt_prof: flag(switches.opt_prof)?,
        active: flag(switches.active)?,
        thread_active_init: flag(switches.thread_active_init)?,
        lg_sample: u64::from_le_bytes(lg_sample),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jemalloc_samples_only_when_on_and_active_for_every_thread() {
        let state = |opt_prof, active, thread_active_init, lg_sample| ProfState {
            opt_prof,
            active,
            thread_active_init,
            lg_sample,
        };
        assert_eq!(state(true, true, true, 19).samples(), Ok(()));
        // Not built in or not on: nothing to say.
        assert_eq!(state(false, true, true, 19).samples(), Err(None));
        let inactive = state(true, false, true, 19).samples();
        assert!(inactive.unwrap_err().unwrap().contains("prof.active false"));
        let new_threads = state(true, true, false, 19).samples();
        assert!(
            new_threads
                .unwrap_err()
                .unwrap()
                .contains("thread_active_init")
        );
        // A value no jemalloc holds: the memory read was not its switch.
        assert_eq!(state(true, true, true, 64).samples(), Err(None));
    }
}
