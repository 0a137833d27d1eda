//! `--max-overhead PCT`: a process whose probes cost it more than PCT% of
//! the CPU time it uses itself for [`SUSTAINED`] in a row is made cheaper,
//! step by step, and memprobe says why: a production process is never
//! slowed beyond what the user allowed for longer than that. (A share of
//! its own CPU time, not of one CPU: 10% of one CPU is a quarter of a
//! percent of a database using 40, and a tenfold slowdown of a process
//! using a tenth of one. Probes that cost under [`NEGLIGIBLE`] of one CPU
//! are never over: a process that sleeps uses next to nothing itself.)
//! 1. Where its sampling windows make a good part of the cost, they are
//!    narrowed to their least, and its profile's `# malloc_sampling:`
//!    says since when; it is judged again at its new cost.
//! 2. Else its frees are no longer probed: a snapshot is written (the last
//!    exact in-use profile), and from then on its profile counts
//!    allocations only, which each snapshot's `# tracking:` note says.
//!    On a busy jemalloc process frees are nearly all the cost (its
//!    allocations are sampled in windows, every free traps).
//! 3. Still over for another [`SUSTAINED`], or with no frees to drop: its
//!    profile is written and its probes detached.
//!
//! The cost is its probe hits times the per-hit costs measured on this
//! host (and, where probes are perf events on its main thread, that
//! thread's context switches times their measured cost), with
//! [`INDIRECT_ALLOWANCE`] on top. System-wide probes (`--all`) are shared
//! by every process and cannot be detached from one: the budget applies to
//! `--pid` and launched processes.
use std::time::{Duration, Instant};

use crate::run::{
    Session, Targets,
    process::FreesDropped,
    snapshots::{SnapshotKind, writer::Announce},
};

/// How long a process may stay over its budget.
pub const SUSTAINED: Duration = Duration::from_secs(10);

/// Probes costing a process less than this share of one CPU are within
/// any budget.
pub const NEGLIGIBLE: f64 = 0.01;

/// The share of a process's probe cost its windows must make for
/// narrowing them to be the budget's first step.
const NARROWING_WORTH: f64 = 1.0 / 3.0;

/// What the budget counts per unit of estimated cost. The calibration times
/// traps in a tight loop; in a busy server each trap also costs what the
/// kernel's work evicts from the server's caches, which no tight loop
/// shows: a saturated redis-server gained up to 1.43x memprobe's estimate
/// (`cargo xtask bench`, the pipelined redis table; 1.12x to 1.43x over
/// three runs and three modes).
/// Counted here, not in the reported cost: a server that sleeps between
/// requests gains less than the estimate, and the budget must hold for both.
pub const INDIRECT_ALLOWANCE: f64 = 1.5;

/// One process's recent cost, for the budget.
#[derive(Clone, Copy, Debug, Default)]
pub struct BudgetWindow {
    /// Added seconds and CPU seconds so far, and when they were read.
    last: Option<(Spent, Instant)>,
    /// Since when the process has been over budget without a break.
    over_since: Option<Instant>,
    /// What its probes cost over the last reading, a share of one CPU
    /// (their estimated time, no allowance).
    pub cost: f64,
}

/// What a process has spent so far, in seconds: the time its probes added
/// (estimated), and its CPU time (probes included, as the kernel counts).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Spent {
    pub added: f64,
    pub cpu: f64,
}

impl Spent {
    /// What the probes cost since `before`, allowance included, as a share
    /// of the CPU time the process used itself meanwhile (at least a
    /// quarter of what it used: an estimate above the time the traps took
    /// must not make it look idle); 0 under [`NEGLIGIBLE`] of one CPU.
    fn share_since(&self, before: &Spent, elapsed: f64) -> f64 {
        let added = (self.added - before.added).max(0.0) * INDIRECT_ALLOWANCE;
        if added / elapsed < NEGLIGIBLE {
            return 0.0;
        }
        let used = (self.cpu - before.cpu).max(0.0);
        let own = (used - added / INDIRECT_ALLOWANCE).max(used / 4.0);
        added / own.max(1e-3 * elapsed)
    }
}

