//! What one probe hit costs on this host, measured at start (trap costs
//! differ 2x between hosts of one kind, so constants from elsewhere
//! mislead): memprobe starts a copy of itself that calls a short function
//! in a loop, and times the loop with no probe, with the allocation
//! program on its `nop` (which the kernel emulates), on its `ret` (which it
//! single-steps), with a uretprobe added, with a free's program on the
//! `nop` instead, on `endbr64`, which CET builds (Ubuntu's, Fedora's
//! glibc) start every function with, and on the `nop` beside a uprobe
//! session linked for another process, which forces a return on every
//! call (as a second profiled process of the same file does). The function
//! is called with a size of 0, so the countdown never samples: each hit
//! costs what an unsampled call costs. A free's program is timed with a
//! new pointer each call, none of them sampled: like a real free, each hit
//! reads its pointer's slot in the counts of sampled pointers (and looks it
//! up in the sampled set where the slot counts any), a slot the previous
//! hit did not warm (a null pointer returns before either).
//!
//! The costs are measured again while the run goes on, soon at first,
//! then every `--recalibrate-every`, the copy timed in the background
//! ([`Remeasurement`]) over fewer rounds: hits are priced at the mean of
//! several measurements (`super::recent`).
//!
//! Where the probes are perf events bound to the copy's main thread (no
//! uprobe_multi links filtered by process, before 6.10), pipe round trips
//! of that thread and of a second copy's, with one event, are timed
//! against another thread's, taking turns with the kinds: what the
//! kernel's switching the events with the thread adds to each of its
//! context switches, for the thread and per event ([`switches`]).
//!
//! A VM's trap costs drift by 10% within seconds, so each kind has its own
//! copy of the function, probed throughout, and the kinds take turns in
//! short rounds; each round is timed in the thread's CPU time (a preempted
//! round does not count long), and a kind's cost is its median round: one
//! unlucky round, or a kind timed while the host was slower, does not set
//! the price.
mod error;

use std::{path::Path, time::Duration};

pub use error::CalibrationError;
use profiler_common::programs;

use crate::{
    kernel::{CalibrationProbes, KernelProbes},
    run::cost::CostModel,
};

mod copy;
mod switches;

pub use copy::serve_as_target;
use copy::{BASELINE_COPY, COPY_BYTES, ENDBR64, NOP, Policy, RET, Target, target_location};
use switches::{LoneCopy, SwitchRound};

/// Calls timed per request, by what each one costs.
const FAST_CALLS: u64 = 10_000;
const SLOW_CALLS: u64 = 1_000;
const BASELINE_CALLS: u64 = 1_000_000;
/// Rounds per kind at start, where one measurement prices the first
/// second alone: each kind's cost is the median of its rounds.
const START_ROUNDS: usize = 7;
/// Rounds per kind of each measurement again, whose costs are averaged
/// with others' ([`super::recent`]): some 0.15 s of one CPU each.
const AGAIN_ROUNDS: usize = 3;
/// Bytes between the pointers a free's timing passes: a small size class.
const FREE_STRIDE: u64 = 48;

/// One kind of probe hit timed: the programs attached (each at its offset
/// in the target function), calls per round, and the pointers' stride.
struct Kind {
    programs: &'static [(&'static str, u64)],
    calls: u64,
    stride: u64,
    /// A uprobe session on the `nop` too, linked for memprobe's own process
    /// (which never calls the copy): filtered out in the copy's, it asks
    /// for the return half of every call, as another profiled process's
    /// session on a shared file does (`kernel::shared`).
    foreign_session: bool,
}

const ENTRY: &str = programs::ALLOC_SIZE_ARG0;
/// The kinds timed; a kind's index is also the copy of the target function
/// its probes are on.
const KINDS: [Kind; 6] = [
    Kind {
        programs: &[(ENTRY, NOP)],
        calls: FAST_CALLS,
        stride: 0,
        foreign_session: false,
    },
    Kind {
        programs: &[(ENTRY, RET)],
        calls: SLOW_CALLS,
        stride: 0,
        foreign_session: false,
    },
    Kind {
        programs: &[(ENTRY, NOP), (programs::CALL_RETURN, NOP)],
        calls: FAST_CALLS,
        stride: 0,
        foreign_session: false,
    },
    Kind {
        programs: &[(ENTRY, ENDBR64)],
        calls: SLOW_CALLS,
        stride: 0,
        foreign_session: false,
    },
    Kind {
        programs: &[(programs::FREE_ARG0, NOP)],
        calls: FAST_CALLS,
        stride: FREE_STRIDE,
        foreign_session: false,
    },
    Kind {
        programs: &[(ENTRY, NOP)],
        calls: FAST_CALLS,
        stride: 0,
        foreign_session: true,
    },
];
const EMULATED: usize = 0;
const SINGLE_STEPPED: usize = 1;
const WITH_RETURN: usize = 2;
const ON_ENDBR64: usize = 3;
const FREE: usize = 4;
const FORCED_RETURN: usize = 5;

