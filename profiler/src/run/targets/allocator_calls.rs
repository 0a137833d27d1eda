//! Which allocators each process was found with, how often each was called,
//! and a word when none is: a process that allocates through something
//! memprobe does not probe would otherwise get a silent, empty profile.
use std::{path::Path, time::Duration};

use crate::{
    kernel::Scope,
    run::{Session, actions::Action, notice::TargetNotice},
};

/// How long a process's probed allocators may go uncalled before memprobe
/// says so.
const SILENCE: Duration = Duration::from_secs(10);

impl Session<'_> {
    /// Each allocator probed for `pid` ("glibc in libc.so.6") with its
    /// allocation calls so far (`None` for system-wide probes, whose hits
    /// are not told apart by process).
    pub(in crate::run) fn allocator_calls(
        &self,
        pid: u32,
        hits: &[u64],
    ) -> Vec<(String, Option<u64>)> {
        let mut calls: Vec<(String, Option<u64>)> = Vec::new();
        for (index_of_probe, probe) in self.probes.attached.iter().enumerate() {
            let counted = match probe.scope {
                Scope::Process(p) if p == pid => true,
                Scope::AllProcesses if self.maps_file(pid, &probe.path) => false,
                _ => continue,
            };
            let file = Path::new(&probe.path).file_name().unwrap_or_default();
            let label = format!("{} in {}", probe.allocator, file.to_string_lossy());
            let index = match calls.iter().position(|(l, _)| *l == label) {
                Some(index) => index,
                None => {
                    calls.push((label, counted.then_some(0)));
                    calls.len() - 1
                }
            };
            if let Some(total) = &mut calls[index].1
                && probe.shape.allocates()
            {
                *total += hits.get(index_of_probe).copied().unwrap_or(0);
            }
        }
        calls
    }

    fn maps_file(&self, pid: u32, path: &str) -> bool {
        self.tracked
            .get(&pid)
            .is_some_and(|t| t.maps.contains(path))
    }

    /// Once a process's probes have been attached for [`SILENCE`] without
    /// one allocation call, a word (once) naming the allocators probed.
    pub(in crate::run) fn silence_actions(&mut self) -> Vec<Action> {
        let mut actions = Vec::new();
        if !self.scope.tells_of_silence() || self.started.elapsed() < SILENCE {
            return actions;
        }
        let hits = self.probes.probe_hits();
        let pids: Vec<u32> = self
            .tracked
            .values()
            .filter(|t| !t.exited && !t.silence_reported)
            .map(|t| t.pid)
            .collect();
        for pid in pids {
            let calls = self.allocator_calls(pid, &hits);
            let total: u64 = calls.iter().filter_map(|(_, n)| *n).sum();
            let Some(t) = self.tracked.get_mut(&pid) else {
                continue;
            };
            if total > 0 || calls.is_empty() {
                continue;
            }
            t.silence_reported = true;
            let notice = TargetNotice::Silent {
                pid,
                command: t.command.clone(),
                seconds: SILENCE.as_secs(),
                allocators: calls.into_iter().map(|(label, _)| label).collect(),
            };
            actions.push(Action::Say(notice.into()));
        }
        actions
    }
}

/// "glibc in libc.so.6: 12 calls, jemalloc in libjemalloc.so.2: 0 calls".
pub(in crate::run) fn describe(calls: &[(String, Option<u64>)]) -> String {
    calls
        .iter()
        .map(|(label, n)| match n {
            Some(n) => format!("{label}: {n} calls"),
            None => label.clone(),
        })
        .collect::<Vec<_>>()
        .join(", ")
}
