//! `--sampling windows` (the default for jemalloc): its `malloc` and
//! `operator new` are probed at every call while that costs the process
//! little ([`timing::WINDOWS_COST`]), and in short windows opened at random times
//! once it would cost more, open for as small a share of the time as
//! keeps their cost there. No call traps outside a window, and nothing in
//! the program's own cycle can line up with the samples. The requests no
//! thread cache holds (above 32 KiB by default) stay probed where the slow
//! path sends them, every one (a big buffer is never left to chance; where
//! that place was not found, the slow path's entry, for requests above
//! 4 KiB), and the copy's other entry points and its frees stay probed as
//! always.
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
mod cost;
mod cycle;
mod split;
mod tails;
mod thread_bytes;
mod timing;

use std::time::Instant;

pub(in crate::run) use account::{WindowedCopy, Windows};
pub use timing::WindowTiming;

use crate::{
    kernel::Scope,
    run::{Session, notice::SamplingNotice},
};

impl Session<'_> {
    /// Samples `copy` of `pid` in windows from now on.
    pub(in crate::run) fn start_windows(&mut self, pid: u32, copy: WindowedCopy) {
        let timing = self.options.windows;
        self.say(SamplingNotice::WindowsStarted {
            pid,
            path: copy.path.clone(),
            note: windows_note(&timing, None, copy.config.large_above),
        });
        if !self.tracked.contains_key(&pid) {
            return;
        }
        let starting = self.sampling.windows(pid).is_none();
        let counters = if starting {
            self.thread_counters(pid, &copy.config)
        } else {
            Vec::new()
        };
        let windows = (self.sampling.of_mut(pid).windows)
            .get_or_insert_with(|| Windows::new(&timing, crate::proc::thread_ids(pid)));
        windows.count_from(&counters);
        if starting
            && let Some((used, span)) = self.tracked.get(&pid).and_then(|t| t.used_since_found())
        {
            windows.busy_before(used, span);
        }
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
                if let Some(w) = self.sampling.windows_mut(pid) {
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
    /// probed at every call from now on, and said; nothing where the
    /// process has ended (its files are gone from `/proc/PID/root`, and its
    /// exit is on its way).
    fn fall_back_to_entry(&mut self, pid: u32, copy: &WindowedCopy, why: &WindowRefused) {
        if crate::proc::has_ended(pid) {
            return;
        }
        let why = crate::error::chain(why);
        let file = (copy.path.as_str(), copy.open_path.as_path());
        let attached = self.probes.attach_again(
            Scope::Process(pid),
            file,
            &copy.served,
            copy.instance,
            &copy.slots,
        );
        self.say(SamplingNotice::WindowRefused {
            pid,
            path: copy.path.clone(),
            why: why.clone(),
            at_entry: attached.is_ok(),
        });
        self.sampling.of_mut(pid).notes.push(format!(
            "{}: at entry (a window could not open: {why})",
            copy.path
        ));
    }

    /// The estimated seconds `pid`'s windowed probes have cost so far.
    fn windowed_seconds(&self, pid: u32) -> f64 {
        let Some(windows) = self.sampling.windows(pid) else {
            return 0.0;
        };
        let model = &self.costs.model;
        windows
            .copies
            .iter()
            .flat_map(|c| c.slots.iter())
            .filter_map(|&i| Some((self.probes.attached.get(i)?, self.probes.hits_of(i)?, i)))
            .map(|(probe, n, i)| {
                let hits = model.per_hit(probe, false).as_secs_f64() * n as f64;
                hits + model
                    .sampled(probe, self.probes.samples_of(i))
                    .as_secs_f64()
            })
            .sum()
    }

    /// Reads what `pid`'s windows cost and what it uses itself, standing
    /// for instant `now`; the windows' share of a CPU since the last
    /// reading (a window's cost when read at its close).
    fn read_costs(&mut self, pid: u32, now: Instant) -> f64 {
        let priced = self.windowed_seconds(pid);
        let cpu = crate::proc::cpu_seconds(pid);
        let Some(windows) = self.sampling.windows_mut(pid) else {
            return 0.0;
        };
        if let Some(cpu) = cpu {
            windows.cost.own_cpu_since(cpu, priced, now);
        }
        windows.cost.since(priced, now)
    }

    /// What narrowing `pid`'s windows to their least would save, as a
    /// share of a CPU (their recent cost, less what their least share of
    /// time keeps); `None` where they are at their least already.
    pub(in crate::run) fn narrowing_saves(&self, pid: u32) -> Option<f64> {
        let windows = self.sampling.windows(pid)?;
        if windows.copies.is_empty() || windows.narrowed.is_some() {
            return None;
        }
        let least = self.options.windows.least_duty();
        Some(windows.cost.recent * (1.0 - least / windows.duty.max(least)))
    }

    /// Lowers what `pid`'s windows may cost to nothing (the budget's first
    /// step), for `why`: from their next judgement they open their least
    /// share of the time (fixed ones too).
    pub(in crate::run) fn narrow_windows(&mut self, pid: u32, why: &str) {
        if let Some(windows) = self.sampling.windows_mut(pid) {
            windows.narrowed = Some((std::time::SystemTime::now(), why.to_owned()));
        }
    }
}

/// Why a copy's window could not open.
#[derive(Debug, thiserror::Error)]
enum WindowRefused {
    #[error("the kernel's table of fast paths is full")]
    FastPathsFull,
    #[error("its probes could not be attached")]
    Attach(#[source] Box<crate::kernel::KernelError>),
}

/// How a copy's `malloc` and `operator new` are sampled, for the profile
/// (with the share of time in windows so far) and `--verbose`.
pub(in crate::run) fn windows_note(
    timing: &WindowTiming,
    windows: Option<&Windows>,
    large_above: u64,
) -> String {
    let how = match timing.every {
        Some(every) => format!(
            "in windows of {} every {} on average",
            humantime::format_duration(timing.length),
            humantime::format_duration(every)
        ),
        None => format!(
            "at every call while that costs under {}% of the CPU time the process uses, \
             else in windows of {} at random times",
            // Tenths of a percent, shown as short as they go (1, 0.3).
            (timing.cost * 1000.0).round() / 10.0,
            humantime::format_duration(timing.length)
        ),
    };
    let so_far = windows.map_or(String::new(), |w| {
        let narrowed = w.narrowed.as_ref().map_or(String::new(), |(at, why)| {
            format!(
                ", narrowed to {:.1}% since {} ({why})",
                timing.least_duty() * 100.0,
                humantime::format_rfc3339_seconds(*at)
            )
        });
        let tails = match (w.tails.counted, w.tails.unsampled) {
            (0, 0) => String::new(),
            (counted, 0) => format!(
                ", {} allocated after a thread's last window counted as in it",
                crate::units::bytes(counted as f64)
            ),
            (counted, unsampled) => format!(
                ", {} allocated after a thread's last window counted as in it, {} in no sample",
                crate::units::bytes(counted as f64),
                crate::units::bytes(unsampled as f64)
            ),
        };
        // Until a short window drew samples, there is no count to tell.
        let drawn = match w.sampled_windows {
            0 => String::new(),
            1 => format!(" ({} samples from 1 short window)", w.window_samples),
            n => format!(" ({} samples from {n} short windows)", w.window_samples),
        };
        format!(
            "; in windows {:.1}% of the time so far{drawn}{}{narrowed}{tails}",
            w.share_open() * 100.0,
            if w.continuous() {
                ", every call now"
            } else {
                ""
            },
        )
    });
    format!(
        "malloc and operator new {how} (weighed by jemalloc's per-thread byte counter){so_far}, \
         requests above {} where its slow path takes them",
        crate::units::bytes(large_above as f64)
    )
}
