//! What a thread allocates after its last window: counted when it ends (a
//! probe on libc's `__call_tls_dtors` reads its counter then), when its
//! process does (one on `_exit` reads every listed thread's) or when the
//! run does (the counter read from the thread's TLS through
//! `/proc/PID/mem`), in the shape of the samples of its last window. A
//! window's samples stand for the bytes since the one before, so without
//! this the bytes after the last one would be in none: the end of a batch
//! job's work, or all of a worker's that ran between two windows. Where a
//! window that stayed open (every call probed) closed for its cost, a
//! thread's last window is its latest samples there, those since the
//! judgement that found it dear: a burst that goes on after it is counted
//! in the shape it had as it closed.
use std::collections::{HashMap, HashSet};

use super::{Windows, thread_bytes::SinceLastWindow};
use crate::{
    collect::{ProcessHeap, Sample},
    kernel::ThreadWindow,
    run::Session,
};

/// Samples kept over all threads at most (a window holds at most
/// `MAX_HELD` events): past this a thread's tail is in no sample.
const MAX_KEPT: usize = 1 << 16;

/// The fewest of a thread's latest samples, where it has them, that its
/// tail is counted in the shape of once a window that stayed open closes.
const LATEST_AT_LEAST: usize = 32;

/// Exits held while a window is open at most.
const MAX_EXITS: usize = 4096;

/// Each thread's last weighed window, and the exits not settled yet.
#[derive(Debug, Default)]
pub(super) struct Tails {
    kept: HashMap<u32, Kept>,
    kept_samples: usize,
    /// Per thread, the samples of the window that stays open since it was
    /// last judged: its last window's, should it close at the next.
    recent: HashMap<u32, Vec<Sample>>,
    recent_samples: usize,
    /// Per thread, how many of those came before the judgement that found
    /// the window dear: the ones after are the shape it had as it closed.
    dear_from: HashMap<u32, usize>,
    /// Where each thread keeps its counter, as the kernel last found it.
    addresses: HashMap<u32, u64>,
    /// Exits told while a window was open (thread, counter), settled once
    /// its samples are weighed.
    exits: Vec<(u32, u64)>,
    /// Bytes allocated after their last window: counted in its samples'
    /// shape, and by threads none of whose samples could be kept, or
    /// that no window saw (born since the windows began), in none.
    pub counted: u64,
    pub unsampled: u64,
}

/// One thread's last weighed window: the bytes it allocated within it and
/// its samples there.
#[derive(Debug)]
struct Kept {
    within: u64,
    samples: Vec<Sample>,
}

impl Tails {
    /// Thread `tid`'s window, `within` bytes, was weighed: its samples
    /// (given to [`Self::keep`]) replace those of its window before.
    pub fn start(&mut self, tid: u32, within: u64) {
        let fresh = Kept {
            within,
            samples: Vec::new(),
        };
        if let Some(old) = self.kept.insert(tid, fresh) {
            self.kept_samples -= old.samples.len();
        }
    }

    /// A sample of a thread's window just weighed.
    pub fn keep(&mut self, sample: &Sample) {
        if self.kept_samples >= MAX_KEPT {
            return;
        }
        if let Some(kept) = self.kept.get_mut(&sample.tid) {
            kept.samples.push(sample.clone());
            self.kept_samples += 1;
        }
    }

    /// A sample of the window that stays open.
    pub fn note_recent(&mut self, sample: &Sample) {
        if self.kept_samples + self.recent_samples >= MAX_KEPT {
            return;
        }
        self.recent
            .entry(sample.tid)
            .or_default()
            .push(sample.clone());
        self.recent_samples += 1;
    }

    /// The window that stays open was judged and stays open: its samples
    /// so far are not what it would end on.
    pub fn forget_recent(&mut self) {
        self.recent.clear();
        self.recent_samples = 0;
        self.dear_from.clear();
    }

    /// The window that stays open was found dear: should the next
    /// judgement close it, what each thread allocates after is most like
    /// its samples from here on.
    pub fn mark_dear(&mut self) {
        self.dear_from = (self.recent.iter())
            .map(|(&tid, samples)| (tid, samples.len()))
            .collect();
    }