/// Measures the per-hit costs of this host's probes with `probes`' own
/// programs; nothing stays attached.
pub fn measure(probes: &mut KernelProbes) -> Result<CostModel, CalibrationError> {
    let (executable, offset) = target_location()?;
    let mut target = Target::start(&executable, Policy::Normal)?;
    let pid = target.child.id();
    // First: how probes are linked decides what they cost.
    probes.check_links(&executable, offset + NOP, pid);
    let (mut attached, mut forcing) = attach_kinds(probes, &executable, offset, pid)?;
    // A first round, not counted, finds whether entry links reach the
    // copy's thread.
    let first = target.time(KINDS[EMULATED].calls, 0, EMULATED);
    if first.is_ok() && probes.calibration_hits() == 0 {
        detach_kinds(probes, attached);
        probes.give_up_entry_links();
        (attached, forcing) = attach_kinds(probes, &executable, offset, pid)?;
    }
    let events = task_events(&attached);
    let (attached, mut lone) = with_lone_copy(
        probes,
        (&executable, offset, Policy::Normal),
        attached,
        events,
    )?;
    let timings =
        first.and_then(|_| Timings::<START_ROUNDS>::take(&mut target, lone.as_mut(), events));
    detach_kinds(probes, attached);
    Ok(timings?.model(forcing))
}

/// The costs measured again while a session runs (the links the kernel
/// takes were found at start): the copy is timed in a thread of its own,
/// so the session's loop goes on meanwhile.
pub struct Remeasurement {
    attached: Vec<CalibrationProbes>,
    forcing: bool,
    timing: std::thread::JoinHandle<Result<Timings<AGAIN_ROUNDS>, CalibrationError>>,
}

impl Remeasurement {
    /// Starts a copy that runs only where a CPU is idle and attaches each
    /// kind's probes to it; the copy is waited for in the timing thread,
    /// not in the session's loop, which goes on draining the ring buffer.
    /// Dropped unfinished, its probes go with `probes`, and the copy exits
    /// once its timing thread ends (at the latest, with memprobe).
    pub fn start(probes: &mut KernelProbes) -> Result<Self, CalibrationError> {
        let (executable, offset) = target_location()?;
        let mut target = Target::spawn(&executable, Policy::Idle)?;
        let pid = target.child.id();
        let (attached, forcing) = attach_kinds(probes, &executable, offset, pid)?;
        let events = task_events(&attached);
        let (attached, mut lone) = with_lone_copy(
            probes,
            (&executable, offset, Policy::Idle),
            attached,
            events,
        )?;
        let timing = std::thread::spawn(move || {
            target.wait_ready()?;
            Timings::take(&mut target, lone.as_mut(), events)
        });
        Ok(Self {
            attached,
            forcing,
            timing,
        })
    }

    pub fn is_done(&self) -> bool {
        self.timing.is_finished()
    }

    /// Prices what it timed (once the timing ended), and hands back its
    /// probes, one kind each, to be detached: closing a link waits for a
    /// grace period (25 to 36 ms each), so the session detaches one a tick
    /// rather than stall its loop while the ring buffer fills.
    pub fn finish(self) -> (Result<CostModel, CalibrationError>, Vec<CalibrationProbes>) {
        let timings = self.timing.join();
        let model = timings
            .map_err(|_| CalibrationError::Panicked)
            .and_then(|timings| Ok(timings?.model(self.forcing)));
        (model, self.attached)
    }
}

/// Nanoseconds per call: of the unprobed copy with a null argument and
/// with a free's pointers, and of each kind (a row) in each round (a
/// column); with `events` perf events on the copy's main thread (and the
/// lone copy's), what each round's switches added.
struct Timings<const ROUNDS: usize> {
    baseline: f64,
    pointers_baseline: f64,
    rounds: [[f64; ROUNDS]; KINDS.len()],
    events: usize,
    switches: Option<[SwitchRound; ROUNDS]>,
}

impl<const ROUNDS: usize> Timings<ROUNDS> {
    fn take(
        target: &mut Target,
        lone: Option<&mut LoneCopy>,
        events: usize,
    ) -> Result<Self, CalibrationError> {
        let baseline = target.time(BASELINE_CALLS, 0, BASELINE_COPY)?;
        let pointers_baseline = target.time(BASELINE_CALLS, FREE_STRIDE, BASELINE_COPY)?;
        let switches = match lone {
            Some(lone) => {
                lone.target.wait_ready()?;
                Some((lone, switches::switch_cpu(target)))
            }
            None => None,
        };
        let (rounds, switches) = time_rounds(target, switches)?;
        Ok(Self {
            baseline,
            pointers_baseline,
            rounds,
            events,
            switches,
        })
    }

