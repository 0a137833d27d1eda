//! `--sampling windows`: jemalloc's `malloc` and `operator new` probed only
//! in short windows opened at random times, so that no call traps outside
//! them and nothing in the program's own cycle can line up with the
//! samples. Its slow path stays probed for the requests above 4 KiB
//! (every one reaches it: a big buffer is never left to chance), and its
//! other entry points and its frees stay probed as always.
//!
//! Inside a window every call traps, so the program runs slower there than
//! outside: a window sees fewer calls than its share of time. Its samples
//! are weighed by what each thread did instead, read from jemalloc's own
//! allocated-bytes counter in the thread's TLS: at its first windowed call
//! and after its last. A sample stands for its window's bytes times the
//! bytes its thread allocated from the end of its previous window to the
//! end of this one, over the bytes it allocated within this one. The
//! window's events are held until it closes and those weights are known.
use std::{
    collections::HashMap,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use aya::maps::{MapData, RingBuf};
use profiler_common::FastPathConfig;

use crate::{
    discover::Allocator,
    kernel::{Scope, ThreadWindow, events::Event},
    run::Session,
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
    fn gap(&self) -> Duration {
        let mean = self.every.saturating_sub(self.length).as_secs_f64();
        Duration::from_secs_f64(mean * rand::random_range(0.5..1.5))
    }
}

/// One jemalloc copy of a process sampled in windows.
#[derive(Debug)]
pub(super) struct WindowedCopy {
    pub path: String,
    pub open_path: PathBuf,
    pub instance: u16,
    /// `malloc` and `operator new`: what a window attaches.
    pub served: Allocator,
    /// The copy's counters, as the kernel is told them (its window number
    /// changes with each window).
    pub config: FastPathConfig,
    /// The probe indexes the served entry points take each time.
    slots: Vec<usize>,
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
pub(super) struct Windows {
    copies: Vec<WindowedCopy>,
    /// The window open now (its number), and since when.
    open: Option<(u64, Instant)>,
    next_open: Instant,
    /// Windows opened so far.
    pub opened: u64,
    /// Events that came while a window was open, applied once it closes.
    held: Vec<Event>,
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
    fn next_change(&self, timing: &WindowTiming) -> Instant {
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
    fn weigh(&mut self, number: u64, records: &[(u32, ThreadWindow)]) -> HashMap<u32, f64> {
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

impl Session<'_> {
    /// Samples `copy` of `pid` in windows from now on; the profile says so.
    pub(super) fn start_windows(&mut self, pid: u32, copy: WindowedCopy) {
        let timing = self.options.windows;
        let note = format!(
            "{}: malloc and operator new in windows of {} every {} on average (weighed by \
             jemalloc's per-thread byte counter), requests above 4 KiB on its slow path",
            copy.path,
            humantime::format_duration(timing.length),
            humantime::format_duration(timing.every)
        );
        if self.options.verbose {
            let _ = writeln!(self.status, "memprobe: pid {pid}: {note}");
        }
        let Some(t) = self.tracked.get_mut(&pid) else {
            return;
        };
        t.sampling_notes.push(note);
        t.windows.get_or_insert_with(Windows::new).add(copy);
    }

    /// A copy whose window could not open: its `malloc` and `operator new`
    /// probed at every call from now on, and said.
    fn fall_back_to_entry(&mut self, pid: u32, copy: &WindowedCopy, why: &str) {
        let file = (copy.path.as_str(), copy.open_path.as_path());
        let attached = self.probes.attach_again(
            Scope::Process(pid),
            file,
            &copy.served,
            copy.instance,
            &copy.slots,
        );
        self.clear_progress();
        let _ = writeln!(
            self.status,
            "memprobe: warning: pid {pid}: {}: a sampling window could not open ({why}); {}",
            copy.path,
            match attached {
                Ok(_) => "malloc and operator new sampled at every call from now on",
                Err(_) => "malloc and operator new are no longer sampled",
            }
        );
        if let Some(t) = self.tracked.get_mut(&pid) {
            let prefix = format!("{}: malloc and operator new in windows", copy.path);
            t.sampling_notes.retain(|n| !n.starts_with(&prefix));
            t.sampling_notes.push(format!(
                "{}: at entry (a window could not open: {why})",
                copy.path
            ));
        }
    }

    /// When any process's window opens or closes next.
    pub(super) fn next_window_change(&self) -> Option<Instant> {
        let timing = &self.options.windows;
        self.tracked
            .values()
            .filter(|t| !t.exited)
            .filter_map(|t| t.windows.as_ref())
            .filter(|w| !w.copies.is_empty())
            .map(|w| w.next_change(timing))
            .min()
    }

    /// Opens and closes the windows that are due.
    pub(super) fn change_windows(&mut self, ring: &mut RingBuf<MapData>) {
        let now = Instant::now();
        let timing = self.options.windows;
        let due: Vec<(u32, bool)> = self
            .tracked
            .values()
            .filter(|t| !t.exited)
            .filter_map(|t| Some((t.pid, t.windows.as_ref()?)))
            .filter(|(_, w)| !w.copies.is_empty() && w.next_change(&timing) <= now)
            .map(|(pid, w)| (pid, w.open.is_some()))
            .collect();
        for (pid, open) in due {
            if open {
                self.close_window(pid, Some(&mut *ring));
            } else {
                self.open_window(pid);
            }
        }
    }

    fn open_window(&mut self, pid: u32) {
        let Some(mut windows) = self.tracked.get_mut(&pid).and_then(|t| t.windows.take()) else {
            return;
        };
        let number = windows.opened + 1;
        let mut failed = Vec::new();
        for (k, copy) in windows.copies.iter_mut().enumerate() {
            copy.config.window = number;
            let told = self.probes.set_fast_path(pid, copy.instance, copy.config);
            let file = (copy.path.as_str(), copy.open_path.as_path());
            let attached = told
                .then(|| {
                    self.probes.attach_window(
                        Scope::Process(pid),
                        file,
                        &copy.served,
                        copy.instance,
                        &copy.slots,
                    )
                })
                .map(|result| result.map_err(|e| crate::error::chain(&e)))
                .unwrap_or_else(|| Err("the kernel's table of fast paths is full".into()));
            match attached {
                Ok(slots) => copy.slots = slots,
                Err(why) => failed.push((k, why)),
            }
        }
        // A copy whose window cannot open is sampled at entry from now on.
        for (k, why) in failed.into_iter().rev() {
            let copy = windows.copies.remove(k);
            self.fall_back_to_entry(pid, &copy, &why);
        }
        windows.opened = number;
        windows.open = Some((number, Instant::now()));
        if let Some(t) = self.tracked.get_mut(&pid) {
            t.windows = Some(windows);
        }
    }

    /// At the end of the run, one last window in every process sampled in
    /// windows (the one open, or a new one), closed with the ring drained:
    /// what each thread allocated since its previous window is in the last
    /// profile, not left out.
    pub(super) async fn last_windows(&mut self, ring: &mut RingBuf<MapData>) {
        let pids: Vec<(u32, bool)> = self
            .tracked
            .values()
            .filter(|t| !t.exited)
            .filter_map(|t| Some((t.pid, t.windows.as_ref()?)))
            .filter(|(_, w)| !w.copies.is_empty())
            .map(|(pid, w)| (pid, w.open.is_some()))
            .collect();
        if pids.is_empty() {
            return;
        }
        for &(pid, open) in &pids {
            if !open {
                self.open_window(pid);
            }
        }
        tokio::time::sleep(self.options.windows.length).await;
        for (pid, _) in pids {
            self.close_window(pid, Some(&mut *ring));
        }
    }

    /// Closes `pid`'s window if one is open (before a snapshot: what it
    /// held is then in it).
    pub(super) fn close_open_window(&mut self, pid: u32) {
        let open = self
            .tracked
            .get(&pid)
            .and_then(|t| t.windows.as_ref())
            .is_some_and(|w| w.open.is_some());
        if open {
            self.close_window(pid, None);
        }
    }

    /// Detaches the window's probes, takes the events still in the ring
    /// (where it is at hand), weighs the window's samples and applies what
    /// was held.
    fn close_window(&mut self, pid: u32, ring: Option<&mut RingBuf<MapData>>) {
        let slots: Vec<usize> = self
            .tracked
            .get(&pid)
            .and_then(|t| t.windows.as_ref())
            .map(|w| {
                w.copies
                    .iter()
                    .flat_map(|c| c.slots.iter().copied())
                    .collect()
            })
            .unwrap_or_default();
        self.probes.detach_probes(&slots);
        if let Some(ring) = ring {
            while !self.drain(ring) {}
        }
        let Some(t) = self.tracked.get_mut(&pid) else {
            return;
        };
        let Some(windows) = t.windows.as_mut() else {
            return;
        };
        let Some((number, _)) = windows.open.take() else {
            return;
        };
        let mut tids: Vec<u32> = crate::proc::thread_ids(pid);
        tids.extend(windows.held.iter().map(|e| e.header().tid));
        tids.sort_unstable();
        tids.dedup();
        let records: Vec<(u32, ThreadWindow)> = tids
            .into_iter()
            .filter_map(|tid| Some((tid, self.probes.thread_window(pid, tid)?)))
            .collect();
        let scales = windows.weigh(number, &records);
        windows.next_open = Instant::now() + self.options.windows.gap();
        for mut event in std::mem::take(&mut windows.held) {
            if let Event::Sampled {
                header,
                scale: Some(scale),
                ..
            } = &mut event
            {
                // A thread whose counters were not read is not guessed at.
                *scale = scales.get(&header.tid).copied().unwrap_or(0.0);
            }
            t.heap.apply(event);
        }
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
