//! What perf events on a thread add to each of its context switches, where
//! probes are perf events bound to a process's main thread (no
//! uprobe_multi links filtered by process, before 6.10). The kernel
//! switches the thread's perf context out and in, a part paid whatever
//! its events, and each event with it, a part per event: measured here,
//! some 0.9 µs a switch and 0.2 µs an event. Priced per event alone, from
//! the kinds' copy's seven, a glibc process's 23 (the allocators' 15 and
//! the mapping probes' 8) were priced 1.26x what they added.
//!
//! So two main threads are timed against a thread without any event: the
//! kinds' copy's, with every kind's events, and a second copy's, with one;
//! the difference between the two is the events', the rest the thread's.
use std::{path::Path, time::Duration};

use super::{
    CalibrationError, EMULATED, KINDS,
    copy::{COPY_BYTES, Policy, Target},
    median,
};
use crate::kernel::{CalibrationProbes, KernelProbes};

/// Pipe round trips per timing of a thread's context switches.
const SWITCH_TRIPS: u64 = 3_000;
/// How long the CPUs' busy times are looked at to choose where the
/// switches are timed (/proc/stat counts clock ticks, 10 ms apart).
const QUIET_LOOK: Duration = Duration::from_millis(50);

/// The second copy, whose main thread carries one perf event.
pub(super) struct LoneCopy {
    pub(super) target: Target,
}

impl LoneCopy {
    /// Starts the copy (`Target::spawn`: its readiness is waited for by the
    /// first timing) and puts one probe on its main thread, on a function
    /// it never calls.
    pub(super) fn start(
        probes: &mut KernelProbes,
        (executable, offset): (&Path, u64),
        policy: Policy,
    ) -> Result<(Self, CalibrationProbes), CalibrationError> {
        let target = Target::spawn(executable, policy)?;
        let copy_offset = offset + EMULATED as u64 * COPY_BYTES;
        let pid = target.child.id();
        let probe = probes
            .attach_for_calibration(KINDS[EMULATED].programs, executable, copy_offset, pid)
            .map_err(|error| CalibrationError::Attach(Box::new(error)))?;
        Ok((Self { target }, probe))
    }
}

/// Nanoseconds a round trip took more, in one round, on the kinds' copy's
/// main thread (`many` events) and on the lone copy's (one event), than on
/// a thread without any.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(super) struct SwitchRound {
    many: f64,
    one: f64,
}

/// Where the switches are timed: the quietest CPU the copies may run on,
/// else the one memprobe runs on.
pub(super) fn switch_cpu(target: &Target) -> usize {
    target.quietest_cpu(QUIET_LOOK).unwrap_or_else(|| {
        // SAFETY: sched_getcpu takes nothing and only answers.
        usize::try_from(unsafe { libc::sched_getcpu() }).unwrap_or(0)
    })
}

/// One round of switch timings on `cpu`, the threads taking turns in an
/// order that is the same read backwards: a drift of the host's speed
/// within the round cancels out.
pub(super) fn time_round(
    kinds: &mut Target,
    lone: &mut LoneCopy,
    cpu: usize,
) -> Result<SwitchRound, CalibrationError> {
    let other = kinds.time_switches(SWITCH_TRIPS, false, cpu)?;
    let many = kinds.time_switches(SWITCH_TRIPS, true, cpu)?;
    let one = lone.target.time_switches(SWITCH_TRIPS, true, cpu)?
        + lone.target.time_switches(SWITCH_TRIPS, true, cpu)?;
    let many = many + kinds.time_switches(SWITCH_TRIPS, true, cpu)?;
    let other = other + kinds.time_switches(SWITCH_TRIPS, false, cpu)?;
    Ok(SwitchRound {
        many: ((many - other) / 2.0).max(0.0),
        one: ((one - other) / 2.0).max(0.0),
    })
}

/// A switch's price for the thread and per event, from rounds timed with
/// `events` events on the kinds' copy (more than one): each the median of
/// its rounds' values.
pub(super) fn prices<const N: usize>(rounds: &[SwitchRound; N], events: usize) -> (f64, f64) {
    let others = events.saturating_sub(1).max(1) as f64;
    let per_event = rounds.map(|r| ((r.many - r.one) / others).max(0.0));
    let per_thread: [f64; N] = std::array::from_fn(|i| (rounds[i].one - per_event[i]).max(0.0));
    (median(per_thread), median(per_event))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_thread_s_part_is_what_one_event_adds_beyond_an_event() {
        // 0.9 µs for the thread and 0.2 µs an event, with seven events,
        // one round off.
        let round = |many, one| SwitchRound { many, one };
        let rounds = [
            round(2300.0, 1100.0),
            round(2310.0, 1105.0),
            round(9000.0, 0.0),
        ];
        let (per_thread, per_event) = prices(&rounds, 7);
        assert!((per_event - 200.8).abs() < 0.1, "{per_event}");
        assert!((per_thread - 900.0).abs() < 0.1, "{per_thread}");
        assert_eq!(prices(&[], 7), (0.0, 0.0));
    }
}