    /// The window that stayed open closed: each thread's latest samples
    /// become its last window, which stands for the bytes they were
    /// counted as (`bytes` of each: every call was probed). Its latest:
    /// those since the judgement that found it dear, [`LATEST_AT_LEAST`]
    /// at least where it has them. (All since the last judgement that
    /// found it cheap counted the sites fixture's last phase, churn_512,
    /// as much in the shape of its first, keep_4k: a program that changes
    /// what it allocates goes on most like what it did last.)
    pub fn keep_recent(&mut self, bytes: impl Fn(&Sample) -> f64) {
        let dear_from = std::mem::take(&mut self.dear_from);
        for (tid, mut samples) in std::mem::take(&mut self.recent) {
            let from = dear_from.get(&tid).copied().unwrap_or(0);
            samples.drain(..from.min(samples.len().saturating_sub(LATEST_AT_LEAST)));
            let within = samples.iter().map(&bytes).sum::<f64>().round() as u64;
            self.kept_samples += samples.len();
            if let Some(old) = self.kept.insert(tid, Kept { within, samples }) {
                self.kept_samples -= old.samples.len();
            }
        }
        self.recent_samples = 0;
    }

    /// Thread `tid` keeps its counter at `at`.
    pub fn locate(&mut self, tid: u32, at: u64) {
        self.addresses.insert(tid, at);
    }

    fn forget(&mut self, tid: u32) {
        self.addresses.remove(&tid);
        if let Some(old) = self.kept.remove(&tid) {
            self.kept_samples -= old.samples.len();
        }
    }
}

impl Windows {
    /// Bytes allocated after a thread's last window and counted in the
    /// shape of its samples there, so far.
    pub(in crate::run) fn counted_after_last_windows(&self) -> u64 {
        self.tails.counted
    }

    /// Counts in `heap` what thread `tid` allocated since its last window,
    /// its counter read at `allocated` now, in the shape of that window's
    /// samples; its next window's bytes start here.
    pub(super) fn settle(&mut self, heap: &mut ProcessHeap, tid: u32, allocated: u64) {
        let tail = match self.bytes.since_last_window(tid, allocated) {
            SinceLastWindow::Window(0) => return,
            SinceLastWindow::Window(tail) => tail,
            SinceLastWindow::NoWindow(all) => {
                self.tails.unsampled += all;
                return;
            }
        };
        let Some(kept) = self.tails.kept.get(&tid).filter(|k| !k.samples.is_empty()) else {
            self.tails.unsampled += tail;
            return;
        };
        self.tails.counted += tail;
        let scale = tail as f64 / kept.within.max(1) as f64;
        for sample in &kept.samples {
            heap.count_tail(&Sample {
                scale: Some(scale),
                ..sample.clone()
            });
        }
    }

    /// Thread `tid` ends, its counter at `allocated`: settled now, or
    /// once the open window's samples are weighed. (Forgotten once gone
    /// from the process: read again as the process calls `_exit`, its
    /// bytes start where this left them.) In a window that stays open
    /// every call is probed, and the thread's samples there stand for
    /// themselves: what it allocated since its last short window is in
    /// them already, not a tail.
    fn thread_exited(&mut self, heap: &mut ProcessHeap, tid: u32, allocated: u64) {
        if self.continuous() {
            let _ = self.bytes.since_last_window(tid, allocated);
            return;
        }
        if self.open.is_some() {
            if self.tails.exits.len() < MAX_EXITS {
                self.tails.exits.push((tid, allocated));
            }
            return;
        }
        self.settle(heap, tid, allocated);
    }

    /// The exits told while the window that just closed was open.
    pub(super) fn settle_exits(&mut self, heap: &mut ProcessHeap) {
        for (tid, allocated) in std::mem::take(&mut self.tails.exits) {
            self.thread_exited(heap, tid, allocated);
        }
    }