impl BudgetWindow {
    /// Takes what the process has spent so far; returns its probes' cost
    /// since the last reading, allowance included, as a share of the CPU
    /// time it used itself, once that has been over `budget` for
    /// [`SUSTAINED`].
    pub fn observe(&mut self, now: Instant, spent: Spent, budget: f64) -> Option<f64> {
        let previous = self.last.replace((spent, now));
        let (before, then) = previous?;
        let elapsed = now.duration_since(then).as_secs_f64();
        if elapsed <= 0.0 {
            return None;
        }
        self.cost = (spent.added - before.added).max(0.0) / elapsed;
        let share = spent.share_since(&before, elapsed);
        if share <= budget {
            self.over_since = None;
            return None;
        }
        let since = *self
            .over_since
            .get_or_insert(now - Duration::from_secs_f64(elapsed));
        (now.duration_since(since) >= SUSTAINED).then_some(share)
    }
}

impl Session<'_> {
    /// Each tick: writes and detaches the processes over budget.
    pub(super) fn enforce_budget(&mut self) {
        let Some(budget) = self.options.max_overhead else {
            return;
        };
        if matches!(self.options.targets, Targets::All) {
            return;
        }
        let added = self.ledger.per_process(&self.probes.attached);
        let now = Instant::now();
        let over: Vec<(u32, f64)> = self
            .tracked
            .values_mut()
            .filter(|t| !t.exited)
            .filter_map(|t| {
                let spent = Spent {
                    added: added.get(&t.pid).map_or(0.0, |&(_, seconds)| seconds),
                    cpu: crate::proc::cpu_seconds(t.pid)?,
                };
                Some((t.pid, t.budget.observe(now, spent, budget)?))
            })
            .collect();
        for (pid, share) in over {
            if self.narrow_windows_if_worth(pid, share, budget) {
                continue;
            }
            if !self.drop_frees(pid, share, budget) {
                self.detach_over_budget(pid, share, budget);
            }
        }
    }

    /// The first step, where the windows are a good part of the cost:
    /// `pid`'s windows narrowed to their least. False where they are not.
    fn narrow_windows_if_worth(&mut self, pid: u32, share: f64, budget: f64) -> bool {
        let Some(saves) = self.narrowing_saves(pid) else {
            return false;
        };
        // Worth a step of its own where the windows are a good part of the
        // cost (judged again afterwards, at the new cost); a busy process
        // whose frees cost most goes to the next step at once.
        let cost = self.tracked.get(&pid).map_or(0.0, |t| t.budget.cost);
        if saves < cost * NARROWING_WORTH {
            return false;
        }
        let reason = over_budget(share, budget);
        self.narrow_windows(pid, &reason);
        if let Some(t) = self.tracked.get_mut(&pid) {
            t.budget = BudgetWindow::default();
        }
        self.clear_progress();
        let _ = writeln!(
            self.status,
            "memprobe: pid {pid}: sampling windows narrowed to {:.1}% of the time, {reason}",
            super::sampling::windows::MIN_DUTY * 100.0
        );
        true
    }

    /// The next step: `pid`'s frees unprobed, its profile written as it
    /// was and counting allocations only from now on. False where there is
    /// nothing to drop (dropped already, or no free probed).
    fn drop_frees(&mut self, pid: u32, share: f64, budget: f64) -> bool {
        let Some(t) = self.tracked.get(&pid) else {
            return false;
        };
        if t.frees_dropped.is_some() || self.options.collector.allocations_only {
            return false;
        }
        if self.probes.drop_frees(pid) == 0 {
            return false;
        }
        let reason = over_budget(share, budget);
        // The last profile whose in-use figures are exact: no event has
        // been applied since the frees were dropped.
        self.snapshot(pid, &reason, SnapshotKind::Requested, Announce::Nothing);
        let forced = self.ledger.update(&self.cost_model, &self.probes);
        self.say_forced_returns(&forced);
        let Some(t) = self.tracked.get_mut(&pid) else {
            return true;
        };
        t.heap.track_allocations_only();
        // Judged again afresh, at the new cost.
        t.budget = BudgetWindow::default();
        t.frees_dropped = Some(FreesDropped {
            at: std::time::SystemTime::now(),
            why: reason.clone(),
        });
        self.clear_progress();
        let _ = writeln!(
            self.status,
            "memprobe: pid {pid}: frees no longer tracked, {reason}; its profile counts \
             allocations only from now on"
        );
        true
    }

    fn detach_over_budget(&mut self, pid: u32, share: f64, budget: f64) {
        let reason = over_budget(share, budget);
        self.snapshot(
            pid,
            &reason,
            SnapshotKind::Last,
            Announce::Detached(reason.clone()),
        );
        let detached = self.probes.detach_process(pid);
        // Its last hits, counted between this tick's reading and the
        // detach, belong to this tick: the endpoints then show its final
        // count at once, not one tick later.
        let forced = self.ledger.update(&self.cost_model, &self.probes);
        self.say_forced_returns(&forced);
        if let Some(t) = self.tracked.get_mut(&pid) {
            t.exited = true;
            t.detached = Some(detached);
        }
    }
}

