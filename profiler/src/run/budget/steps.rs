//! The budget's answer each tick (a step for each process over it), and
//! its steps taken on the run's probes and snapshots: windows narrowed,
//! frees dropped (after a last exact snapshot), allocators' probes
//! detached (after a snapshot; the process still followed).
use std::time::Instant;

use crate::run::{
    Session,
    actions::Action,
    budget::{INDIRECT_ALLOWANCE, SUSTAINED, Spent, Step},
    notice::CostNotice,
    snapshots::{SnapshotKind, writer::Announce},
};

impl Session<'_> {
    /// Each tick, the budget's answer: a step for each process over it.
    pub(in crate::run) fn budget_actions(&mut self) -> Vec<Action> {
        // No budget (`none`, or system-wide probes): nothing to read each
        // tick.
        let Some(limit) = self.budget.limit() else {
            return Vec::new();
        };
        let added = self.costs.ledger.per_process(&self.probes.attached);
        let spent: Vec<(u32, Spent)> = self
            .tracked
            .values()
            // One whose allocators' probes are detached has none priced.
            .filter(|t| !t.exited && self.budget.detached(t.pid).is_none())
            .filter_map(|t| {
                let spent = Spent {
                    added: added.get(&t.pid).map_or(0.0, |&(_, seconds)| seconds),
                    cpu: crate::proc::cpu_seconds(t.pid)?,
                };
                Some((t.pid, spent))
            })
            .collect();
        let frees_probed = !self.options.collector.allocations_only;
        let over = self.budget.over(Instant::now(), spent);
        over.into_iter()
            .map(|(pid, share)| Action::Budget {
                pid,
                step: (self.budget).step(pid, self.narrowing_saves(pid), frees_probed),
                reason: OverBudget { share, limit },
            })
            .collect()
    }

    /// Takes one of the budget's steps for `pid` (a process with no frees
    /// left to drop is detached).
    pub(in crate::run) fn take_step(&mut self, pid: u32, step: Step, reason: OverBudget) {
        match step {
            Step::NarrowWindows => self.narrow_windows_for_budget(pid, reason),
            Step::DropFrees if self.probes.drop_frees(pid) > 0 => self.drop_frees(pid, reason),
            Step::DropFrees | Step::DetachAllocators => self.detach_allocators(pid, reason),
        }
    }

    fn narrow_windows_for_budget(&mut self, pid: u32, reason: OverBudget) {
        self.narrow_windows(pid, &reason.to_string());
        self.budget.start_over(pid);
        self.say(CostNotice::WindowsNarrowed {
            pid,
            duty: self.options.windows.least_duty(),
            reason: reason.brief(),
        });
    }

    /// `pid`'s frees were unprobed: its profile written as it was, and
    /// counting allocations only from now on.
    fn drop_frees(&mut self, pid: u32, over: OverBudget) {
        let reason = over.to_string();
        // The last profile whose in-use figures are exact: no event has
        // been applied since the frees were dropped.
        self.snapshot(pid, &reason, SnapshotKind::Requested, Announce::Nothing);
        let forced = self.costs.price(&self.probes);
        self.say_forced_returns(&forced);
        if let Some(t) = self.tracked.get_mut(&pid) {
            t.heap.track_allocations_only();
        }
        self.attach_without_frees(pid);
        self.say(CostNotice::FreesDropped {
            pid,
            reason: over.brief(),
        });
        self.budget.note_frees_dropped(pid, reason);
    }

    /// `pid`'s allocators' probes were detached: its profile written as it
    /// was, and the process still followed to the end of the run (its
    /// mappings, its memory account), at no cost of its own; no allocator
    /// it loads from now on is probed.
    fn detach_allocators(&mut self, pid: u32, over: OverBudget) {
        let reason = over.to_string();
        self.snapshot(
            pid,
            &reason,
            SnapshotKind::Requested,
            Announce::Detached(over.brief()),
        );
        let detached = self.probes.detach_process(pid);
        self.sampling.forget(pid);
        self.probes.forget_fast_paths(pid);
        self.probes.forget_exit_counters(pid);
        self.probes.forget_python(pid);
        self.probes.follow_frees(pid, false);
        self.frees_on_request.forget(pid);
        // Its last hits, counted between this tick's reading and the
        // detach, belong to this tick: the endpoints then show its final
        // count at once, not one tick later.
        let forced = self.costs.price(&self.probes);
        self.say_forced_returns(&forced);
        self.budget.note_detached(pid, reason, detached);
    }
}

/// Why a process is over its budget: its probes' cost as a share of its
/// own CPU time, over `limit`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(in crate::run) struct OverBudget {
    pub share: f64,
    pub limit: f64,
}

impl OverBudget {
    /// For stderr, to fit a terminal line with the step it led to.
    pub fn brief(&self) -> String {
        format!(
            "over budget: probes cost {:.0}% of its CPU, limit {:.0}%",
            self.share * 100.0,
            self.limit * 100.0
        )
    }
}

/// In full, for the profile: how the share was reckoned.
impl std::fmt::Display for OverBudget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "over budget: its probes cost it {:.0}% of the CPU time it used itself for {} s \
             ({:.0}% estimated from their measured costs, {:.0}% more allowed for the caches \
             they disturb), above --max-overhead {:.0}%",
            self.share * 100.0,
            SUSTAINED.as_secs(),
            self.share / INDIRECT_ALLOWANCE * 100.0,
            (INDIRECT_ALLOWANCE - 1.0) * 100.0,
            self.limit * 100.0
        )
    }
}
