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
mod account;

use std::time::Instant;

use aya::maps::{MapData, RingBuf};

pub use account::WindowTiming;
pub(super) use account::{WindowedCopy, Windows};

use crate::{
    kernel::{Scope, ThreadWindow, events::Event},
    run::Session,
};

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
