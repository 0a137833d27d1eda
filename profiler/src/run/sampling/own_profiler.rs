//! A process that runs jemalloc's own profiler (`prof:true`, active) has
//! its samples taken where jemalloc records them (see
//! `discover::own_sampling`): a trap per sample and per slow free instead
//! of one per free.
use std::path::{Path, PathBuf};

use crate::{
    discover::{Allocator, own_sampling::ProfSwitches},
    error::Result,
    kernel::Scope,
    proc::{ProcessMemory, file_base},
    run::{Sampling, Session, actions::Action, notice::SamplingNotice},
};

/// jemalloc's profiler switches as a process has them now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(in crate::run) struct ProfState {
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
        if self.options.sampling == Sampling::Entry {
            return None;
        }
        let own = allocator.own_sampling.as_ref()?;
        let maps = &self.tracked.get(&pid)?.maps;
        let state = read_switches(pid, maps, path, &own.switches)?;
        if let Err(why) = state.samples() {
            if let Some(why) = why {
                self.say(SamplingNotice::OwnProfilerUnused {
                    pid,
                    path: path.to_owned(),
                    why: why.to_owned(),
                });
            }
            return None;
        }
        let plan = allocator.on_own_sampling()?;
        Some((plan, 1u64 << state.lg_sample))
    }

    /// Attaches to `allocator` through its own profiler when its process
    /// runs it; `Ok(None)` when it does not (the caller attaches as usual).
    pub(in crate::run) fn attach_own_sampling(
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
            && self.tracked.contains_key(&pid)
        {
            self.sampling.of_mut(pid).notes.push(note.clone());
            self.say(SamplingNotice::Sampling { pid, note });
        }
        self.watch(
            scope,
            file,
            allocator,
            (instance, slots.clone()),
            Some(interval),
        );
        Ok(Some(slots.len()))
    }

    /// Keeps an eye on the profiler switches of a copy that has them, with
    /// its probes' `slots`; `taking`: the interval of jemalloc's samples
    /// when they are taken now.
    pub(in crate::run) fn watch(
        &mut self,
        scope: Scope,
        (path, open_path): (&str, &Path),
        allocator: &Allocator,
        (instance, slots): (u16, Vec<usize>),
        taking: Option<u64>,
    ) {
        let Scope::Process(pid) = scope else {
            return;
        };
        if allocator.own_sampling.is_none() {
            return;
        }
        if self.tracked.contains_key(&pid) {
            self.sampling.of_mut(pid).watched.push(WatchedCopy {
                path: path.to_owned(),
                open_path: open_path.to_owned(),
                allocator: allocator.clone(),
                instance,
                slots,
                taking,
            });
        }
    }

    /// Each tick: a copy whose profiler was made inactive (`prof.active`
    /// false: jemalloc takes no more samples) goes back to memprobe's own
    /// sampling, one whose profiler was made active has its samples taken
    /// from then on; a changed `lg_prof_sample` (`prof.reset`) weighs the
    /// samples that follow.
    pub(in crate::run) fn own_profiler_actions(&mut self) -> Vec<Action> {
        let pids: Vec<u32> = self
            .tracked
            .values()
            .filter(|t| !t.exited)
            .filter(|t| {
                self.sampling
                    .of(t.pid)
                    .is_some_and(|s| !s.watched.is_empty())
            })
            .map(|t| t.pid)
            .collect();
        let mut changed = Vec::new();
        for pid in pids {
            let Some(t) = self.tracked.get(&pid) else {
                continue;
            };
            let watched = &mut self.sampling.of_mut(pid).watched;
            for mut copy in std::mem::take(watched) {
                let Some(own) = copy.allocator.own_sampling.as_ref() else {
                    continue;
                };
                let Some(state) = read_switches(pid, &t.maps, &copy.path, &own.switches) else {
                    // Unreadable: the process is exiting.
                    watched.push(copy);
                    continue;
                };
                // prof.thread_active_init only matters for threads started
                // later: not a reason to leave.
                let keep = match copy.taking {
                    Some(_) => state.opt_prof && state.active,
                    None => state.samples().is_err(),
                };
                if !keep {
                    let copy = Box::new(copy);
                    changed.push(Action::ChangeSampling { pid, copy });
                    continue;
                }
                if let Some(interval) = copy.taking.as_mut()
                    && state.lg_sample <= MAX_LG_SAMPLE
                {
                    *interval = 1 << state.lg_sample;
                }
                watched.push(copy);
            }
        }
        changed
    }

    /// Detaches a copy's probes (on its profiler, or memprobe's usual ones
    /// with their windows) and attaches the other kind, saying so.
    pub(in crate::run) fn change_sampling(&mut self, pid: u32, copy: WatchedCopy) {
        let mut slots = copy.slots.clone();
        let mut forgotten = 0;
        if let Some(t) = self.tracked.get_mut(&pid) {
            let sampling = self.sampling.of_mut(pid);
            let prefix = format!("{}: ", copy.path);
            sampling.notes.retain(|n| !n.starts_with(&prefix));
            if let Some(windows) = sampling.windows.as_mut() {
                slots.extend(windows.remove_copy(copy.instance));
            }
            // jemalloc's samples free through probed paths; memprobe's own
            // mostly through the fast path, unseen once its free probes go.
            if copy.taking.is_none() {
                forgotten = t.heap.forget_copy(copy.instance);
            }
        }
        self.probes.detach_probes(&slots);
        self.frees_on_request.forget_copy(pid, copy.instance);
        self.say(SamplingNotice::OwnProfilerSwitched {
            pid,
            path: copy.path.clone(),
            active: copy.taking.is_none(),
            forgotten,
        });
        let file = (copy.path.as_str(), copy.open_path.as_path());
        let scope = Scope::Process(pid);
        let allocator = &copy.allocator;
        let result = self.instance().and_then(|instance| {
            if copy.taking.is_none()
                && self
                    .attach_own_sampling(scope, file, allocator, instance)?
                    .is_some()
            {
                return Ok(());
            }
            self.attach_usual(scope, file, allocator, instance)
                .map(|_| ())
        });
        if let Err(error) = result {
            self.say(SamplingNotice::SamplingLost {
                pid,
                path: copy.path.clone(),
                error: crate::error::chain(&error),
            });
        }
    }
}

