//! What a process's windows keep: their timing, the copies they attach,
//! the events held while one is open, and each thread's account of bytes
//! by which its samples are weighed.
use std::{
    collections::HashMap,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use profiler_common::FastPathConfig;

use crate::{
    discover::Allocator,
    kernel::{ThreadWindow, events::Event},
};

/// How long a window stays open, and the mean time between two.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WindowTiming {
    pub length: Duration,
    pub every: Duration,
}

impl Default for WindowTiming {
    /// 100 ms every 4 s on average: 2.5% of the time.
    fn default() -> Self {
        Self {
            length: Duration::from_millis(100),
            every: Duration::from_secs(4),
        }
    }
}

impl WindowTiming {
    /// The wait before the next window: uniform from half the mean to one
    /// and a half times it, so that window times follow no period of the
    /// program's shorter than that spread, while each window stands for a
    /// stretch of the run of about the same length (a sample stands for
    /// the bytes since the window before: exponential gaps, a few many
    /// times the mean, made a few windows' samples weigh most of the run).
    pub(super) fn gap(&self) -> Duration {
        let mean = self.every.saturating_sub(self.length).as_secs_f64();
        Duration::from_secs_f64(mean * rand::random_range(0.5..1.5))
    }
}

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
    pub(super) next_open: Instant,
    /// Windows opened so far.
    pub opened: u64,
    /// Events that came while a window was open, applied once it closes.
    pub(super) held: Vec<Event>,
    /// Per thread, jemalloc's counter at the end of its last window.
    ends: HashMap<u32, u64>,
}

/// Events held in one window at most: past this the window closes early.
const MAX_HELD: usize = 1 << 16;

impl Windows {
    pub fn new() -> Self {
        Self {
            copies: Vec::new(),
            open: None,
            // The first one at once: threads busy at the attach are seen
            // from then on.
            next_open: Instant::now(),
            opened: 0,
            held: Vec::new(),
            ends: HashMap::new(),
        }
    }

    pub fn add(&mut self, copy: WindowedCopy) {
        self.copies.push(copy);
    }

    /// When this process's next window opens or its open one closes.
    pub(super) fn next_change(&self, timing: &WindowTiming) -> Instant {
        match self.open {
            Some((_, since)) if self.held.len() >= MAX_HELD => since,
            Some((_, since)) => since + timing.length,
            None => self.next_open,
        }
    }

    /// Holds `event` while a window is open; gives it back otherwise.
    pub fn hold(&mut self, event: Event) -> Option<Event> {
        if self.open.is_none() {
            return Some(event);
        }
        self.held.push(event);
        None
    }

    /// The weight of each thread's samples in window `number`, from what
    /// the kernel noted of its counters: the bytes it allocated from the
    /// end of its previous window to the end of this one, over the bytes it
    /// allocated within this one. (Each window's own ratio, so that each
    /// stands for its own stretch of the run: a ratio pooled over windows
    /// weighs a window by others, and a thread's first window, which stands
    /// for itself alone, pulled the pooled ratio of the next ones down by
    /// a third in tests.)
    pub(super) fn weigh(
        &mut self,
        number: u64,
        records: &[(u32, ThreadWindow)],
    ) -> HashMap<u32, f64> {
        let mut scales = HashMap::new();
        for &(tid, record) in records {
            if record.window != number {
                continue;
            }
            let within = record.end.wrapping_sub(record.first);
            // Its first window stands for what it allocated since it was
            // first seen on the slow path (or itself alone).
            let since = self
                .ends
                .get(&tid)
                .copied()
                .or((record.base > 0).then_some(record.base))
                .filter(|&start| start <= record.first)
                .unwrap_or(record.first);
            self.ends.insert(tid, record.end);
            if within > 0 && record.end >= since {
                scales.insert(tid, (record.end - since) as f64 / within as f64);
            }
        }
        scales
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(window: u64, first: u64, end: u64, base: u64) -> ThreadWindow {
        ThreadWindow {
            window,
            first,
            end,
            base,
        }
    }

    #[test]
    fn a_window_stands_for_what_its_thread_allocated_since_the_last() {
        let mut windows = Windows::new();
        // Thread 7 first seen on the slow path at 1,000 bytes, its first
        // window from 41,000 to 42,000: 41,000 bytes in all for 1,000 seen.
        let scales = windows.weigh(1, &[(7, record(1, 41_000, 42_000, 1_000))]);
        assert_eq!(scales[&7], 41.0);
        // The next window from 100,000 to 102,000: 60,000 bytes since the
        // last one ended, for 2,000 seen.
        let scales = windows.weigh(2, &[(7, record(2, 100_000, 102_000, 1_000))]);
        assert_eq!(scales[&7], 30.0);
        // A thread with no call in this window (its record an older one's)
        // gets no weight, and its end is kept for its next window.
        let scales = windows.weigh(3, &[(7, record(2, 100_000, 102_000, 1_000))]);
        assert!(scales.is_empty());
        let scales = windows.weigh(4, &[(7, record(4, 200_000, 201_000, 1_000))]);
        assert_eq!(scales[&7], 99.0);
    }

    #[test]
    fn a_thread_never_seen_on_the_slow_path_stands_for_its_window_alone() {
        let mut windows = Windows::new();
        let scales = windows.weigh(1, &[(3, record(1, 5_000, 6_000, 0))]);
        assert_eq!(scales[&3], 1.0);
    }

    #[test]
    fn windows_follow_no_period() {
        let timing = WindowTiming::default();
        let gaps: Vec<f64> = (0..2000).map(|_| timing.gap().as_secs_f64()).collect();
        let mean = gaps.iter().sum::<f64>() / gaps.len() as f64;
        // Uniform over 1.95 s to 5.85 s (the time between two less a window).
        assert!((mean - 3.9).abs() < 0.1, "{mean}");
        assert!(gaps.iter().all(|&g| (1.95..=5.85).contains(&g)));
        assert!(gaps.iter().any(|&g| g < 2.2) && gaps.iter().any(|&g| g > 5.6));
    }
}
