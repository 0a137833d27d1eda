//! What a process's windows keep: the copies they attach, the window
//! open now and the events it holds, and when the next opens, closes or
//! is judged. What they cost is in [`WindowCost`], what each thread
//! allocated in [`ThreadBytes`].
use std::{
    collections::HashMap,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use profiler_common::FastPathConfig;

use super::{
    cost::WindowCost, split::ThreadCounter, tails::Tails, thread_bytes::ThreadBytes,
    timing::WindowTiming,
};
use crate::{
    collect::{HeapEvent, Sample},
    discover::Allocator,
    kernel::ThreadWindow,
};

/// One jemalloc copy of a process sampled in windows.
#[derive(Debug)]
pub(in crate::run) struct WindowedCopy {
    pub path: String,
    pub open_path: PathBuf,
    pub instance: u16,
    /// `malloc` and `operator new`: what a window attaches.
    pub served: Allocator,
    /// The copy's counters, as the kernel is told them (its window number
    /// changes with each window).
    pub config: FastPathConfig,
    /// The probe indexes the served entry points take each time.
    pub(super) slots: Vec<usize>,
}

impl WindowedCopy {
    pub fn new(
        path: &str,
        open_path: &Path,
        instance: u16,
        served: Allocator,
        config: FastPathConfig,
    ) -> Self {
        Self {
            path: path.to_owned(),
            open_path: open_path.to_owned(),
            instance,
            served,
            config,
            slots: Vec::new(),
        }
    }
}

/// One process's windows.
#[derive(Debug)]
pub(in crate::run) struct Windows {
    pub(super) copies: Vec<WindowedCopy>,
    /// The window open now (its number), and since when.
    pub(super) open: Option<(u64, Instant)>,
    /// Whether the window that stays open was found dear at its last
    /// judgement: the next comes after a window's length, and closes it.
    pub(super) dear: bool,
    /// Whether the process was busy before the attach (see
    /// [`Self::busy_before`]).
    busy_at_attach: bool,
    /// Since when its short windows have found calls cheap enough to
    /// probe every one.
    cheap_since: Option<Instant>,
    pub(super) next_open: Instant,
    /// Windows opened so far.
    pub opened: u64,
    /// Short windows that drew samples, and the samples they drew: what a
    /// windowed profile's precision rests on (a run of 20 s at 1% drew two
    /// windows of a few hundred samples).
    pub(super) sampled_windows: u64,
    pub(super) window_samples: u64,
    /// The share of time windows are open now (1: the open one stays open).
    pub(super) duty: f64,
    /// When and why the budget narrowed them to their least (they may then
    /// cost nothing beyond their least share of time).
    pub(super) narrowed: Option<(std::time::SystemTime, String)>,
    /// What they cost, and what the process uses itself: what their cost
    /// is held to a share of.
    pub(super) cost: WindowCost,
    /// Time spent in windows, and since when the process is sampled so.
    pub(super) time_open: Duration,
    /// How long the last short window's probes were in, from its first
    /// attach to its close (its length, and the time its links took to
    /// attach, or the loop to come back to it): its cost is priced over
    /// that span, and the gaps are set from it.
    pub(super) trapping: Duration,
    pub(super) since: Instant,
    /// Events that came while a window was open, applied once it closes.
    pub(super) held: Vec<HeapEvent>,
    /// What each thread allocated, by which its samples are weighed.
    pub(super) bytes: ThreadBytes,
    /// What threads allocate after their last window.
    pub(super) tails: Tails,
}

/// Events held in one window at most: past this the window closes early.
const MAX_HELD: usize = 1 << 16;

/// How often a window that stays open is judged against its cost: found
/// dear, it is judged again [`CONFIRM_AFTER`] later and closes if still
/// dear. A burst that lies between two judgements is seen at every call
/// (the second finds it over): the sites fixture's takes some 0.2 s so.
/// One longer goes on in windows, and what it allocates before its
/// thread's next one, or its end, is counted in the shape of its latest
/// samples (see `tails`). A load that begins after the attach is probed at
/// every call until the judgement after it: a second between judgements
/// cost an idle redis-server whose load began after the attach some
/// 0.6 s at every call, 3 to 4 points of its first half minute.
const CHECK_EVERY: Duration = Duration::from_millis(500);

/// How soon a window that stays open, found dear, is judged again: long
/// enough to tell a burst that ended just before the judgement (nothing
/// traps since) from a load that goes on.
const CONFIRM_AFTER: Duration = Duration::from_millis(50);

/// The share of a CPU a process used between being found and its first
/// window (about half a second of reading its files) that makes it busy
/// before the attach: a server under load, whose work is no burst that
/// began with memprobe, so its first window is judged after a window's
/// length, against that use. An idle process (a fixture waiting for its
/// command, a launched program) uses next to nothing there.
const BUSY_BEFORE: f64 = 0.1;

/// The least span between being found and the first window over which
/// that share is read; a shorter one leaves the first window judged as
/// any other.
const BUSY_SPAN: Duration = Duration::from_millis(100);

/// How long short windows must find calls cheap before every call is
/// probed again: a pause in a busy program's work (a server between two
/// bursts of requests) is no reason to trap at every call when it resumes.
pub(super) const WIDEN_AFTER: Duration = Duration::from_secs(30);

impl Windows {
    /// Windows for a process whose threads are `threads` now.
    pub fn new(timing: &WindowTiming, threads: Vec<u32>) -> Self {
        let now = Instant::now();
        Self {
            copies: Vec::new(),
            open: None,
            dear: false,
            busy_at_attach: false,
            cheap_since: None,
            // The first one at once: threads busy at the attach are seen
            // from then on.
            next_open: now,
            opened: 0,
            sampled_windows: 0,
            window_samples: 0,
            // Adaptive windows start open for good, until their cost says.
            duty: timing.duty(0.0, 0.0),
            narrowed: None,
            cost: WindowCost::new(now),
            time_open: Duration::ZERO,
            trapping: timing.length,
            since: now,
            held: Vec::new(),
            bytes: ThreadBytes::new(threads),
            tails: Tails::default(),
        }
    }

    /// What the process used, `used` of a CPU's time over `span`, from
    /// being found to its first window: busy already, its first window is
    /// judged after a window's length, against that use (its own CPU is
    /// read over half a second at least), and closes if over its cost.
    pub(super) fn busy_before(&mut self, used: Duration, span: Duration) {
        self.busy_at_attach =
            span >= BUSY_SPAN && used.as_secs_f64() >= BUSY_BEFORE * span.as_secs_f64();
        if self.busy_at_attach {
            self.cost.own_cpu = used.as_secs_f64() / span.as_secs_f64();
        }
    }

    /// How long a window that stays open runs before its next judgement:
    /// one found dear at its last, [`CONFIRM_AFTER`]; the one opened at the
    /// attach of a process busy before it, a short window's length (a
    /// second at every call cost such a server some 2% of its first
    /// minute); any other, [`CHECK_EVERY`].
    fn judged_every(&self, timing: &WindowTiming) -> Duration {
        if self.dear {
            CONFIRM_AFTER
        } else if self.busy_at_attach && self.opened == 1 {
            timing.length
        } else {
            CHECK_EVERY
        }
    }

    /// Each thread's counter as the windows begin: the bytes its first
    /// window stands for start there, whether it allocates in the first
    /// seconds, when every call is probed, or not.
    pub(super) fn count_from(&mut self, counters: &[ThreadCounter]) {
        for c in counters {
            self.bytes.count_from(c.tid, c.allocated);
            self.tails.locate(c.tid, c.at);
        }
    }

    pub fn add(&mut self, copy: WindowedCopy) {
        self.copies.push(copy);
    }

    /// Stops sampling copy `instance` in windows; the probe indexes its
    /// windows took, to detach.
    pub fn remove_copy(&mut self, instance: u16) -> Vec<usize> {
        let Some(at) = self.copies.iter().position(|c| c.instance == instance) else {
            return Vec::new();
        };
        self.copies.remove(at).slots
    }

    /// Each copy's note for the profile: how it is sampled, and so far.
    pub fn notes(&self, timing: &WindowTiming) -> Vec<String> {
        self.copies
            .iter()
            .map(|c| {
                let note = super::windows_note(timing, Some(self), c.config.large_above);
                format!("{}: {note}", c.path)
            })
            .collect()
    }

    /// Whether the open window stays open: calls cheap enough to probe
    /// every one, whose samples are applied as they come.
    pub(in crate::run) fn continuous(&self) -> bool {
        self.open.is_some() && self.duty >= 1.0
    }

    /// When this process's next window opens, its open one closes, or the
    /// one that stays open is judged.
    pub(super) fn next_change(&self, timing: &WindowTiming) -> Instant {
        match self.open {
            Some(_) if self.continuous() => self.cost.priced.1 + self.judged_every(timing),
            Some((_, since)) if self.held.len() >= MAX_HELD => since,
            Some((_, since)) => since + timing.length,
            None => self.next_open,
        }
    }

    /// A sample taken outside the windows' probes, which stands for
    /// `bytes`: of a windowed copy (another allocator's calls are not in
    /// its counters), in its thread's bytes outside the windows.
    pub fn count_other(&mut self, sample: &Sample, bytes: f64) {
        if !self.copies.iter().any(|c| c.instance == sample.copy) {
            return;
        }
        (self.bytes).count_other(sample.tid, bytes as u64, self.open.is_some());
    }

    /// Holds `event` while a short window is open; gives it back
    /// otherwise (a window that stays open notes its samples for the
    /// tails, should it close).
    pub fn hold(&mut self, event: HeapEvent) -> Option<HeapEvent> {
        if self.open.is_none() {
            return Some(event);
        }
        if self.continuous() {
            if let HeapEvent::Sampled(sample) = &event
                && sample.scale.is_some()
            {
                self.tails.note_recent(sample);
            }
            return Some(event);
        }
        self.held.push(event);
        None
    }

    /// What the windows may cost on average, a share of a CPU: `cost`
    /// (of [`WindowTiming`]) of what the process uses itself, nothing
    /// once the budget narrowed them.
    pub(super) fn allowed(&self, cost: f64) -> f64 {
        match self.narrowed {
            Some(_) => 0.0,
            None => cost * self.cost.own_cpu,
        }
    }

    /// Takes the share of time in windows their last one asked for
    /// (`wanted`, from [`Self::next_duty`]), at `now`: the share from now
    /// on. Narrower at once; every call again only once windows have
    /// asked for it for [`WIDEN_AFTER`].
    pub(super) fn settle_duty(&mut self, wanted: f64, now: Instant) -> f64 {
        if wanted < 1.0 {
            self.cheap_since = None;
            self.duty = wanted;
            return wanted;
        }
        let since = *self.cheap_since.get_or_insert(now);
        if now.duration_since(since) >= WIDEN_AFTER {
            self.cheap_since = None;
            self.duty = 1.0;
        }
        self.duty
    }

    /// The share of time to open them for windows that cost `open_cost`
    /// of a CPU while open: `timing`'s, and their least once narrowed.
    pub(super) fn next_duty(&self, timing: &WindowTiming, open_cost: f64) -> f64 {
        match (self.narrowed.is_some(), timing.every) {
            (true, Some(_)) => timing.least_duty(),
            _ => timing.duty(open_cost, self.allowed(timing.cost)),
        }
    }

    /// The share of the time since sampling began spent in windows.
    pub fn share_open(&self) -> f64 {
        let open = self.time_open
            + self
                .open
                .map_or(Duration::ZERO, |(_, since)| since.elapsed());
        open.as_secs_f64() / self.since.elapsed().as_secs_f64().max(1e-3)
    }

    /// The weight of each thread's samples in window `number`, from what
    /// the kernel noted of its counters (see [`ThreadBytes::weigh`]); the
    /// threads weighed keep its samples for their tails.
    pub(super) fn weigh(
        &mut self,
        number: u64,
        records: &[(u32, ThreadWindow)],
    ) -> HashMap<u32, f64> {
        let weights = self.bytes.weigh(number, records);
        for (&tid, weight) in &weights {
            self.tails.start(tid, weight.within);
        }
        weights.into_iter().map(|(tid, w)| (tid, w.scale)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_process_busy_before_the_attach_is_judged_after_a_window() {
        let ms = Duration::from_millis;
        let timing = WindowTiming::default();
        let judged = |used, span, opened| {
            let mut windows = Windows::new(&timing, Vec::new());
            windows.busy_before(used, span);
            windows.opened = opened;
            windows.judged_every(&timing)
        };
        // A server at half a CPU over the half second memprobe read it.
        assert_eq!(judged(ms(250), ms(500), 1), timing.length);
        // Its windows that stay open later: a second.
        assert_eq!(judged(ms(250), ms(500), 2), CHECK_EVERY);
        // A fixture waiting for its command.
        assert_eq!(judged(ms(1), ms(500), 1), CHECK_EVERY);
        // Too short a span to tell.
        assert_eq!(judged(ms(20), ms(20), 1), CHECK_EVERY);
        // Found dear: once more, soon.
        let mut windows = Windows::new(&timing, Vec::new());
        windows.dear = true;
        assert_eq!(windows.judged_every(&timing), CONFIRM_AFTER);
    }

    #[test]
    fn a_pause_does_not_bring_back_every_call_at_once() {
        let mut windows = Windows::new(&WindowTiming::default(), vec![3, 7]);
        let start = Instant::now();
        let at = |s: u64| start + Duration::from_secs(s);
        assert_eq!(windows.settle_duty(0.03, at(0)), 0.03);
        // A window in a pause: cheap, but the share stays.
        assert_eq!(windows.settle_duty(1.0, at(4)), 0.03);
        // Busy again: the cheap stretch starts over.
        assert_eq!(windows.settle_duty(0.05, at(8)), 0.05);
        assert_eq!(windows.settle_duty(1.0, at(12)), 0.05);
        assert_eq!(windows.settle_duty(1.0, at(30)), 0.05);
        // Cheap for WIDEN_AFTER: every call.
        assert_eq!(windows.settle_duty(1.0, at(42)), 1.0);
    }

    #[test]
    fn their_cost_is_held_to_a_share_of_what_the_process_uses() {
        let mut windows = Windows::new(&WindowTiming::default(), vec![3, 7]);
        windows.cost.own_cpu = 0.2;
        let cost = super::super::timing::WINDOWS_COST;
        assert!((windows.allowed(cost) - 0.002).abs() < 1e-9);
        // Narrowed by the budget: nothing beyond their least.
        windows.narrowed = Some((std::time::SystemTime::now(), "over budget".into()));
        assert_eq!(windows.allowed(cost), 0.0);
    }
}
