//! The windows' cycle: each opens when due, closes after its length with
//! its samples weighed, and the one that stays open is judged every
//! 500 ms; the last opens at the end of the run, and what each thread
//! allocated after its own last window is counted then.
use std::time::{Duration, Instant};

use aya::maps::{MapData, RingBuf};
use tokio::io::unix::AsyncFd;

use super::{Windows, timing};
use crate::{
    collect::{HeapEvent, ProcessHeap},
    kernel::ThreadWindow,
    run::{Session, notice::SamplingNotice},
};

impl Session<'_> {
    /// When any process's window opens, closes or is judged next.
    pub(in crate::run) fn next_window_change(&self) -> Option<Instant> {
        let timing = &self.options.windows;
        self.tracked
            .values()
            .filter(|t| !t.exited)
            .filter_map(|t| self.sampling.windows(t.pid))
            .filter(|w| !w.copies.is_empty())
            .map(|w| w.next_change(timing))
            .min()
    }

    /// Opens, closes and judges the windows that are due.
    pub(in crate::run) fn change_windows(&mut self, ring: &mut RingBuf<MapData>) {
        let now = Instant::now();
        let timing = self.options.windows;
        let due: Vec<(u32, bool, bool)> = self
            .tracked
            .values()
            .filter(|t| !t.exited)
            .filter_map(|t| Some((t.pid, self.sampling.windows(t.pid)?)))
            .filter(|(_, w)| !w.copies.is_empty() && w.next_change(&timing) <= now)
            .map(|(pid, w)| (pid, w.open.is_some(), w.continuous()))
            .collect();
        for (pid, open, continuous) in due {
            match (open, continuous) {
                (true, true) => self.judge_continuous(pid, ring),
                (true, false) => {
                    let closed = self.close_window(pid, Some(&mut *ring));
                    self.after_window(pid, closed);
                }
                (false, _) => self.open_window(pid),
            }
        }
    }

    /// A window that stays open, judged every 500 ms: while its calls stay
    /// cheap it stays open. Found dear, it is judged again 50 ms later, and
    /// closes if still dear (windows follow): a burst that ended before the
    /// judgement is no reason to close it.
    fn judge_continuous(&mut self, pid: u32, ring: &mut RingBuf<MapData>) {
        let cost = self.read_costs(pid, Instant::now());
        let timing = self.options.windows;
        let Some(windows) = self.sampling.windows_mut(pid) else {
            return;
        };
        windows.cost.recent = cost;
        let duty = windows.next_duty(&timing, cost);
        let was_dear = std::mem::replace(&mut windows.dear, duty < 1.0);
        if duty >= 1.0 {
            windows.tails.forget_recent();
            return;
        }
        if !was_dear {
            windows.tails.mark_dear();
            return;
        }
        let after = windows
            .open
            .map_or(Duration::ZERO, |(_, since)| since.elapsed());
        windows.cost.continuous_closed();
        // Closed while it stays open: what the ring still holds of it is
        // applied as it comes, as before.
        self.close_window(pid, Some(ring));
        if let Some(w) = self.sampling.windows_mut(pid) {
            w.duty = duty;
        }
        self.schedule_next(pid);
        let own = self.sampling.windows(pid);
        let own = own.map_or(0.0, |w| w.cost.own_cpu);
        self.say(SamplingNotice::WindowsRarer {
            pid,
            duty,
            cost,
            own,
            after,
        });
    }

    /// After a window closed, its probes out at `closed`: what it cost
    /// (priced up to then, not to the end of their links' grace period)
    /// sets how long until the next, or, cheap enough for long enough, the
    /// next opens at once and stays open.
    fn after_window(&mut self, pid: u32, closed: Instant) {
        let cost = self.read_costs(pid, closed);
        let timing = self.options.windows;
        let Some(windows) = self.sampling.windows_mut(pid) else {
            return;
        };
        let wanted = windows.next_duty(&timing, cost);
        windows.settle_duty(wanted, Instant::now());
        windows.cost.cycle_closed();
        if windows.duty >= 1.0 {
            self.open_window(pid);
            self.say(SamplingNotice::EveryCallAgain { pid, cost });
        } else {
            self.schedule_next(pid);
        }
    }

    fn schedule_next(&mut self, pid: u32) {
        let timing = self.options.windows;
        if let Some(windows) = self.sampling.windows_mut(pid) {
            windows.next_open = Instant::now() + timing.gap(windows.duty, windows.trapping);
        }
    }

    pub(in crate::run) fn open_window(&mut self, pid: u32) {
        // Its cost is read from here: its first probe traps at once.
        let opening = Instant::now();
        self.read_costs(pid, opening);
        let Some(mut windows) = self.sampling.of_mut(pid).windows.take() else {
            return;
        };
        let number = windows.opened + 1;
        let shift = timing::window_shift(windows.duty, self.options.sample_interval);
        let mut failed = Vec::new();
        for (k, copy) in windows.copies.iter_mut().enumerate() {
            if let Err(why) = self.attach_in_window(pid, copy, number, shift) {
                failed.push((k, why));
            }
        }
        // A copy whose window cannot open is sampled at entry from now on.
        for (k, why) in failed.into_iter().rev() {
            let copy = windows.copies.remove(k);
            self.fall_back_to_entry(pid, &copy, &why);
        }
        windows.opened = number;
        windows.open = Some((number, opening));
        windows.dear = false;
        self.sampling.of_mut(pid).windows = Some(windows);
    }

    /// At the end of the run, one last window in every process sampled in
    /// short windows (the one open, or a new one), closed with the ring
    /// drained: what each thread allocated since its previous window is in
    /// the last profile, not left out.
    pub(in crate::run) async fn last_windows(&mut self, ring: &mut AsyncFd<RingBuf<MapData>>) {
        let pids: Vec<(u32, bool)> = self
            .tracked
            .values()
            .filter(|t| !t.exited)
            .filter_map(|t| Some((t.pid, self.sampling.windows(t.pid)?)))
            .filter(|(_, w)| !w.copies.is_empty() && !w.continuous())
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
        // Drained while open, as the run's loop does: a window's dense
        // samples filled the ring within it, and most were lost.
        let until = tokio::time::Instant::now() + self.options.windows.length;
        while let Ok(readable) = tokio::time::timeout_at(until, ring.readable_mut()).await {
            if self.drain_ready(readable).is_err() {
                break;
            }
        }
        for (pid, _) in pids {
            self.close_window(pid, Some(ring.get_mut()));
            self.settle_live_threads(pid);
        }
    }

    /// Closes `pid`'s window that stays open (its probes to be attached
    /// anew); the caller opens the next.
    pub(in crate::run) fn close_continuous_window(&mut self, pid: u32) {
        self.close_window(pid, None);
    }

    /// Closes `pid`'s short window if one is open (before a snapshot: what
    /// it held is then in it); one that stays open holds nothing.
    pub(in crate::run) fn close_open_window(&mut self, pid: u32) {
        let open = self
            .sampling
            .windows(pid)
            .is_some_and(|w| w.open.is_some() && !w.continuous());
        if open {
            self.close_window(pid, None);
            self.schedule_next(pid);
        }
    }

    /// Detaches the window's probes, takes the events still in the ring
    /// (where it is at hand), weighs the window's samples and applies what
    /// was held; when its probes came out.
    fn close_window(&mut self, pid: u32, ring: Option<&mut RingBuf<MapData>>) -> Instant {
        let slots: Vec<usize> = self
            .sampling
            .windows(pid)
            .map(|w| {
                w.copies
                    .iter()
                    .flat_map(|c| c.slots.iter().copied())
                    .collect()
            })
            .unwrap_or_default();
        // Closing a link takes its probes out at once, then waits.
        let closing = Instant::now();
        self.probes.detach_probes(&slots);
        if let Some(ring) = ring {
            while !self.drain(ring) {}
        }
        let Some(t) = self.tracked.get_mut(&pid) else {
            return closing;
        };
        let Some(windows) = self.sampling.windows_mut(pid) else {
            return closing;
        };
        let continuous = windows.continuous();
        let Some((number, opened)) = windows.open.take() else {
            return closing;
        };
        let trapping = closing.duration_since(opened);
        windows.time_open += trapping;
        if windows.duty < 1.0 {
            windows.trapping = trapping;
        }
        let live = crate::proc::thread_ids(pid);
        let mut tids = live.clone();
        tids.extend(windows.held.iter().filter_map(HeapEvent::tid));
        tids.sort_unstable();
        tids.dedup();
        let records: Vec<(u32, ThreadWindow)> = tids
            .into_iter()
            .filter_map(|tid| Some((tid, self.probes.thread_window(pid, tid)?)))
            .collect();
        apply_held(windows, number, &records, &mut t.heap);
        if continuous {
            windows
                .tails
                .keep_recent(|sample| t.heap.estimated_bytes(sample));
        }
        windows.settle_exits(&mut t.heap);
        self.follow_tails(pid, &live, &records);
        closing
    }
}

/// Weighs the samples window `number` held by what each thread's counters
/// say it allocated (`records`) and applies all it held to `heap`.
fn apply_held(
    windows: &mut Windows,
    number: u64,
    records: &[(u32, ThreadWindow)],
    heap: &mut ProcessHeap,
) {
    let scales = windows.weigh(number, records);
    let mut weighed = 0;
    for mut event in std::mem::take(&mut windows.held) {
        if let HeapEvent::Sampled(sample) = &mut event
            && sample.scale.is_some()
        {
            // A thread whose counters were not read is not guessed at.
            sample.scale = Some(scales.get(&sample.tid).copied().unwrap_or(0.0));
            if scales.contains_key(&sample.tid) {
                windows.tails.keep(sample);
                weighed += 1;
            }
        }
        heap.apply(event);
    }
    if weighed > 0 {
        windows.sampled_windows += 1;
        windows.window_samples += weighed;
    }
}
