//! `--max-overhead PCT`: a process whose probes cost it more than PCT% of
//! the CPU time it uses itself for [`SUSTAINED`] in a row is made cheaper,
//! step by step, and memprobe says why: a production process is never
//! slowed beyond what the user allowed for longer than that. (A share of
//! its own CPU time, not of one CPU: 10% of one CPU is a quarter of a
//! percent of a database using 40, and a tenfold slowdown of a process
//! using a tenth of one. Probes that cost under
//! [`NEGLIGIBLE`](window::NEGLIGIBLE) of one CPU are never over: a process
//! that sleeps uses next to nothing itself.)
//! 1. Where its sampling windows make a good part of the cost, they are
//!    narrowed to their least, and its profile's `# malloc_sampling:`
//!    says since when; it is judged again at its new cost.
//! 2. Else its frees are no longer probed: a snapshot is written (the last
//!    exact in-use profile), and from then on its profile counts
//!    allocations only, which each snapshot's `# tracking:` note says.
//!    On a busy jemalloc process frees are nearly all the cost (its
//!    allocations are sampled in windows, every free traps).
//! 3. Still over for another [`SUSTAINED`], or with no frees to drop: its
//!    profile is written and its allocators' probes detached. It is still
//!    followed to the end of the run, at no cost of its own: its memory
//!    account (read from `/proc`) and the memory it maps (a probe at
//!    `mmap`, a rare call: glibc's big requests among them) in each
//!    snapshot, its heap as it was at the step. A user who asked for
//!    `--duration 10m` gets ten minutes, whatever the allocator.
//!
//! The cost is its probe hits times the per-hit costs measured on this
//! host (and, where probes are perf events on its main thread, that
//! thread's context switches times their measured cost), with
//! [`INDIRECT_ALLOWANCE`] on top. System-wide probes (`--all`) are shared
//! by every process and cannot be detached from one: the budget applies to
//! `--pid` and launched processes.
mod steps;
mod window;

use std::{collections::HashMap, time::Instant};

pub(in crate::run) use steps::OverBudget;
use window::BudgetWindow;
pub(in crate::run) use window::Spent;
pub(in crate::run) use window::{INDIRECT_ALLOWANCE, SUSTAINED};

/// The share of a process's probe cost its windows must make for
/// narrowing them to be the budget's first step.
const NARROWING_WORTH: f64 = 1.0 / 3.0;

/// The budget's next step for a process over it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(in crate::run) enum Step {
    NarrowWindows,
    DropFrees,
    DetachAllocators,
}

/// One of the budget's steps, taken for one process: when, and what its
/// probes cost then, against what budget.
#[derive(Clone, Debug)]
struct Taken {
    at: std::time::SystemTime,
    why: String,
}

impl Taken {
    fn now(why: String) -> Self {
        Self {
            at: std::time::SystemTime::now(),
            why,
        }
    }

    fn since(&self) -> String {
        format!(
            "since {} ({})",
            humantime::format_rfc3339_seconds(self.at),
            self.why
        )
    }
}

/// `--max-overhead`: each process's recent cost, and the steps taken.
#[derive(Debug, Default)]
pub(in crate::run) struct Budget {
    /// The budget, a share of the CPU time a process uses itself; `None`:
    /// none (`--max-overhead none`, or `--all --sampling entry`, whose
    /// system-wide probes cannot be detached from one process).
    limit: Option<f64>,
    windows: HashMap<u32, BudgetWindow>,
    frees_dropped: HashMap<u32, Taken>,
    /// Allocators' probes detached from a process over budget: when and
    /// why, and how many.
    detached: HashMap<u32, (Taken, usize)>,
}

impl Budget {
    pub fn new(limit: Option<f64>) -> Self {
        Self {
            limit,
            ..Self::default()
        }
    }

    pub fn limit(&self) -> Option<f64> {
        self.limit
    }

    /// Takes what each process has spent so far; the processes over budget
    /// for [`SUSTAINED`], with their probes' cost as a share of their own
    /// CPU time.
    pub fn over(&mut self, now: Instant, spent: Vec<(u32, Spent)>) -> Vec<(u32, f64)> {
        let Some(limit) = self.limit else {
            return Vec::new();
        };
        spent
            .into_iter()
            .filter_map(|(pid, spent)| {
                let window = self.windows.entry(pid).or_default();
                Some((pid, window.observe(now, spent, limit)?))
            })
            .collect()
    }