    /// Each kind's median cost over its baseline; a return's over the
    /// entry probe alone, round by round. Without sessions no return is
    /// forced (nor timed): it is priced as a return half.
    fn model(&self, forcing: bool) -> CostModel {
        let rounds = &self.rounds;
        let added = |kind: usize, baseline: f64| median(rounds[kind].map(|t| t - baseline));
        let over_emulated = |kind: usize| {
            median::<ROUNDS>(std::array::from_fn(|round| {
                rounds[kind][round] - rounds[EMULATED][round]
            }))
        };
        let nanos = |ns: f64| Duration::from_nanos(ns.max(1.0) as u64);
        let forced = if forcing { FORCED_RETURN } else { WITH_RETURN };
        CostModel {
            emulated: nanos(added(EMULATED, self.baseline)),
            free: nanos(added(FREE, self.pointers_baseline)),
            single_stepped: nanos(added(SINGLE_STEPPED, self.baseline)),
            return_half: nanos(over_emulated(WITH_RETURN)),
            forced_return: nanos(over_emulated(forced)),
            endbr64: nanos(added(ON_ENDBR64, self.baseline)),
            switch_per_thread: self.switch_price(|(thread, _)| thread),
            switch_per_event: self.switch_price(|(_, event)| event),
            measured: true,
        }
    }

    /// One part of a switch's price ([`switches::prices`]): none where no
    /// switch was timed.
    fn switch_price(&self, part: fn((f64, f64)) -> f64) -> Duration {
        self.switches.map_or(Duration::ZERO, |rounds| {
            let ns = part(switches::prices(&rounds, self.events));
            Duration::from_nanos(ns.max(1.0) as u64)
        })
    }
}

/// Attaches each kind's programs to its own copy of the target function;
/// with them, whether the foreign session was linked (the kernel has
/// sessions).
fn attach_kinds(
    probes: &mut KernelProbes,
    executable: &Path,
    offset: u64,
    pid: u32,
) -> Result<(Vec<CalibrationProbes>, bool), CalibrationError> {
    let mut attached = Vec::with_capacity(KINDS.len());
    let mut forcing = false;
    for (copy, kind) in KINDS.iter().enumerate() {
        let copy_offset = offset + copy as u64 * COPY_BYTES;
        match probes.attach_for_calibration(kind.programs, executable, copy_offset, pid) {
            Ok(mut handle) => {
                if kind.foreign_session {
                    let own = std::process::id();
                    forcing =
                        probes.add_foreign_session(&mut handle, executable, copy_offset + NOP, own);
                }
                attached.push(handle);
            }
            Err(error) => {
                detach_kinds(probes, attached);
                return Err(CalibrationError::Attach(Box::new(error)));
            }
        }
    }
    Ok((attached, forcing))
}

/// Where the kinds' probes, `attached`, put more than one perf event on
/// the copy's main thread: the lone copy started, its probe joining them
/// ([`switches`]). On failure, all of them detached.
fn with_lone_copy(
    probes: &mut KernelProbes,
    (executable, offset, policy): (&Path, u64, Policy),
    mut attached: Vec<CalibrationProbes>,
    events: usize,
) -> Result<(Vec<CalibrationProbes>, Option<LoneCopy>), CalibrationError> {
    if events <= 1 {
        return Ok((attached, None));
    }
    match LoneCopy::start(probes, (executable, offset), policy) {
        Ok((copy, probe)) => {
            attached.push(probe);
            Ok((attached, Some(copy)))
        }
        Err(error) => {
            detach_kinds(probes, attached);
            Err(error)
        }
    }
}

/// The perf events the kinds' probes put on the copy's main thread.
fn task_events(attached: &[CalibrationProbes]) -> usize {
    attached.iter().map(CalibrationProbes::task_events).sum()
}

fn detach_kinds(probes: &mut KernelProbes, attached: Vec<CalibrationProbes>) {
    for kind in attached {
        probes.detach_calibration(kind);
    }
}

/// Nanoseconds per call of each kind (a row) in each round (a column),
/// the kinds taking turns within a round; with the lone copy (switches
/// timed on the CPU given), what each round's switches added.
type Rounds<const ROUNDS: usize> = ([[f64; ROUNDS]; KINDS.len()], Option<[SwitchRound; ROUNDS]>);

fn time_rounds<const ROUNDS: usize>(
    target: &mut Target,
    mut switches: Option<(&mut LoneCopy, usize)>,
) -> Result<Rounds<ROUNDS>, CalibrationError> {
    let mut rounds = [[0.0; ROUNDS]; KINDS.len()];
    let mut added = [SwitchRound::default(); ROUNDS];
    for round in 0..ROUNDS {
        for (copy, (kind, times)) in KINDS.iter().zip(rounds.iter_mut()).enumerate() {
            times[round] = target.time(kind.calls, kind.stride, copy)?;
        }
        if let Some((lone, cpu)) = &mut switches {
            added[round] = switches::time_round(target, lone, *cpu)?;
        }
    }
    Ok((rounds, switches.map(|_| added)))
}

/// The middle value (the upper of the two middle ones for an even count;
/// 0 of none).
fn median<const N: usize>(mut values: [f64; N]) -> f64 {
    values.sort_by(f64::total_cmp);
    values.get(N / 2).copied().unwrap_or(0.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_kind_costs_its_median_round() {
        assert_eq!(median([0.9, 0.7, 5.0, 0.8, 0.75]), 0.8);
        assert_eq!(median([2.0, 1.0]), 2.0);
    }
}
