//! `--sampling slow-path` is tried, not trusted: a thread's byte threshold
//! falls every 64 KiB, so a program whose allocations repeat in a cycle
//! that divides it (48 B then 16 B, say) always crosses on the same call,
//! and that site would take every byte. Each jemalloc copy alternates,
//! a tick at a time, between its slow path and entry sampling until each
//! has had [`PHASE`] and [`MIN_SAMPLES`]; the share of bytes each call site
//! allocated in the two modes is compared: alike, the copy stays on its
//! slow path; different beyond sampling noise, it goes back to entry
//! sampling, and memprobe says so. Either way it is tried again after
//! `--recheck-every`: programs change their ways.
use std::{
    collections::HashMap,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use crate::{discover::Allocator, kernel::Scope, run::Session};

/// Least time in each phase.
const PHASE: Duration = Duration::from_secs(5);
/// A slice's length in a mode before switching to the other: one to three
/// ticks at random (less a margin for the ticks' jitter), so that a
/// program whose work changes in phases (redis-benchmark's SETs, then its
/// GETs) does not keep meeting the same mode in the same phase.
fn slice_length() -> Duration {
    Duration::from_millis(rand::random_range(1..=3u64) * 1000 - 100)
}
/// Least samples in each phase before comparing.
const MIN_SAMPLES: u64 = 30;

/// Bytes per call site and samples, at one moment or gathered over a
/// mode's slices.
#[derive(Clone, Debug, Default)]
pub(super) struct Totals {
    samples: u64,
    sites: HashMap<u64, f64>,
}

impl Totals {
    /// Adds what grew from `start` to `now`.
    fn gather(&mut self, start: &Totals, now: &Totals) {
        self.samples += now.samples - start.samples;
        for (&site, &bytes) in &now.sites {
            let grown = bytes - start.sites.get(&site).copied().unwrap_or(0.0);
            if grown > 0.0 {
                *self.sites.entry(site).or_default() += grown;
            }
        }
    }

    /// Each site's share of the bytes, and how many samples that took.
    fn shares(&self) -> (HashMap<u64, f64>, u64) {
        let total: f64 = self.sites.values().sum();
        let shares = self
            .sites
            .iter()
            .map(|(&site, &bytes)| (site, bytes / total.max(1.0)))
            .collect();
        (shares, self.samples)
    }
}

/// One mode's slices so far.
#[derive(Clone, Debug, Default)]
struct Gathered {
    time: Duration,
    totals: Totals,
}

impl Gathered {
    fn enough(&self) -> bool {
        self.time >= PHASE && self.totals.samples >= MIN_SAMPLES
    }
}

/// Alternating one-tick slices on the slow path and at entry, so that
/// both see the same mix of the program's work.
#[derive(Debug)]
struct Comparison {
    /// When the current slice began, the totals then, and how long it lasts.
    slice: (Instant, Totals, Duration),
    slow: Gathered,
    entry: Gathered,
    /// For a re-check (`--recheck-every`), whether the copy was on its
    /// slow path before; `None` for the trial at attach.
    was_kept: Option<bool>,
}

impl Comparison {
    /// Starts on the slow path, where the copy is.
    fn start(totals: Totals, was_kept: Option<bool>) -> Box<Self> {
        Box::new(Self {
            slice: (Instant::now(), totals, slice_length()),
            slow: Gathered::default(),
            entry: Gathered::default(),
            was_kept,
        })
    }
}

/// Where a trial is.
#[derive(Debug)]
enum Phase {
    Comparing(Box<Comparison>),
    /// Decided (since then): on the slow path, or back at entry; tried
    /// again after `--recheck-every` either way.
    Kept(Instant),
    FellBack(Instant),
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
    /// The probe indexes of the slow path's part and of the served entry
    /// points' (none until first attached): each part goes back into its
    /// own at every swap.
    slow_slots: Vec<usize>,
    served_slots: Vec<usize>,
    /// Which part is attached now (the slow path's at first).
    on_slow_path: bool,
    phase: Phase,
}

impl Trial {
    /// A copy on trial from now, on its slow path; `totals` are its
    /// process's now (`Session::totals`).
    pub(super) fn new(
        path: &str,
        open_path: &Path,
        instance: u16,
        served: Allocator,
        slow: Allocator,
        slow_probes: Vec<usize>,
        totals: Totals,
    ) -> Self {
        Self {
            path: path.to_owned(),
            open_path: open_path.to_owned(),
            instance,
            served,
            slow,
            slow_slots: slow_probes,
            served_slots: Vec::new(),
            on_slow_path: true,
            phase: Phase::Comparing(Comparison::start(totals, None)),
        }
    }

    pub(super) fn instance(&self) -> u16 {
        self.instance
    }

    /// Every probe index the trial's parts used.
    pub(super) fn slots(self) -> impl Iterator<Item = usize> {
        self.slow_slots.into_iter().chain(self.served_slots)
    }

    /// The snapshot note: how this copy's malloc is sampled.
    pub(super) fn note(&self) -> String {
        let kept = "on jemalloc's slow path (its sites' shares agreed with entry sampling's)";
        let back = "at entry (jemalloc's slow path disagreed with entry sampling)";
        let state = match &self.phase {
            Phase::Comparing(comparison) => match comparison.was_kept {
                None => "on trial: jemalloc's slow path against entry sampling".to_owned(),
                Some(true) => format!("{kept}; being tried again"),
                Some(false) => format!("{back}; being tried again"),
            },
            Phase::Kept(_) => kept.to_owned(),
            Phase::FellBack(_) => back.to_owned(),
        };
        format!("{}: {state}", self.path)
    }
}

/// Least change in a site's share that counts as a disagreement.
const MIN_SHIFT: f64 = 0.1;
/// Standard errors a site's change must exceed.
const SIGMAS: f64 = 4.0;

/// The largest change in one site's share between the two phases that is
/// beyond sampling noise (more than [`SIGMAS`] standard errors of the
/// difference of two shares estimated from that many samples, and more
/// than [`MIN_SHIFT`]); `None` when the phases agree. Aliasing moves a
/// site's bytes wholesale to another; noise spreads thinly over many.
fn disagree(slow: &(HashMap<u64, f64>, u64), entry: &(HashMap<u64, f64>, u64)) -> Option<f64> {
    let (a, b) = (&slow.0, &entry.0);
    let spread = 1.0 / slow.1.max(1) as f64 + 1.0 / entry.1.max(1) as f64;
    let sites: std::collections::HashSet<&u64> = a.keys().chain(b.keys()).collect();
    sites
        .into_iter()
        .filter_map(|site| {
            let (pa, pb) = (
                a.get(site).copied().unwrap_or(0.0),
                b.get(site).copied().unwrap_or(0.0),
            );
            let pooled = (pa + pb) / 2.0;
            let error = (pooled * (1.0 - pooled) * spread).sqrt();
            let shift = (pa - pb).abs();
            (shift > MIN_SHIFT && shift > SIGMAS * error).then_some(shift)
        })
        .max_by(f64::total_cmp)
}

impl Session<'_> {
    pub(super) fn totals(&self, pid: u32) -> Totals {
        self.tracked
            .get(&pid)
            .map(|t| Totals {
                samples: t.heap.samples,
                sites: t.heap.allocated_by_site(),
            })
            .unwrap_or_default()
    }

    pub(super) fn start_trial(&mut self, pid: u32, trial: Trial) {
        if self.options.verbose {
            let _ = writeln!(
                self.status,
                "memprobe: pid {pid}: {}: malloc and operator new sampled on jemalloc's slow \
                 path (on trial against entry sampling)",
                trial.path
            );
        }
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

    /// A decided copy, tried again once `--recheck-every` has passed, in
    /// case the program changed its ways: a kept one may have begun a
    /// cycle, one back at entry may have ended its cycle.
    fn recheck(&mut self, pid: u32, trial: &mut Trial) {
        let (since, was_kept) = match trial.phase {
            Phase::Kept(since) => (since, true),
            Phase::FellBack(since) => (since, false),
            Phase::Comparing(_) => return,
        };
        let due = self
            .options
            .recheck_every
            .is_some_and(|every| since.elapsed() >= every);
        if !due {
            return;
        }
        // The comparison starts on the slow path.
        if !self.swap(pid, trial, true) {
            trial.phase = Phase::FellBack(Instant::now());
            return;
        }
        trial.phase = Phase::Comparing(Comparison::start(self.totals(pid), Some(was_kept)));
    }

    fn advance(&mut self, pid: u32, trial: &mut Trial) {
        let comparison = match std::mem::replace(&mut trial.phase, Phase::FellBack(Instant::now()))
        {
            Phase::Comparing(comparison) => comparison,
            decided => {
                trial.phase = decided;
                self.recheck(pid, trial);
                return;
            }
        };
        let now = Instant::now();
        if now.duration_since(comparison.slice.0) < comparison.slice.2 {
            trial.phase = Phase::Comparing(comparison);
            return;
        }
        let on_slow_path = trial.on_slow_path;
        let Comparison {
            slice,
            mut slow,
            mut entry,
            was_kept,
        } = *comparison;
        let totals = self.totals(pid);
        let gathered = if on_slow_path { &mut slow } else { &mut entry };
        gathered.time += now.duration_since(slice.0);
        gathered.totals.gather(&slice.1, &totals);
        if !(slow.enough() && entry.enough()) {
            // The next slice in the other mode (or this one again if the
            // probes could not be swapped).
            self.swap(pid, trial, !on_slow_path);
            trial.phase = Phase::Comparing(Box::new(Comparison {
                slice: (now, totals, slice_length()),
                slow,
                entry,
                was_kept,
            }));
            return;
        }
        self.decide(pid, trial, (&slow.totals, &entry.totals), was_kept);
    }

    /// Both modes have had enough: keeps the slow path, or goes back to
    /// entry sampling until the next re-check; says so when that changed
    /// (after every trial with --verbose).
    fn decide(
        &mut self,
        pid: u32,
        trial: &mut Trial,
        (slow, entry): (&Totals, &Totals),
        was_kept: Option<bool>,
    ) {
        let now = Instant::now();
        let shift = disagree(&slow.shares(), &entry.shares());
        // Where the copy ends up (where it is, if the probes cannot swap).
        let kept = match shift {
            Some(_) => !self.swap(pid, trial, false),
            None => self.swap(pid, trial, true),
        };
        trial.phase = if kept {
            Phase::Kept(now)
        } else {
            Phase::FellBack(now)
        };
        if was_kept == Some(kept) && !self.options.verbose {
            return;
        }
        let line = match (shift, kept) {
            (Some(shift), false) => format!(
                "back to entry sampling: on jemalloc's slow path a call site's share of bytes \
                 differed from entry sampling's by {:.0} points (allocations in a cycle that the \
                 thread threshold aliases with)",
                shift * 100.0
            ),
            (None, true) => format!(
                "{}: its call sites' shares of bytes agreed with entry sampling's ({} and {} \
                 samples)",
                if was_kept == Some(false) {
                    "on jemalloc's slow path again"
                } else {
                    "stays on jemalloc's slow path"
                },
                slow.samples,
                entry.samples
            ),
            // The probes could not swap: the warning said so.
            _ => return,
        };
        self.clear_progress();
        let _ = writeln!(self.status, "memprobe: pid {pid}: {}: {line}", trial.path);
    }

    /// Moves a trial's copy to its slow path (`to_slow`) or back to entry
    /// sampling, each part into its own probe indexes; false (nothing
    /// changed) if the new probes cannot attach.
    fn swap(&mut self, pid: u32, trial: &mut Trial, to_slow: bool) -> bool {
        if trial.on_slow_path == to_slow {
            return true;
        }
        // The part to attach, its slots, and the attached part's slots.
        let (part, slots, attached_now) = if to_slow {
            (&trial.slow, &mut trial.slow_slots, &trial.served_slots)
        } else {
            (&trial.served, &mut trial.served_slots, &trial.slow_slots)
        };
        let scope = Scope::Process(pid);
        let file = (trial.path.as_str(), trial.open_path.as_path());
        match self
            .probes
            .attach_again(scope, file, part, trial.instance, slots)
        {
            Ok(used) => *slots = used,
            Err(error) => {
                self.clear_progress();
                let _ = writeln!(
                    self.status,
                    "memprobe: warning: pid {pid}: {}: the trial of jemalloc's slow path stops: {}",
                    trial.path,
                    crate::error::chain(&error)
                );
                return false;
            }
        }
        self.probes.detach_probes(attached_now);
        trial.on_slow_path = to_slow;
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
        // Thirty sites of 1/30 each, 160 samples a phase: noise moves each
        // a little, none by ten points.
        let even = shares(&(0..30).map(|s| (s, 1.0 / 30.0)).collect::<Vec<_>>());
        let mut noisy = even.clone();
        for (site, share) in noisy.iter_mut() {
            *share *= if site % 2 == 0 { 1.6 } else { 0.4 };
        }
        assert_eq!(disagree(&(even, 160), &(noisy, 160)), None);
    }
}
