//! `--sampling slow-path` is tried, not trusted: a thread's byte threshold
//! falls every 64 KiB, so a program whose allocations repeat in a cycle
//! that divides it (48 B then 16 B, say) always crosses on the same call,
//! and that site would take every byte. Each jemalloc copy is first sampled
//! on its slow path until [`PHASE`] and [`MIN_SAMPLES`] have passed, then at
//! entry for as long; the share of bytes each call site allocated in the
//! two phases is compared: alike, the copy goes back to its slow path;
//! different beyond sampling noise, it stays at entry for good, and
//! memprobe says so.
use std::{
    collections::HashMap,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use crate::{discover::Allocator, kernel::Scope, run::Session};

/// Least time in each phase.
const PHASE: Duration = Duration::from_secs(5);
/// Least samples in each phase before comparing.
const MIN_SAMPLES: u64 = 30;
/// Shares further apart than this (total variation distance), and than
/// their noise, mean the slow path is not a fair sample here.
const MAX_DISTANCE: f64 = 0.2;

/// Bytes per call site and samples, at one moment.
#[derive(Clone, Debug, Default)]
struct Totals {
    samples: u64,
    sites: HashMap<u64, f64>,
}

impl Totals {
    /// Each site's share of the bytes allocated since `start`, and how
    /// many samples that took.
    fn shares_since(&self, start: &Totals) -> (HashMap<u64, f64>, u64) {
        let grown: HashMap<u64, f64> = self
            .sites
            .iter()
            .map(|(&site, &bytes)| (site, bytes - start.sites.get(&site).copied().unwrap_or(0.0)))
            .filter(|(_, bytes)| *bytes > 0.0)
            .collect();
        let total: f64 = grown.values().sum();
        let shares = grown
            .into_iter()
            .map(|(site, bytes)| (site, bytes / total.max(1.0)))
            .collect();
        (shares, self.samples - start.samples)
    }
}

/// Where a trial is.
#[derive(Debug)]
enum Phase {
    /// On the slow path since `since`.
    Slow {
        since: Instant,
        start: Totals,
    },
    /// Sampling at entry since `since`, with the slow path's shares.
    Entry {
        since: Instant,
        start: Totals,
        slow: (HashMap<u64, f64>, u64),
    },
    /// Decided: on the slow path, or back at entry.
    Kept,
    FellBack,
}

/// One jemalloc copy of one process on trial.
#[derive(Debug)]
pub(super) struct Trial {
    path: String,
    open_path: PathBuf,
    instance: u16,
    /// The entry points the slow path stands in for, and the slow path.
    served: Allocator,
    slow: Allocator,
    /// The probes attached now for whichever is in use (the slow path's
    /// at first).
    probes: Vec<usize>,
    phase: Phase,
}

impl Trial {
    pub(super) fn new(
        path: &str,
        open_path: &Path,
        instance: u16,
        served: Allocator,
        slow: Allocator,
        slow_probes: Vec<usize>,
    ) -> Self {
        Self {
            path: path.to_owned(),
            open_path: open_path.to_owned(),
            instance,
            served,
            slow,
            probes: slow_probes,
            phase: Phase::Kept,
        }
    }

    /// The snapshot note: how this copy's malloc is sampled.
    pub(super) fn note(&self) -> String {
        let state = match self.phase {
            Phase::Slow { .. } => "on jemalloc's slow path, on trial against entry sampling",
            Phase::Entry { .. } => "at entry, for a trial of jemalloc's slow path",
            Phase::Kept => {
                "on jemalloc's slow path (its sites' shares agreed with entry sampling's)"
            }
            Phase::FellBack => "at entry (jemalloc's slow path disagreed with entry sampling)",
        };
        format!("{}: {state}", self.path)
    }
}

/// Half the summed differences of two share maps: 0 alike, 1 disjoint.
fn distance(a: &HashMap<u64, f64>, b: &HashMap<u64, f64>) -> f64 {
    let sites: std::collections::HashSet<&u64> = a.keys().chain(b.keys()).collect();
    let sum: f64 = sites
        .into_iter()
        .map(|site| (a.get(site).unwrap_or(&0.0) - b.get(site).unwrap_or(&0.0)).abs())
        .sum();
    sum / 2.0
}

/// Whether two phases' shares differ beyond their sampling noise.
fn disagree(slow: &(HashMap<u64, f64>, u64), entry: &(HashMap<u64, f64>, u64)) -> Option<f64> {
    let d = distance(&entry.0, &slow.0);
    let noise = 2.5 / (entry.1.min(slow.1).max(1) as f64).sqrt();
    (d > MAX_DISTANCE.max(noise)).then_some(d)
}

impl Session<'_> {
    fn totals(&self, pid: u32) -> Totals {
        self.tracked
            .get(&pid)
            .map(|t| Totals {
                samples: t.heap.samples,
                sites: t.heap.allocated_by_site(),
            })
            .unwrap_or_default()
    }

    pub(super) fn start_trial(&mut self, pid: u32, mut trial: Trial) {
        if self.options.verbose {
            let _ = writeln!(
                self.status,
                "memprobe: pid {pid}: {}: malloc and operator new sampled on jemalloc's slow \
                 path (on trial against entry sampling)",
                trial.path
            );
        }
        trial.phase = Phase::Slow {
            since: Instant::now(),
            start: self.totals(pid),
        };
        if let Some(t) = self.tracked.get_mut(&pid) {
            t.trials.push(trial);
        }
    }

    /// Each tick: moves trials on.
    pub(super) fn advance_trials(&mut self) {
        let pids: Vec<u32> = self
            .tracked
            .values()
            .filter(|t| !t.exited && !t.trials.is_empty())
            .map(|t| t.pid)
            .collect();
        for pid in pids {
            let Some(mut trials) = self
                .tracked
                .get_mut(&pid)
                .map(|t| std::mem::take(&mut t.trials))
            else {
                continue;
            };
            for trial in &mut trials {
                self.advance(pid, trial);
            }
            if let Some(t) = self.tracked.get_mut(&pid) {
                t.trials = trials;
            }
        }
    }

    fn advance(&mut self, pid: u32, trial: &mut Trial) {
        let now = Instant::now();
        let totals = self.totals(pid);
        match &trial.phase {
            Phase::Slow { since, start } => {
                let shares = totals.shares_since(start);
                if now.duration_since(*since) < PHASE || shares.1 < MIN_SAMPLES {
                    return;
                }
                if self.swap(pid, trial, false) {
                    trial.phase = Phase::Entry {
                        since: now,
                        start: totals,
                        slow: shares,
                    };
                }
            }
            Phase::Entry { since, start, slow } => {
                let shares = totals.shares_since(start);
                if now.duration_since(*since) < PHASE || shares.1 < MIN_SAMPLES {
                    return;
                }
                match disagree(slow, &shares) {
                    Some(d) => {
                        trial.phase = Phase::FellBack;
                        self.clear_progress();
                        let _ = writeln!(
                            self.status,
                            "memprobe: pid {pid}: {}: back to entry sampling: on jemalloc's slow \
                             path its call sites' shares of bytes differed from entry \
                             sampling's by {:.0}% (allocations in a cycle that the thread \
                             threshold aliases with)",
                            trial.path,
                            d * 100.0
                        );
                    }
                    None if self.swap(pid, trial, true) => trial.phase = Phase::Kept,
                    None => trial.phase = Phase::FellBack,
                }
            }
            Phase::Kept | Phase::FellBack => {}
        }
    }

    /// Moves a trial's copy to its slow path (`to_slow`) or back to entry
    /// sampling; false (nothing changed) if the new probes cannot attach.
    fn swap(&mut self, pid: u32, trial: &mut Trial, to_slow: bool) -> bool {
        let part = if to_slow { &trial.slow } else { &trial.served };
        let before = self.probes.attached.len();
        let scope = Scope::Process(pid);
        let attached =
            self.probes
                .attach(scope, &trial.path, &trial.open_path, part, trial.instance);
        if attached.is_err() {
            return false;
        }
        self.probes.detach_probes(&trial.probes);
        trial.probes = (before..self.probes.attached.len()).collect();
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aliased_shares_disagree_and_noise_does_not() {
        let shares = |pairs: &[(u64, f64)]| pairs.iter().copied().collect::<HashMap<_, _>>();
        let entry = (shares(&[(1, 0.75), (2, 0.25)]), 200);
        // Every crossing on the 16-byte call: all its bytes to site 2.
        let aliased = (shares(&[(2, 1.0)]), 200);
        assert!(disagree(&entry, &aliased).is_some());
        let close = (shares(&[(1, 0.70), (2, 0.30)]), 200);
        assert_eq!(disagree(&entry, &close), None);
        // Few samples: differences are noise.
        let few = (shares(&[(1, 0.5), (2, 0.5)]), 10);
        assert_eq!(disagree(&entry, &few), None);
    }
}