/// A copy whose jemalloc has a profiler, watched in case it is switched on
/// or off.
#[derive(Debug)]
pub(in crate::run) struct WatchedCopy {
    path: String,
    open_path: PathBuf,
    allocator: Allocator,
    instance: u16,
    /// Its probes' indexes.
    slots: Vec<usize>,
    /// While its samples are jemalloc's, their mean interval (else
    /// memprobe samples it itself).
    taking: Option<u64>,
}

/// The mean interval of the samples jemalloc's profiler takes for the copy
/// `instance` among `watched`; 0 (memprobe's) when it takes none.
pub(in crate::run) fn own_interval(watched: &[WatchedCopy], instance: u16) -> Option<u64> {
    watched
        .iter()
        .find(|copy| copy.instance == instance)
        .and_then(|copy| copy.taking)
}

/// The profile's note for a copy sampled through jemalloc's profiler.
fn own_note(path: &str, interval: u64) -> String {
    format!(
        "{path}: jemalloc's own samples (its profiler runs: prof:true, one sample per \
         {interval} bytes on average)"
    )
}

/// `opt_prof`, `prof_active_state` and `lg_prof_sample` as `pid` has them,
/// read from `/proc/PID/mem` (never written); `None` if unreadable.
pub(in crate::run) fn read_switches(
    pid: u32,
    maps: &str,
    path: &str,
    switches: &ProfSwitches,
) -> Option<ProfState> {
    let base = file_base(maps, path, switches.anchor)?;
    let mem = ProcessMemory::open(pid)?;
    let read = |address: u64, bytes: &mut [u8]| mem.read(base + address, bytes);
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
