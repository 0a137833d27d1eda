//! What the kind of targets decides for the whole run, settled once from
//! `--pid`, `--all` or a command to launch.
use crate::run::{Sampling, Targets};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(in crate::run) enum RunScope {
    /// `--pid`: running processes, named.
    Pids,
    /// `--all`: every process, found by scans and by the probes' events.
    All,
    /// A command started with the probes in place.
    Launch,
}

impl RunScope {
    pub fn of(targets: &Targets) -> Self {
        match targets {
            Targets::Pids(_) => RunScope::Pids,
            Targets::All => RunScope::All,
            Targets::Launch(_) => RunScope::Launch,
        }
    }

    /// Whether processes met by a scan or in the probes' events are
    /// profiled as they come, and every process rescanned whole.
    pub fn finds_processes(self) -> bool {
        self == RunScope::All
    }

    /// Whether the run ends once every profiled process exited (a launched
    /// command ends it by its own exit; `--all` waits for more).
    pub fn ends_when_all_exit(self) -> bool {
        self == RunScope::Pids
    }

    /// Whether a process's exit is watched by its pidfd (a launched
    /// command's is seen through its child handle).
    pub fn watches_exits(self) -> bool {
        self != RunScope::Launch
    }

    /// Whether the kernel is to tell of what a process maps: code (with
    /// `--all` every process is rescanned anyway) and anonymous memory for
    /// its memory account (with `--all` that of every process on the host
    /// would be sent).
    pub fn watches_mapped_code(self) -> bool {
        self != RunScope::All
    }

    /// Whether every mapping of the profiled process was seen, from its
    /// start.
    pub fn sees_every_mapping(self) -> bool {
        self == RunScope::Launch
    }

    /// Whether the probes' costs are measured again as the run goes on
    /// (with `--all` the copy timed would be profiled too).
    pub fn recalibrates(self) -> bool {
        self != RunScope::All
    }

    /// Whether a process whose allocators go uncalled is told of (with
    /// `--all` most processes are idle).
    pub fn tells_of_silence(self) -> bool {
        self != RunScope::All
    }

    /// Whether the budget may step one process down: not where its probes
    /// are system-wide (`--all --sampling entry`), shared by every process;
    /// `--all` in windows probes each process on its own, as `--pid` does.
    pub fn budget_applies(self, sampling: Sampling) -> bool {
        self != RunScope::All || sampling == Sampling::Windows
    }
}