    /// The next step for `pid`, over budget: its windows narrowed where
    /// that would save (`narrowing_saves`, a share of a CPU) a good part
    /// of its probes' cost (judged again afterwards, at the new cost); else
    /// its frees dropped where it has any probed (`frees_probed`); else
    /// its allocators' probes detached. A busy process whose frees cost
    /// most goes past the windows at once.
    pub fn step(&self, pid: u32, narrowing_saves: Option<f64>, frees_probed: bool) -> Step {
        let cost = self.windows.get(&pid).map_or(0.0, |w| w.cost);
        match narrowing_saves {
            Some(saves) if saves >= cost * NARROWING_WORTH => Step::NarrowWindows,
            _ if frees_probed && !self.frees_dropped.contains_key(&pid) => Step::DropFrees,
            _ => Step::DetachAllocators,
        }
    }

    /// `pid` was made cheaper: judged again afresh, at its new cost.
    pub fn start_over(&mut self, pid: u32) {
        self.windows.remove(&pid);
    }

    pub fn note_frees_dropped(&mut self, pid: u32, why: String) {
        self.start_over(pid);
        self.frees_dropped.insert(pid, Taken::now(why));
    }

    pub fn note_detached(&mut self, pid: u32, why: String, probes: usize) {
        self.start_over(pid);
        self.detached.insert(pid, (Taken::now(why), probes));
    }

    /// Whether `pid`'s frees are no longer probed.
    pub fn frees_dropped(&self, pid: u32) -> bool {
        self.frees_dropped.contains_key(&pid)
    }

    /// How many probes were detached from `pid` for its cost.
    pub fn detached(&self, pid: u32) -> Option<usize> {
        self.detached.get(&pid).map(|(_, probes)| *probes)
    }

    /// What the steps taken for `pid` left tracked, and since when (the
    /// profile's `# tracking:` note); `None` where none was taken.
    pub fn tracking_note(&self, pid: u32) -> Option<String> {
        let frees = self.frees_dropped.get(&pid).map(|taken| {
            format!(
                "allocations only {}: what was allocated since counts as in use",
                taken.since()
            )
        });
        let detached = self.detached.get(&pid).map(|(taken, _)| {
            format!(
                "no allocation calls {}: the heap as it was then, its memory account and \
                 mappings to the end",
                taken.since()
            )
        });
        let notes: Vec<String> = frees.into_iter().chain(detached).collect();
        (!notes.is_empty()).then(|| notes.join("; "))
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn windows_then_frees_then_the_probes() {
        let mut budget = Budget::new(Some(0.1));
        let start = Instant::now();
        // Probes adding half a CPU to a process using one.
        for (n, added) in [(0, 0.0), (1, 0.5)] {
            let spent = Spent {
                added,
                cpu: n as f64,
            };
            budget.over(start + Duration::from_secs(n), vec![(7, spent)]);
        }
        // Narrowing the windows saves a third of that or more: first.
        assert_eq!(budget.step(7, Some(0.2), true), Step::NarrowWindows);
        // Less, or nothing to narrow: the frees, then the probes.
        assert_eq!(budget.step(7, Some(0.1), true), Step::DropFrees);
        assert_eq!(budget.step(7, None, false), Step::DetachAllocators);
        assert_eq!(budget.tracking_note(7), None);
        budget.note_frees_dropped(7, "over".into());
        assert_eq!(budget.step(7, None, true), Step::DetachAllocators);
        let note = budget.tracking_note(7).unwrap();
        assert!(note.starts_with("allocations only since 20"), "{note}");
        assert!(note.contains("(over): what was allocated"), "{note}");
        // Each step taken is said, in order.
        budget.note_detached(7, "still over".into(), 3);
        let note = budget.tracking_note(7).unwrap();
        let (frees, detached) = note.split_once("; no allocation calls since ").unwrap();
        assert!(frees.contains("(over)"), "{note}");
        assert!(
            detached.contains("(still over): the heap as it was then"),
            "{note}"
        );
        assert_eq!(budget.detached(7), Some(3));
        // No budget: never over.
        let mut none = Budget::new(None);
        let spent = Spent {
            added: 9.0,
            cpu: 1.0,
        };
        assert!(none.over(start, vec![(7, spent)]).is_empty());
    }
}
