//! What the run's deciding parts answer a tick with, and the run carrying
//! it out: the budget, the growth triggers, the watch on jemalloc's own
//! profilers and the watch for silent allocators decide on their own state
//! and the facts they are given; the probes, the snapshots and stderr are
//! the run's to act on.
use crate::run::{
    Session,
    budget::{OverBudget, Step},
    notice::Notice,
    sampling::own_profiler::WatchedCopy,
    snapshots::{SnapshotKind, writer::Announce},
};

pub(super) enum Action {
    /// A snapshot of `pid` for `reason`, said as `announce` once written.
    Snapshot {
        pid: u32,
        reason: String,
        announce: Announce,
    },
    /// One of the budget's steps for `pid`, over it for `reason`.
    Budget {
        pid: u32,
        step: Step,
        reason: OverBudget,
    },
    /// `pid`'s copy whose jemalloc profiler was switched on or off: its
    /// probes changed to the other kind.
    ChangeSampling { pid: u32, copy: Box<WatchedCopy> },
    /// A line for the user.
    Say(Notice),
}

impl Session<'_> {
    /// Carries out what a part answered, in order.
    pub(super) fn apply(&mut self, actions: Vec<Action>) {
        for action in actions {
            match action {
                Action::Snapshot {
                    pid,
                    reason,
                    announce,
                } => self.snapshot(pid, &reason, SnapshotKind::Requested, announce),
                Action::Budget { pid, step, reason } => self.take_step(pid, step, reason),
                Action::ChangeSampling { pid, copy } => self.change_sampling(pid, *copy),
                Action::Say(notice) => self.say(notice),
            }
        }
    }
}