    /// After a window: where each thread read (`records`) keeps its
    /// counter; the threads gone since, of those `live` now (none where
    /// they could not be read), forgotten (their counters were read as
    /// they ended); the live ones' counters, to be read as the process
    /// ends.
    fn follow(&mut self, live: &[u32], records: &[(u32, ThreadWindow)]) -> Vec<(u32, u64)> {
        for &(tid, record) in records {
            if record.counter_at != 0 {
                self.tails.addresses.insert(tid, record.counter_at);
            }
        }
        if !live.is_empty() {
            let live: HashSet<&u32> = live.iter().collect();
            let gone: Vec<u32> = (self.bytes.threads())
                .filter(|tid| !live.contains(tid))
                .collect();
            for tid in gone {
                self.bytes.forget(tid);
                self.tails.forget(tid);
            }
        }
        // The busiest first, should there be more than the kernel lists.
        let mut listed: Vec<(u32, u64)> = live
            .iter()
            .filter_map(|tid| Some((*tid, *self.tails.addresses.get(tid)?)))
            .collect();
        let within = |tid: &u32| self.tails.kept.get(tid).map_or(0, |k| k.within);
        listed.sort_by_key(|(tid, _)| std::cmp::Reverse(within(tid)));
        listed
    }
}

impl Session<'_> {
    /// After `pid`'s window closed, with the threads `live` then and their
    /// `records`: the counters its `_exit` reads.
    pub(super) fn follow_tails(&mut self, pid: u32, live: &[u32], records: &[(u32, ThreadWindow)]) {
        let Some(windows) = self.sampling.windows_mut(pid) else {
            return;
        };
        let listed = windows.follow(live, records);
        self.probes.list_exit_counters(pid, &listed);
    }

    /// The kernel told that thread `tid` of `pid`, sampled in windows,
    /// had jemalloc's counter at `allocated` as it ended (or its process
    /// called `_exit`).
    pub(in crate::run) fn thread_exited(&mut self, pid: u32, tid: u32, allocated: u64) {
        let Some(t) = self.tracked.get_mut(&pid) else {
            return;
        };
        if let Some(windows) = self.sampling.windows_mut(pid) {
            windows.thread_exited(&mut t.heap, tid, allocated);
        }
    }

    /// At the end of the run, after the last window closed: what each
    /// live thread of `pid` allocated since its last window, its counter
    /// read from its TLS (where the kernel last found it) through
    /// `/proc/PID/mem`, never written.
    pub(super) fn settle_live_threads(&mut self, pid: u32) {
        let Some(memory) = crate::proc::ProcessMemory::open(pid) else {
            return;
        };
        let live = crate::proc::thread_ids(pid);
        let (Some(t), Some(windows)) = (self.tracked.get_mut(&pid), self.sampling.windows_mut(pid))
        else {
            return;
        };
        for tid in live {
            let Some(&at) = windows.tails.addresses.get(&tid) else {
                continue;
            };
            if let Some(allocated) = memory.read_word(at) {
                windows.settle(&mut t.heap, tid, allocated);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::*;
    use crate::{
        collect::{CollectorOptions, HeapEvent::Sampled, sampling::sample_weight},
        discover::AllocatorKind,
        run::sampling::windows::WindowTiming,
    };

    /// A sample of thread `tid` in a window, 4 KiB counted as itself.
    fn windowed(tid: u32) -> Sample {
        Sample {
            tid,
            size: 4096,
            align: 0,
            frames: vec![0x10],
            stack_error: false,
            allocator: AllocatorKind::Jemalloc,
            window: 4096,
            interval: None,
            copy: 0,
            scale: Some(1.0),
        }
    }

    fn record(window: u64, first: u64, end: u64, counter_at: u64) -> ThreadWindow {
        ThreadWindow {
            window,
            first,
            end,
            base: 1,
            counter_at,
            sent_bytes: 1,
            lost_bytes: 0,
        }
    }

    /// Thread 7 in window 1: 10,000 bytes within it, its sample kept.
    fn after_one_window() -> (Windows, ProcessHeap) {
        let mut windows = Windows::new(&WindowTiming::default(), vec![7, 8]);
        windows.weigh(1, &[(7, record(1, 30_000, 40_000, 0x7000))]);
        windows.tails.keep(&windowed(7));
        let heap = ProcessHeap::new(1, 4096, CollectorOptions::default());
        (windows, heap)
    }

    /// The bytes one window's sample stands for.
    fn one() -> f64 {
        sample_weight(4096, 4096) * 4096.0
    }

    #[test]
    fn what_a_thread_allocates_after_its_last_window_counts_as_in_it() {
        let (mut windows, mut heap) = after_one_window();
        // 20,000 bytes after the window: twice what it allocated within.
        windows.settle(&mut heap, 7, 60_000);
        assert!((heap.alloc_bytes() - 2.0 * one()).abs() < 1e-6);
        // Frees are followed, and these pointers are unknown.
        assert_eq!(heap.inuse_bytes(), 0.0);
        assert_eq!(
            (windows.tails.counted, windows.tails.unsampled),
            (20_000, 0)
        );
        // Its next bytes start there.
        windows.settle(&mut heap, 7, 60_000);
        assert!((heap.alloc_bytes() - 2.0 * one()).abs() < 1e-6);
    }

    #[test]
    fn samples_lost_in_a_window_are_made_up_for_by_those_sent() {
        let mut windows = Windows::new(&WindowTiming::default(), vec![7, 8]);
        // 10,000 bytes within the window, one sample sent of four: it
        // stands for 2,500 of them, and the window for 39,999 (since the
        // thread was first seen, at 1).
        let lossy = ThreadWindow {
            sent_bytes: 1,
            lost_bytes: 3,
            ..record(1, 30_000, 40_000, 0x7000)
        };
        let scales = windows.weigh(1, &[(7, lossy)]);
        assert_eq!(scales[&7], 39_999.0 / 2_500.0);
        windows.tails.keep(&windowed(7));
        let mut heap = ProcessHeap::new(1, 4096, CollectorOptions::default());
        // 20,000 bytes after it: eight times what its sample stands for.
        windows.settle(&mut heap, 7, 60_000);
        assert!((heap.alloc_bytes() - 8.0 * one()).abs() < 1e-6);
    }

    #[test]
    fn an_exit_in_an_open_window_waits_for_its_weights() {
        let (mut windows, mut heap) = after_one_window();
        // A short window (one that stays open holds nothing).
        windows.duty = 0.05;
        windows.open = Some((2, Instant::now()));
        windows.thread_exited(&mut heap, 7, 50_000);
        assert_eq!(heap.alloc_bytes(), 0.0);
        windows.open = None;
        windows.settle_exits(&mut heap);
        assert!((heap.alloc_bytes() - one()).abs() < 1e-6);
        // Read again at `_exit`: nothing more.
        windows.thread_exited(&mut heap, 7, 50_000);
        assert!((heap.alloc_bytes() - one()).abs() < 1e-6);
    }

    #[test]
    fn an_exit_in_a_window_that_stays_open_has_no_tail() {
        let (mut windows, mut heap) = after_one_window();
        // Every call probed again: its 20,000 bytes since are its samples'.
        windows.duty = 1.0;
        windows.open = Some((2, Instant::now()));
        windows.thread_exited(&mut heap, 7, 60_000);
        assert_eq!(heap.alloc_bytes(), 0.0);
        assert_eq!((windows.tails.counted, windows.tails.unsampled), (0, 0));
        // Nor are they counted at the process's `_exit`, once short
        // windows are back.
        windows.open = None;
        windows.thread_exited(&mut heap, 7, 60_000);
        assert_eq!(heap.alloc_bytes(), 0.0);
    }

    /// What befalls a window that stays open: a sample of thread 7 at a
    /// site, or a judgement.
    enum Step {
        At(u64),
        Cheap,
        Dear,
    }

    /// Thread 7's `steps` in a window that stays open, which then closes
    /// weighed at 40,000 bytes; the thread goes on for 20,000 more and
    /// ends. What each site was counted, and the bytes counted as tails
    /// and in no sample.
    fn burst_past_its_window(steps: &[Step]) -> (HashMap<u64, f64>, u64, u64) {
        let mut windows = Windows::new(&WindowTiming::default(), vec![7]);
        let mut heap = ProcessHeap::new(1, 4096, CollectorOptions::default());
        windows.open = Some((1, Instant::now()));
        for step in steps {
            match *step {
                Step::At(site) => {
                    let sample = Sample {
                        frames: vec![site],
                        ..windowed(7)
                    };
                    assert!(windows.hold(Sampled(sample)).is_some());
                }
                Step::Cheap => windows.tails.forget_recent(),
                Step::Dear => windows.tails.mark_dear(),
            }
        }
        windows.weigh(1, &[(7, record(1, 0, 40_000, 0x7000))]);
        windows
            .tails
            .keep_recent(|sample| heap.estimated_bytes(sample));
        windows.open = None;
        windows.thread_exited(&mut heap, 7, 60_000);
        let tails = &windows.tails;
        (heap.allocated_by_site(), tails.counted, tails.unsampled)
    }

    #[test]
    fn a_burst_past_a_window_that_stayed_open_counts_in_its_shape() {
        // Idle at first, at every call: one sample, then a judgement; a
        // burst at another site, then its window closes for its cost.
        let steps = [Step::At(0x10), Step::Cheap, Step::At(0x20), Step::At(0x20)];
        let (sites, counted, unsampled) = burst_past_its_window(&steps);
        // Within rounding: the window stands for whole bytes.
        assert!((sites[&0x20] - 20_000.0).abs() < 1.0, "{sites:?}");
        assert!(!sites.contains_key(&0x10), "{sites:?}");
        assert_eq!((counted, unsampled), (20_000, 0));
    }

    /// `before` samples at 0x20, found dear, then `after` at 0x30.
    fn burst_that_changes(before: usize, after: usize) -> HashMap<u64, f64> {
        let mut steps: Vec<Step> = (0..before).map(|_| Step::At(0x20)).collect();
        steps.push(Step::Dear);
        steps.extend((0..after).map(|_| Step::At(0x30)));
        burst_past_its_window(&steps).0
    }

    #[test]
    fn a_burst_that_changes_goes_on_in_its_latest_shape() {
        let sites = burst_that_changes(40, LATEST_AT_LEAST);
        assert!((sites[&0x30] - 20_000.0).abs() < 1.0, "{sites:?}");
        assert!(!sites.contains_key(&0x20), "{sites:?}");
        // Too few since: the latest 32, 24 at the first site, 8 at the second.
        let sites = burst_that_changes(40, 8);
        assert!((sites[&0x20] - 15_000.0).abs() < 1.0, "{sites:?}");
        assert!((sites[&0x30] - 5_000.0).abs() < 1.0, "{sites:?}");
    }

    #[test]
    fn a_thread_no_window_saw_is_in_no_sample() {
        let (mut windows, mut heap) = after_one_window();
        // Born since the windows began: all it allocated.
        windows.settle(&mut heap, 9, 5_000);
        // There at the start, its bytes before unknown: nothing.
        windows.settle(&mut heap, 8, 5_000);
        assert_eq!(heap.alloc_bytes(), 0.0);
        assert_eq!((windows.tails.counted, windows.tails.unsampled), (0, 5_000));
    }

    #[test]
    fn live_threads_are_listed_busiest_first_and_gone_ones_forgotten() {
        let (mut windows, _) = after_one_window();
        let records = [
            (8, record(2, 0, 5_000, 0x8000)),
            (9, record(2, 0, 90_000, 0x9000)),
        ];
        windows.weigh(2, &records);
        let listed = windows.follow(&[8, 9], &records);
        assert_eq!(listed, vec![(9, 0x9000), (8, 0x8000)]);
        assert!(!windows.bytes.threads().any(|tid| tid == 7));
        // Where the threads could not be read, none is taken for gone.
        let listed = windows.follow(&[], &records);
        assert!(listed.is_empty());
        assert!(windows.bytes.threads().any(|tid| tid == 8));
    }
}
