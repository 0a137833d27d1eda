//! What each thread allocated, read from jemalloc's per-thread counter:
//! where its last window ended, and the bytes its samples taken outside
//! the windows stand for. A window's samples are weighed from this, each
//! thread's on its own.
use std::collections::{HashMap, HashSet};

use crate::kernel::ThreadWindow;

/// Each thread's bytes, as the windows weigh them.
#[derive(Debug, Default)]
pub(super) struct ThreadBytes {
    /// Per thread, jemalloc's counter at the end of its last window, less
    /// `others` then.
    ends: HashMap<u32, u64>,
    /// Per thread, the bytes its samples taken outside the windows' probes
    /// stand for (requests no thread cache holds, entry points probed at
    /// every call), since the windows began, and of those the ones taken
    /// while its window was open: its counter counts them too, and a
    /// window's samples stand only for the rest (else a 64 MiB buffer
    /// allocated between two windows was counted again in the shape of
    /// the next one's samples).
    others: HashMap<u32, u64>,
    others_in_window: HashMap<u32, u64>,
    /// The process's threads when its windows began (empty where they
    /// could not be read): one born since counted its bytes from 0 then.
    present_at_start: HashSet<u32>,
}

/// One thread's weight in a window: what each of its samples is scaled
/// by, and the bytes it allocated within the window.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct Weight {
    pub scale: f64,
    pub within: u64,
}

/// What a thread allocated since its last window.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum SinceLastWindow {
    /// The bytes since its last weighed window ended.
    Window(u64),
    /// No window of it was weighed: all it allocated, if it was born since
    /// the windows began; else 0 (what it allocated before is unknown).
    NoWindow(u64),
}

impl ThreadBytes {
    /// The account of a process whose threads are `threads` now.
    pub fn new(threads: Vec<u32>) -> Self {
        Self {
            present_at_start: threads.into_iter().collect(),
            ..Self::default()
        }
    }

    /// Thread `tid`'s counter as the windows begin, at `allocated`: the
    /// bytes its first window stands for start there.
    pub fn count_from(&mut self, tid: u32, allocated: u64) {
        self.ends.insert(tid, allocated);
    }

    /// A sample of thread `tid` taken outside the windows' probes stands
    /// for `bytes`; `in_window`: while a window was open.
    pub fn count_other(&mut self, tid: u32, bytes: u64, in_window: bool) {
        *self.others.entry(tid).or_default() += bytes;
        if in_window {
            *self.others_in_window.entry(tid).or_default() += bytes;
        }
    }

    /// Thread `tid`'s counter read at `allocated` now: what it allocated
    /// since its last window, whose end moves here.
    pub fn since_last_window(&mut self, tid: u32, allocated: u64) -> SinceLastWindow {
        let allocated = self.windowed(tid, allocated);
        let Some(end) = self.ends.insert(tid, allocated) else {
            self.ends.remove(&tid);
            let all = if self.born_since(tid) { allocated } else { 0 };
            return SinceLastWindow::NoWindow(all);
        };
        SinceLastWindow::Window(allocated.saturating_sub(end))
    }

    /// Thread `tid`'s counter read at `allocated`, less what its samples
    /// outside the windows stand for.
    fn windowed(&self, tid: u32, allocated: u64) -> u64 {
        allocated.saturating_sub(self.others.get(&tid).copied().unwrap_or(0))
    }

    /// The weight of each thread's samples in window `number`, from what
    /// the kernel noted of its counters: the bytes it allocated from the
    /// end of its previous window to the end of this one, over the bytes it
    /// allocated within this one. (Each window's own ratio, so that each
    /// stands for its own stretch of the run: a ratio pooled over windows
    /// weighs a window by others, and a thread's first window, which stands
    /// for itself alone, pulled the pooled ratio of the next ones down by
    /// a third in tests.)
    pub fn weigh(&mut self, number: u64, records: &[(u32, ThreadWindow)]) -> HashMap<u32, Weight> {
        let mut weights = HashMap::new();
        for &(tid, record) in records {
            if record.window != number {
                continue;
            }
            // In the bytes only windows sample.
            let others = self.others.get(&tid).copied().unwrap_or(0);
            let others_within = self.others_in_window.get(&tid).copied().unwrap_or(0);
            let end = record.end.saturating_sub(others);
            let first = (record.first).saturating_sub(others.saturating_sub(others_within));
            // Samples lost (the ring buffer full) leave the sent to stand
            // for the window's bytes at their share.
            let within = sampled_bytes(end.saturating_sub(first), &record);
            // Its first window stands for all it allocated, if it was born
            // since the windows began (jemalloc's counter starts at 0);
            // else since it was first seen on the slow path, or for itself
            // alone.
            let since = self
                .ends
                .get(&tid)
                .copied()
                .or(self.born_since(tid).then_some(0))
                .or((record.base > 0).then_some(record.base))
                .filter(|&start| start <= first)
                .unwrap_or(first);
            self.ends.insert(tid, end);
            if within > 0 && end >= since {
                let scale = (end - since) as f64 / within as f64;
                weights.insert(tid, Weight { scale, within });
            }
        }
        self.others_in_window.clear();
        weights
    }

