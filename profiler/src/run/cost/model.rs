//! What one probe hit adds to the target, by kind, and so what each
//! attached probe's hits and samples cost.
use std::time::Duration;

use profiler_common::CallShape;

use crate::kernel::{AttachedProbe, ProbeSamples, ReturnHalf};

/// Time one probe hit adds to the target, by kind: measured on this host
/// at start ([`calibrate`]), or, where that failed, defaults from
/// `cargo xtask bench` on this machine kind (a VM, where a single-step trap
/// is dear), which other hosts may differ from by 2x.
#[derive(Clone, Copy, Debug)]
pub struct CostModel {
    /// A probe on an instruction the kernel emulates.
    pub emulated: Duration,
    /// The same for a free's probe, whose program reads a slot of the
    /// sampled pointers' counts that no recent call warmed (and looks the
    /// pointer up where the slot counts any).
    pub free: Duration,
    /// A probe on an instruction the kernel single-steps.
    pub single_stepped: Duration,
    /// The return half of a call with a return probe.
    pub return_half: Duration,
    /// A return that another process's probe at the same place forces
    /// (`kernel::shared`): a trap with no program of memprobe's to run.
    pub forced_return: Duration,
    /// A probe on `endbr64`, where CET builds start each function: probes
    /// go past it where the placement rules allow (entry-only ones).
    pub endbr64: Duration,
    /// A context switch of a thread carrying perf events, whatever their
    /// number: where the kernel does not filter uprobe_multi links by
    /// process (before 6.10) probes are perf events bound to the profiled
    /// process's main thread, which the kernel switches with it every time
    /// it is switched, hit or not.
    pub switch_per_thread: Duration,
    /// The same, more for each perf event on the thread.
    pub switch_per_event: Duration,
    /// Whether these were measured on this host.
    pub measured: bool,
}

impl Default for CostModel {
    fn default() -> Self {
        Self {
            emulated: Duration::from_nanos(760),
            free: Duration::from_nanos(760),
            single_stepped: Duration::from_nanos(10_000),
            return_half: Duration::from_nanos(310),
            forced_return: Duration::from_nanos(310),
            endbr64: Duration::from_nanos(10_000),
            switch_per_thread: Duration::from_nanos(900),
            switch_per_event: Duration::from_nanos(200),
            measured: false,
        }
    }
}

impl std::fmt::Display for CostModel {
    /// "per hit, measured here: 0.76 µs emulated (0.76 µs a free), 10.0 µs
    /// single-stepped, 0.31 µs return, 0.31 µs a forced return; a context
    /// switch 0.90 µs and 0.20 µs per perf event" (the last where one was
    /// timed).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let micros = |d: Duration| d.as_secs_f64() * 1e6;
        write!(
            f,
            "per hit, {}: {:.2} µs emulated ({:.2} µs a free), {:.1} µs single-stepped, \
             {:.2} µs return, {:.2} µs a forced return",
            if self.measured {
                "measured on this host"
            } else {
                "defaults (not measured)"
            },
            micros(self.emulated),
            micros(self.free),
            micros(self.single_stepped),
            micros(self.return_half),
            micros(self.forced_return),
        )?;
        if self.switch_timed() {
            let (thread, event) = (
                micros(self.switch_per_thread),
                micros(self.switch_per_event),
            );
            write!(
                f,
                "; a context switch {thread:.2} µs and {event:.2} µs per perf event"
            )?;
        }
        Ok(())
    }
}

impl CostModel {
    /// Each kind's cost in seconds, named for `/metrics`; none where not
    /// measured, and no context switch where no probe is a perf event on a
    /// thread (none was timed).
    pub fn measured_kinds(&self) -> Vec<(&'static str, f64)> {
        if !self.measured {
            return Vec::new();
        }
        [
            ("emulated", self.emulated),
            ("free", self.free),
            ("single_stepped", self.single_stepped),
            ("return", self.return_half),
            ("forced_return", self.forced_return),
            ("endbr64", self.endbr64),
        ]
        .into_iter()
        .chain(
            self.switch_timed()
                .then_some([
                    ("switch_of_thread_with_perf_events", self.switch_per_thread),
                    ("switch_per_perf_event", self.switch_per_event),
                ])
                .into_iter()
                .flatten(),
        )
        .map(|(kind, cost)| (kind, cost.as_secs_f64()))
        .collect()
    }

    /// Whether a context switch was timed: only where the calibration's
    /// probes were perf events on a thread.
    fn switch_timed(&self) -> bool {
        !(self.switch_per_thread.is_zero() && self.switch_per_event.is_zero())
    }

    /// Per-hit cost of `probe`. A probe kept at the entry for lack of an
    /// emulated instruction is counted as single-stepped; a probe whose
    /// calls all trap at their return for another process's probes
    /// (`forced_return`, see [`KernelProbes::forced_returns`]) pays such a
    /// return on each.
    pub fn per_hit(&self, probe: &AttachedProbe, forced_return: bool) -> Duration {
        let entry = if probe.placement.fallback.is_some() {
            self.single_stepped
        } else if matches!(probe.shape, CallShape::Free | CallShape::FreeInResize) {
            self.free
        } else {
            self.emulated
        };
        match probe.return_half {
            ReturnHalf::Uretprobe => entry + self.return_half,
            _ if forced_return => entry + self.forced_return,
            // Sampled calls only: one in thousands at the default interval.
            ReturnHalf::Session | ReturnHalf::None => entry,
        }
    }

    /// What `samples` of `probe` added beyond their hits: the time its
    /// program spent sending them, as the kernel timed it, and a return
    /// half each where only sampled calls take one. Dense in a window
    /// (a sample per 4 KiB or so), where they cost as much as the traps.
    pub fn sampled(&self, probe: &AttachedProbe, samples: ProbeSamples) -> Duration {
        let returns = match probe.return_half {
            ReturnHalf::Session => self
                .return_half
                .saturating_mul(samples.calls.min(u32::MAX as u64) as u32),
            ReturnHalf::Uretprobe | ReturnHalf::None => Duration::ZERO,
        };
        Duration::from_nanos(samples.nanos) + returns
    }
}
