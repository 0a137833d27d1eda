//! What the run's deciding parts answer a tick with, and the run carrying
//! it out: the budget and the growth triggers decide on their own state
//! and the facts they are given; the probes and the snapshots are the
//! run's to act on.
use crate::run::{
    Session,
    budget::Step,
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
        reason: String,
    },
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
            }
        }
    }
}
