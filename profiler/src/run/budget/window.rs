//! One process's recent cost against its budget: what its probes added
//! and what it used itself, read once a tick, and how long it has been
//! over.
use std::time::{Duration, Instant};

/// How long a process may stay over its budget.
pub const SUSTAINED: Duration = Duration::from_secs(10);

/// Probes costing a process less than this share of one CPU are within
/// any budget.
pub const NEGLIGIBLE: f64 = 0.01;

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
pub(super) struct BudgetWindow {
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
pub(in crate::run) struct Spent {
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
