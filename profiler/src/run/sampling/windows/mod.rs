//! `--sampling windows` (the default for jemalloc): its `malloc` and
//! `operator new` are probed at every call while that costs the process
//! little ([`WINDOWS_COST`]), and in short windows opened at random times
//! once it would cost more, open for as small a share of the time as
//! keeps their cost there. No call traps outside a window, and nothing in
//! the program's own cycle can line up with the samples. Its slow path
//! stays probed for the requests above 4 KiB (every one reaches it: a big
//! buffer is never left to chance), and its other entry points and its
//! frees stay probed as always.
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
mod split;
mod timing;

use std::time::Instant;

use aya::maps::{MapData, RingBuf};

pub(in crate::run) use account::{WindowedCopy, Windows};
pub use timing::{MIN_DUTY, WINDOWS_COST, WindowTiming};

use crate::{
    collect::HeapEvent,
    kernel::{Scope, ThreadWindow},
    run::Session,
};

impl Session<'_> {
    /// Samples `copy` of `pid` in windows from now on.
    pub(in crate::run) fn start_windows(&mut self, pid: u32, copy: WindowedCopy) {
        let timing = self.options.windows;
        if self.options.verbose {
            let _ = writeln!(
                self.status,
                "memprobe: pid {pid}: {}: {}",
                copy.path,
                windows_note(&timing, None)
            );
        }
        let Some(t) = self.tracked.get_mut(&pid) else {
            return;
        };
        let windows = t.windows.get_or_insert_with(|| Windows::new(&timing));
        let Some((number, _)) = windows.open else {
            let first = windows.opened == 0;
            windows.add(copy);
            // The first window opens before the attach is announced: a
            // program that starts allocating when told memprobe is there
            // is seen from its first call.
            if first {
                self.open_window(pid);
            }
            return;
        };
        // A library loaded while a window is open (one that stays open, or
        // a short one) joins it at once.
        let shift = timing::window_shift(windows.duty, self.options.sample_interval);
        let mut copy = copy;
        match self.attach_in_window(pid, &mut copy, number, shift) {
            Ok(()) => {
                if let Some(w) = self.tracked.get_mut(&pid).and_then(|t| t.windows.as_mut()) {
                    w.add(copy);
                }
            }
            Err(why) => self.fall_back_to_entry(pid, &copy, &why),
        }
    }

    /// Attaches `copy`'s windowed probes for window `number`, its calls
    /// counted 2^`shift` times.
    fn attach_in_window(
        &mut self,
        pid: u32,
        copy: &mut WindowedCopy,
        number: u64,
        shift: u64,
    ) -> Result<(), WindowRefused> {
        copy.config.window = number;
        copy.config.window_shift = shift;
        if !self.probes.set_fast_path(pid, copy.instance, copy.config) {
            return Err(WindowRefused::FastPathsFull);
        }
        let file = (copy.path.as_str(), copy.open_path.as_path());
        let slots = self
            .probes
            .attach_window(
                Scope::Process(pid),
                file,
                &copy.served,
                copy.instance,
                &copy.slots,
            )
            .map_err(|e| WindowRefused::Attach(Box::new(e)))?;
        copy.slots = slots;
        Ok(())
    }

    /// A copy whose window could not open: its `malloc` and `operator new`
    /// probed at every call from now on, and said.
    fn fall_back_to_entry(&mut self, pid: u32, copy: &WindowedCopy, why: &WindowRefused) {
        let why = crate::error::chain(why);
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
            t.sampling_notes.push(format!(
                "{}: at entry (a window could not open: {why})",
                copy.path
            ));
        }
    }

    /// When any process's window opens, closes or is judged next.
    pub(in crate::run) fn next_window_change(&self) -> Option<Instant> {
        let timing = &self.options.windows;
        self.tracked
            .values()
            .filter(|t| !t.exited)
            .filter_map(|t| t.windows.as_ref())
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
            .filter_map(|t| Some((t.pid, t.windows.as_ref()?)))
            .filter(|(_, w)| !w.copies.is_empty() && w.next_change(&timing) <= now)
            .map(|(pid, w)| (pid, w.open.is_some(), w.continuous()))
            .collect();
        for (pid, open, continuous) in due {
            match (open, continuous) {
                (true, true) => self.judge_continuous(pid, ring),
                (true, false) => {
                    self.close_window(pid, Some(&mut *ring));
                    self.after_window(pid);
                }
                (false, _) => self.open_window(pid),
            }
        }
    }

    /// The estimated seconds `pid`'s windowed probes have cost so far.
    fn windowed_seconds(&self, pid: u32) -> f64 {
        let Some(windows) = self.tracked.get(&pid).and_then(|t| t.windows.as_ref()) else {
            return 0.0;
        };
        let hits = self.probes.probe_hits();
        windows
            .copies
            .iter()
            .flat_map(|c| c.slots.iter())
            .filter_map(|&i| Some((hits.get(i)?, self.probes.attached.get(i)?)))
            .map(|(&n, probe)| n as f64 * self.cost_model.per_hit(probe, false).as_secs_f64())
            .sum()
    }

    /// Reads what `pid`'s windows cost and what it uses itself; the
    /// windows' share of a CPU since the last reading (a window's cost
    /// when read at its close).
    fn read_costs(&mut self, pid: u32) -> f64 {
        let priced = self.windowed_seconds(pid);
        let cpu = crate::proc::cpu_seconds(pid);
        let now = Instant::now();
        let Some(windows) = self.tracked.get_mut(&pid).and_then(|t| t.windows.as_mut()) else {
            return 0.0;
        };
        if let Some(cpu) = cpu {
            windows.own_cpu_since(cpu, priced, now);
        }
        windows.cost_since(priced, now)
    }

    /// A window that stays open, judged once a second: while its calls
    /// stay cheap it stays open; once dearer, it closes and windows follow.
    fn judge_continuous(&mut self, pid: u32, ring: &mut RingBuf<MapData>) {
        let cost = self.read_costs(pid);
        let timing = self.options.windows;
        let Some(windows) = self.tracked.get_mut(&pid).and_then(|t| t.windows.as_mut()) else {
            return;
        };
        windows.recent_cost = cost;
        let duty = windows.next_duty(&timing, cost);
        windows.over = if duty < 1.0 { windows.over + 1 } else { 0 };
        if windows.over >= account::NARROW_AFTER {
            windows.over = 0;
            windows.at_last_close = windows.priced;
            // Closed while it stays open: what the ring still holds of it
            // is applied as it comes, as before.
            self.close_window(pid, Some(ring));
            if let Some(w) = self.tracked.get_mut(&pid).and_then(|t| t.windows.as_mut()) {
                w.duty = duty;
            }
            self.schedule_next(pid);
            let own = self.tracked.get(&pid).and_then(|t| t.windows.as_ref());
            let own = own.map_or(0.0, |w| w.own_cpu);
            self.say_verbose(&format!(
                "pid {pid}: malloc in windows {:.1}% of the time from now (at every call it \
                 cost {:.1}% of a CPU; the process used {:.0}% of one itself)",
                duty * 100.0,
                cost * 100.0,
                own * 100.0
            ));
        }
    }

    /// After a window closed: what it cost sets how long until the next,
    /// or, cheap enough for long enough, the next opens at once and stays
    /// open.
    fn after_window(&mut self, pid: u32) {
        let cost = self.read_costs(pid);
        let timing = self.options.windows;
        let Some(windows) = self.tracked.get_mut(&pid).and_then(|t| t.windows.as_mut()) else {
            return;
        };
        let wanted = windows.next_duty(&timing, cost);
        windows.settle_duty(wanted, Instant::now());
        let (priced, now) = windows.priced;
        let (before, then) = std::mem::replace(&mut windows.at_last_close, (priced, now));
        let cycle = now.duration_since(then).as_secs_f64();
        if cycle > 0.0 {
            windows.recent_cost = (priced - before).max(0.0) / cycle;
        }
        if windows.duty >= 1.0 {
            self.open_window(pid);
            self.say_verbose(&format!(
                "pid {pid}: malloc at every call again (in its last window it cost {:.1}% of \
                 a CPU)",
                cost * 100.0
            ));
        } else {
            self.schedule_next(pid);
        }
    }

    fn say_verbose(&mut self, line: &str) {
        if self.options.verbose {
            self.clear_progress();
            let _ = writeln!(self.status, "memprobe: {line}");
        }
    }

    fn schedule_next(&mut self, pid: u32) {
        let timing = self.options.windows;
        if let Some(windows) = self.tracked.get_mut(&pid).and_then(|t| t.windows.as_mut()) {
            windows.next_open = Instant::now() + timing.gap(windows.duty);
        }
    }

    /// What narrowing `pid`'s windows to their least would save, as a
    /// share of a CPU (their recent cost, less what [`MIN_DUTY`] keeps);
    /// `None` where they are at their least already.
    pub(in crate::run) fn narrowing_saves(&self, pid: u32) -> Option<f64> {
        let windows = self.tracked.get(&pid)?.windows.as_ref()?;
        if windows.copies.is_empty() || windows.narrowed.is_some() {
            return None;
        }
        Some(windows.recent_cost * (1.0 - MIN_DUTY / windows.duty.max(MIN_DUTY)))
    }

    /// Lowers what `pid`'s windows may cost to nothing (the budget's first
    /// step), for `why`: from their next judgement they open [`MIN_DUTY`]
    /// of the time (fixed ones too).
    pub(in crate::run) fn narrow_windows(&mut self, pid: u32, why: &str) {
        if let Some(windows) = self.tracked.get_mut(&pid).and_then(|t| t.windows.as_mut()) {
            windows.narrowed = Some((std::time::SystemTime::now(), why.to_owned()));
        }
    }

    fn open_window(&mut self, pid: u32) {
        let Some(mut windows) = self.tracked.get_mut(&pid).and_then(|t| t.windows.take()) else {
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
        windows.open = Some((number, Instant::now()));
        if let Some(t) = self.tracked.get_mut(&pid) {
            t.windows = Some(windows);
        }
        // Its cost is read from here.
        self.read_costs(pid);
    }

    /// At the end of the run, one last window in every process sampled in
    /// short windows (the one open, or a new one), closed with the ring
    /// drained: what each thread allocated since its previous window is in
    /// the last profile, not left out.
    pub(in crate::run) async fn last_windows(&mut self, ring: &mut RingBuf<MapData>) {
        let pids: Vec<(u32, bool)> = self
            .tracked
            .values()
            .filter(|t| !t.exited)
            .filter_map(|t| Some((t.pid, t.windows.as_ref()?)))
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
        tokio::time::sleep(self.options.windows.length).await;
        for (pid, _) in pids {
            self.close_window(pid, Some(&mut *ring));
        }
    }

    /// Closes `pid`'s short window if one is open (before a snapshot: what
    /// it held is then in it); one that stays open holds nothing.
    pub(in crate::run) fn close_open_window(&mut self, pid: u32) {
        let open = self
            .tracked
            .get(&pid)
            .and_then(|t| t.windows.as_ref())
            .is_some_and(|w| w.open.is_some() && !w.continuous());
        if open {
            self.close_window(pid, None);
            self.schedule_next(pid);
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
        let Some((number, opened)) = windows.open.take() else {
            return;
        };
        windows.time_open += opened.elapsed();
        let mut tids: Vec<u32> = crate::proc::thread_ids(pid);
        tids.extend(windows.held.iter().filter_map(HeapEvent::tid));
        tids.sort_unstable();
        tids.dedup();
        let records: Vec<(u32, ThreadWindow)> = tids
            .into_iter()
            .filter_map(|tid| Some((tid, self.probes.thread_window(pid, tid)?)))
            .collect();
        let scales = windows.weigh(number, &records);
        for mut event in std::mem::take(&mut windows.held) {
            if let HeapEvent::Sampled(sample) = &mut event
                && sample.scale.is_some()
            {
                // A thread whose counters were not read is not guessed at.
                sample.scale = Some(scales.get(&sample.tid).copied().unwrap_or(0.0));
            }
            t.heap.apply(event);
        }
    }
}

/// Why a copy's window could not open.
#[derive(Debug, thiserror::Error)]
enum WindowRefused {
    #[error("the kernel's table of fast paths is full")]
    FastPathsFull,
    #[error("its probes could not be attached")]
    Attach(#[source] Box<crate::error::Error>),
}

/// How a copy's `malloc` and `operator new` are sampled, for the profile
/// (with the share of time in windows so far) and `--verbose`.
pub(in crate::run) fn windows_note(timing: &WindowTiming, windows: Option<&Windows>) -> String {
    let how = match timing.every {
        Some(every) => format!(
            "in windows of {} every {} on average",
            humantime::format_duration(timing.length),
            humantime::format_duration(every)
        ),
        None => format!(
            "at every call while that costs under {:.0}% of the CPU time the process uses, \
             else in windows of {} at random times",
            WINDOWS_COST * 100.0,
            humantime::format_duration(timing.length)
        ),
    };
    let so_far = windows.map_or(String::new(), |w| {
        let narrowed = w.narrowed.as_ref().map_or(String::new(), |(at, why)| {
            format!(
                ", narrowed to {:.1}% since {} ({why})",
                MIN_DUTY * 100.0,
                humantime::format_rfc3339_seconds(*at)
            )
        });
        format!(
            "; in windows {:.1}% of the time so far{}{narrowed}",
            w.share_open() * 100.0,
            if w.continuous() {
                ", every call now"
            } else {
                ""
            }
        )
    });
    format!(
        "malloc and operator new {how} (weighed by jemalloc's per-thread byte counter){so_far}, \
         requests above 4 KiB on its slow path"
    )
}