/// Why a process is over its budget, for its profile and stderr.
fn over_budget(share: f64, budget: f64) -> String {
    format!(
        "over budget: its probes cost it {:.0}% of the CPU time it used itself for {} s ({:.0}% \
         estimated from their measured costs, {:.0}% more allowed for the caches they disturb), \
         above --max-overhead {:.0}%",
        share * 100.0,
        SUSTAINED.as_secs(),
        share / INDIRECT_ALLOWANCE * 100.0,
        (INDIRECT_ALLOWANCE - 1.0) * 100.0,
        budget * 100.0
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// After `n` seconds of a process using `cpu` of a CPU, `added` of it
    /// the probes' estimated time.
    fn spent(n: f64, added: f64, cpu: f64) -> Spent {
        Spent {
            added: added * n,
            cpu: cpu * n,
        }
    }

    #[test]
    fn over_budget_only_when_sustained() {
        let start = Instant::now();
        let mut window = BudgetWindow::default();
        let second = |n: u64| start + Duration::from_secs(n);
        assert_eq!(window.observe(second(0), spent(0.0, 0.5, 1.0), 0.1), None);
        // Traps take half of the one CPU it uses: over a 10% budget, said
        // at 10 s.
        for n in 1..10 {
            let observed = window.observe(second(n), spent(n as f64, 0.5, 1.0), 0.1);
            assert_eq!(observed, None, "{n}");
        }
        let share = window
            .observe(second(10), spent(10.0, 0.5, 1.0), 0.1)
            .expect("over for 10 s");
        // 0.75 s counted (the allowance) for 0.5 s of its own.
        assert!((share - 1.5).abs() < 1e-9, "{share}");
        // A quiet second starts the count again.
        let mut window = BudgetWindow::default();
        let mut at = Spent::default();
        window.observe(second(0), at, 0.1);
        for n in 1..16 {
            let quiet = n == 6;
            at.added += if quiet { 0.0 } else { 0.5 };
            at.cpu += 1.0;
            let observed = window.observe(second(n), at, 0.1);
            assert_eq!(observed, None, "{n}");
        }
        at.added += 0.5;
        at.cpu += 1.0;
        assert!(window.observe(second(16), at, 0.1).is_some());
    }

    #[test]
    fn the_budget_is_a_share_of_what_the_process_uses_itself() {
        let start = Instant::now();
        let second = |n: u64| start + Duration::from_secs(n);
        let over = |added: f64, cpu: f64| {
            let mut window = BudgetWindow::default();
            (0..=10).any(|n| {
                window
                    .observe(second(n), spent(n as f64, added, cpu), 0.1)
                    .is_some()
            })
        };
        // A database using 40 CPUs, its probes 2 of them: 3 counted
        // against its 38, 8%: within a 10% budget.
        assert!(!over(2.0, 40.0));
        // A process using a tenth of a CPU, its probes 2% of one: 3%
        // counted against its own 8%, over.
        assert!(over(0.02, 0.1));
        // A process that sleeps: probes at 0.5% of a CPU are negligible.
        assert!(!over(0.005, 0.006));
        // The allowance counts: probes estimated at 6.5% of the one CPU
        // it uses, 9.75% counted against its own 93.5%: 10.4%, over; 6%
        // stays under.
        assert!(over(0.065, 1.0));
        assert!(!over(0.06, 1.0));
    }
}