    /// Whether thread `tid` was born since the windows began (jemalloc's
    /// counter started at 0 since); no thread is, where they could not be
    /// read then.
    fn born_since(&self, tid: u32) -> bool {
        !self.present_at_start.is_empty() && !self.present_at_start.contains(&tid)
    }

    /// The threads whose last window ended somewhere known.
    pub fn threads(&self) -> impl Iterator<Item = u32> + '_ {
        self.ends.keys().copied()
    }

    /// Forgets thread `tid` (it is gone).
    pub fn forget(&mut self, tid: u32) {
        self.ends.remove(&tid);
        self.others.remove(&tid);
    }
}

/// The share of a window's `within` bytes its sent samples stand for.
fn sampled_bytes(within: u64, record: &ThreadWindow) -> u64 {
    let (sent, lost) = (record.sent_bytes, record.lost_bytes);
    if sent == 0 || lost == 0 {
        return within;
    }
    ((within as u128 * sent as u128) / (sent as u128 + lost as u128)).max(1) as u64
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
            counter_at: 0,
            sent_bytes: 0,
            lost_bytes: 0,
        }
    }

    fn scale(weights: &HashMap<u32, Weight>, tid: u32) -> f64 {
        weights[&tid].scale
    }

    #[test]
    fn a_window_stands_for_what_its_thread_allocated_since_the_last() {
        let mut bytes = ThreadBytes::new(vec![3, 7]);
        // Thread 7 first seen on the slow path at 1,000 bytes, its first
        // window from 41,000 to 42,000: 41,000 bytes in all for 1,000 seen.
        let weights = bytes.weigh(1, &[(7, record(1, 41_000, 42_000, 1_000))]);
        assert_eq!(scale(&weights, 7), 41.0);
        assert_eq!(weights[&7].within, 1_000);
        // The next window from 100,000 to 102,000: 60,000 bytes since the
        // last one ended, for 2,000 seen.
        let weights = bytes.weigh(2, &[(7, record(2, 100_000, 102_000, 1_000))]);
        assert_eq!(scale(&weights, 7), 30.0);
        // A thread with no call in this window (its record an older one's)
        // gets no weight, and its end is kept for its next window.
        let weights = bytes.weigh(3, &[(7, record(2, 100_000, 102_000, 1_000))]);
        assert!(weights.is_empty());
        let weights = bytes.weigh(4, &[(7, record(4, 200_000, 201_000, 1_000))]);
        assert_eq!(scale(&weights, 7), 99.0);
    }

    #[test]
    fn a_thread_born_since_the_windows_began_stands_for_all_it_allocated() {
        let mut bytes = ThreadBytes::new(vec![3, 7]);
        let weights = bytes.weigh(1, &[(9, record(1, 5_000, 6_000, 0))]);
        assert_eq!(scale(&weights, 9), 6.0);
        // Where the threads could not be read, none is taken for new.
        let mut bytes = ThreadBytes::new(Vec::new());
        let weights = bytes.weigh(1, &[(9, record(1, 5_000, 6_000, 0))]);
        assert_eq!(scale(&weights, 9), 1.0);
    }

    #[test]
    fn a_thread_never_seen_on_the_slow_path_stands_for_its_window_alone() {
        let mut bytes = ThreadBytes::new(vec![3, 7]);
        let weights = bytes.weigh(1, &[(3, record(1, 5_000, 6_000, 0))]);
        assert_eq!(scale(&weights, 3), 1.0);
    }

    #[test]
    fn a_buffer_sampled_between_two_windows_is_not_counted_again_in_the_next() {
        let mut bytes = ThreadBytes::new(vec![7]);
        bytes.count_from(7, 10_000);
        // 64 KiB sampled on the slow path between the windows, counted by
        // the thread's counter too: the next window stands for the rest.
        bytes.count_other(7, 65_536, false);
        let weights = bytes.weigh(1, &[(7, record(1, 85_536, 95_536, 1))]);
        assert_eq!(scale(&weights, 7), 2.0);
        // One sampled while its window was open is left out of it too.
        bytes.count_other(7, 65_536, true);
        // 5,000 bytes before the window, 10,000 within it.
        let first = 95_536 + 5_000;
        let end = first + 10_000 + 65_536;
        let weights = bytes.weigh(2, &[(7, record(2, first, end, 1))]);
        assert_eq!(scale(&weights, 7), 1.5);
    }

    #[test]
    fn what_a_thread_allocated_since_its_last_window_is_read_once() {
        let mut bytes = ThreadBytes::new(vec![7, 8]);
        bytes.weigh(1, &[(7, record(1, 30_000, 40_000, 1))]);
        assert_eq!(
            bytes.since_last_window(7, 60_000),
            SinceLastWindow::Window(20_000)
        );
        assert_eq!(
            bytes.since_last_window(7, 60_000),
            SinceLastWindow::Window(0)
        );
        // Born since: all of it; there at the start: nothing known.
        assert_eq!(
            bytes.since_last_window(9, 5_000),
            SinceLastWindow::NoWindow(5_000)
        );
        assert_eq!(
            bytes.since_last_window(8, 5_000),
            SinceLastWindow::NoWindow(0)
        );
        bytes.forget(7);
        assert_eq!(bytes.threads().count(), 0);
    }
}
