//! Probes on memprobe's own calibration copy (`run::calibrate`): which
//! links the kernel takes, and the kinds of hit timed there, kept outside
//! the attached probes' list.
use std::path::Path;

use profiler_common::{cookie, programs};

use crate::{
    kernel::error::Result,
    kernel::{
        KernelProbes, ProbeLinks, Scope,
        attach::Target,
        features::{self, KernelFeature},
        uprobe_multi::{LinkKind, MultiPrograms},
    },
};

/// Probes attached for timing them (see
/// [`KernelProbes::attach_for_calibration`]).
pub struct CalibrationProbes(ProbeLinks);

/// The cookie of every calibration probe: its hits go to the last counter
/// slot, which real probes reach only beyond `MAX_COUNTED_PROBES`.
fn calibration_cookie() -> u64 {
    cookie::encode(cookie::MAX_PROBES - 1, 0, u16::MAX, false)
}

impl CalibrationProbes {
    /// How many perf events these put on the copy's main thread (see
    /// [`KernelProbes::task_events`]).
    pub fn task_events(&self) -> usize {
        self.0.uprobes.len()
    }
}

impl KernelProbes {
    /// Finds out which links the kernel takes before any allocator is
    /// probed, on a function of memprobe's own (the calibration copy's,
    /// process `pid`): uprobe sessions, and uprobe_multi links for the
    /// plain programs, used from the calibration on (which confirms that
    /// they run in a thread other than the main one).
    pub fn check_links(&mut self, path: &Path, offset: u64, pid: u32) {
        let name = path.to_string_lossy();
        let Ok(target) = Target::new(Scope::Process(pid), &name, path) else {
            return;
        };
        let cookie = calibration_cookie();
        // The links are dropped at once: only the kernel's answer matters.
        let _ = self.link_session(programs::session::SLOW_PATH, &target, offset, cookie);
        if features::pretended_missing(KernelFeature::UprobeMulti) {
            return;
        }
        let Some(code) = &self.linkable else { return };
        let mut links = MultiPrograms::new(code.clone(), LinkKind::Entry);
        let linked = links.attach(programs::FREE_ARG0, (path, offset), cookie, pid, false);
        self.entry_links = linked.is_ok().then_some(links);
    }

    /// Back to perf-event uprobes for the plain programs: the kernel took
    /// their uprobe_multi links but did not run them (see `check_links`).
    pub fn give_up_entry_links(&mut self) {
        self.entry_links = None;
    }

    /// Attaches `programs` (each with a byte offset past `offset`) to the
    /// file at `path` in `pid`, outside the attached probes' list: for
    /// timing the probes on this host (`run::calibrate`).
    pub fn attach_for_calibration(
        &mut self,
        programs: &[(&'static str, u64)],
        path: &Path,
        offset: u64,
        pid: u32,
    ) -> Result<CalibrationProbes> {
        let name = path.to_string_lossy();
        let target = Target::new(Scope::Process(pid), &name, path)?;
        let cookie = calibration_cookie();
        let mut links = ProbeLinks::default();
        for &(program, delta) in programs {
            if let Err(cause) =
                self.attach_plain(program, &target, offset + delta, cookie, &mut links)
            {
                self.detach_links(links);
                return Err(target.error(program, cause));
            }
        }
        Ok(CalibrationProbes(links))
    }

    /// Adds to `probes` a uprobe session at `offset` in `path` linked for
    /// process `pid`, which never runs it: in the process timed it is
    /// filtered out and asks for the return half of every call, as another
    /// profiled process's session on a shared file does. Whether the
    /// kernel took it (it has sessions).
    pub fn add_foreign_session(
        &mut self,
        probes: &mut CalibrationProbes,
        path: &Path,
        offset: u64,
        pid: u32,
    ) -> bool {
        let name = path.to_string_lossy();
        let Ok(target) = Target::new(Scope::Process(pid), &name, path) else {
            return false;
        };
        let cookie = calibration_cookie();
        match self.link_session(programs::session::SLOW_PATH, &target, offset, cookie) {
            Ok(link) => {
                probes.0.multi.push(link);
                true
            }
            Err(_) => false,
        }
    }

    pub fn detach_calibration(&mut self, probes: CalibrationProbes) {
        self.detach_links(probes.0);
    }
}
