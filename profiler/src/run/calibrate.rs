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
//! The costs are measured again every `--recalibrate-every` while the
//! run goes on, the copy timed in the background ([`Remeasurement`]).
//!
//! A VM's trap costs drift by 10% within seconds, so each kind has its own
//! copy of the function, probed throughout, and the kinds take turns in
//! short rounds; each round is timed in the thread's CPU time (a preempted
//! round does not count long), and a kind's cost is its median round: one
//! unlucky round, or a kind timed while the host was slower, does not set
//! the price.
use std::{
    io::{BufRead, BufReader, Write},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::Duration,
};

use profiler_common::programs;

use crate::{
    collect::clock_ns,
    kernel::{CalibrationProbes, KernelProbes},
    run::cost::CostModel,
};

/// Set in the copy's environment: it serves timings instead of profiling.
const TARGET_ENV: &str = "MEMPROBE_CALIBRATION_TARGET";

// One copy of the target function per kind of hit timed, each with its
// own probes, so that the kinds' rounds take turns without attaching and
// detaching (which takes longer than the rounds), and one never probed,
// for the baselines: `endbr64` (at +0, for CET builds' first
// instruction), `nop` (+4, emulated: where the probe goes), `ret` (+5,
// single-stepped), every [`COPY_BYTES`].
core::arch::global_asm!(
    ".pushsection .text.memprobe_calibration_targets,\"ax\",@progbits",
    ".globl memprobe_calibration_targets",
    ".type memprobe_calibration_targets,@function",
    ".balign 16",
    "memprobe_calibration_targets:",
    ".rept {copies}",
    ".balign 16",
    "endbr64",
    "nop",
    "ret",
    ".endr",
    ".size memprobe_calibration_targets, .-memprobe_calibration_targets",
    ".popsection",
    copies = const COPIES,
);

/// Offsets in a copy of the target function.
const ENDBR64: u64 = 0;
const NOP: u64 = 4;
const RET: u64 = 5;
/// Bytes from one copy to the next (the `.balign` above).
const COPY_BYTES: u64 = 16;
/// A copy per kind, then the baselines' copy.
const COPIES: usize = KINDS.len() + 1;
const BASELINE_COPY: usize = KINDS.len();

unsafe extern "C" {
    fn memprobe_calibration_targets(size: u64);
}

/// Copy `index` (below [`COPIES`]) of the target function.
fn target_copy(index: usize) -> unsafe extern "C" fn(u64) {
    let address = memprobe_calibration_targets as *const () as u64 + index as u64 * COPY_BYTES;
    // SAFETY: each copy starts a function of this signature (see the asm).
    unsafe { std::mem::transmute::<u64, unsafe extern "C" fn(u64)>(address) }
}

/// Calls timed per request, by what each one costs.
const FAST_CALLS: u64 = 10_000;
const SLOW_CALLS: u64 = 1_000;
const BASELINE_CALLS: u64 = 1_000_000;
/// Rounds per kind: each kind's cost is the median of its rounds.
const ROUNDS: usize = 7;
/// The first pointer a free's timing passes, then one every `stride` bytes:
/// where a heap could be, never sampled (samples are keyed by process).
const POINTER_BASE: u64 = 0x7f00_0000_0000;
/// Bytes between the pointers a free's timing passes: a small size class.
const FREE_STRIDE: u64 = 48;

/// A request line: `CALLS STRIDE COPY`: CALLS calls of the target's copy
/// COPY with argument 0 (STRIDE 0) or pointers [`POINTER_BASE`] + i *
/// STRIDE.
fn parse_request(line: &str) -> Option<(u64, u64, usize)> {
    let mut words = line.split_whitespace();
    let mut next = || words.next()?.parse::<u64>().ok();
    let (calls, stride, copy) = (next()?, next()?, next()?);
    let copy = usize::try_from(copy).ok().filter(|&c| c < COPIES)?;
    Some((calls, stride, copy))
}

/// In memprobe's calibration copy: answers each request line on stdin
/// (see [`parse_request`]) with the nanoseconds of CPU time per call, until
/// the end of input; then exits.
/// Does nothing in any other process.
pub fn serve_as_target() {
    if std::env::var_os(TARGET_ENV).is_none() {
        return;
    }
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "ready");
    let _ = out.flush();
    for line in std::io::stdin().lock().lines() {
        let Some((calls, stride, copy)) = parse_request(&line.unwrap_or_default()) else {
            break;
        };
        // In a thread other than the main one: a kernel whose uprobe_multi
        // links filter by thread, not process (6.6 to 6.9), runs no program
        // there, and memprobe sees no hit and falls back.
        let target = target_copy(copy);
        let timing = std::thread::spawn(move || {
            let started = thread_cpu_time();
            for call in 0..calls {
                let argument = if stride == 0 {
                    0
                } else {
                    POINTER_BASE + call * stride
                };
                // SAFETY: the function touches no memory and returns at once.
                unsafe { target(std::hint::black_box(argument)) };
            }
            thread_cpu_time().saturating_sub(started)
        });
        let Ok(elapsed) = timing.join() else { break };
        let per_call = elapsed.as_nanos() as f64 / calls.max(1) as f64;
        let _ = writeln!(out, "{per_call}");
        let _ = out.flush();
    }
    std::process::exit(0);
}

/// The CPU time the calling thread has used: a round preempted by another
/// task is not counted long, and trap handling, done in the kernel on the
/// thread's behalf, is counted in it (as in the target's CPU time).
fn thread_cpu_time() -> Duration {
    Duration::from_nanos(clock_ns(libc::CLOCK_THREAD_CPUTIME_ID))
}

/// The copy of memprobe being timed.
struct Target {
    child: Child,
    lines: std::io::Lines<BufReader<std::process::ChildStdout>>,
}

impl Target {
    fn start(executable: &Path) -> Result<Self, String> {
        let mut child = Command::new(executable)
            .env(TARGET_ENV, "1")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("starting {}: {e}", executable.display()))?;
        let stdout = child.stdout.take().ok_or("no stdout")?;
        let mut target = Self {
            child,
            lines: BufReader::new(stdout).lines(),
        };
        target.read_line()?;
        Ok(target)
    }

    fn read_line(&mut self) -> Result<String, String> {
        match self.lines.next() {
            Some(Ok(line)) => Ok(line),
            _ => Err("the calibration copy stopped".into()),
        }
    }

    /// Nanoseconds per call of one run of `calls` calls of the target's
    /// copy `copy`, with pointers `stride` bytes apart (0: a null argument).
    fn time(&mut self, calls: u64, stride: u64, copy: usize) -> Result<f64, String> {
        let stdin = self.child.stdin.as_mut().ok_or("no stdin")?;
        writeln!(stdin, "{calls} {stride} {copy}").map_err(|e| e.to_string())?;
        let line = self.read_line()?;
        line.trim()
            .parse()
            .map_err(|_| format!("bad timing {line:?}"))
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        drop(self.child.stdin.take());
        let _ = self.child.wait();
    }
}

/// Where the target function's copies are in memprobe's executable: its
/// path and the file offset of the first copy's first instruction.
fn target_location() -> Result<(PathBuf, u64), String> {
    let address = memprobe_calibration_targets as *const () as u64;
    let maps = std::fs::read_to_string("/proc/self/maps").map_err(|e| e.to_string())?;
    let mapping = crate::proc::parse_maps(&maps)
        .into_iter()
        .find(|m| m.range().contains(address))
        .ok_or("the target function is in no mapping")?;
    let path = mapping
        .path
        .clone()
        .ok_or("the target's mapping has no file")?;
    Ok((
        PathBuf::from(path),
        address - mapping.start + mapping.offset,
    ))
}

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
pub fn measure(probes: &mut KernelProbes) -> Result<CostModel, String> {
    let (executable, offset) = target_location()?;
    let mut target = Target::start(&executable)?;
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
    let timings = first.and_then(|_| Timings::take(&mut target));
    detach_kinds(probes, attached);
    Ok(timings?.model(forcing))
}

/// The costs measured again while a session runs (the links the kernel
/// takes were found at start): the copy is timed in a thread of its own,
/// so the session's loop goes on meanwhile.
pub struct Remeasurement {
    attached: Vec<CalibrationProbes>,
    forcing: bool,
    timing: std::thread::JoinHandle<Result<Timings, String>>,
}

impl Remeasurement {
    /// Starts a copy and attaches each kind's probes to it. Dropped
    /// unfinished, its probes go with `probes`, and the copy exits once
    /// its timing thread ends (at the latest, with memprobe).
    pub fn start(probes: &mut KernelProbes) -> Result<Self, String> {
        let (executable, offset) = target_location()?;
        let mut target = Target::start(&executable)?;
        let pid = target.child.id();
        let (attached, forcing) = attach_kinds(probes, &executable, offset, pid)?;
        let timing = std::thread::spawn(move || Timings::take(&mut target));
        Ok(Self {
            attached,
            forcing,
            timing,
        })
    }

    pub fn is_done(&self) -> bool {
        self.timing.is_finished()
    }

    /// Detaches its probes (once the timing ended) and prices what it
    /// timed.
    pub fn finish(self, probes: &mut KernelProbes) -> Result<CostModel, String> {
        let timings = self.timing.join();
        detach_kinds(probes, self.attached);
        let timings = timings.map_err(|_| "the timing thread panicked".to_string())?;
        Ok(timings?.model(self.forcing))
    }
}

/// Nanoseconds per call: of the unprobed copy with a null argument and
/// with a free's pointers, and of each kind (a row) in each round (a
/// column).
struct Timings {
    baseline: f64,
    pointers_baseline: f64,
    rounds: [[f64; ROUNDS]; KINDS.len()],
}

impl Timings {
    fn take(target: &mut Target) -> Result<Self, String> {
        Ok(Self {
            baseline: target.time(BASELINE_CALLS, 0, BASELINE_COPY)?,
            pointers_baseline: target.time(BASELINE_CALLS, FREE_STRIDE, BASELINE_COPY)?,
            rounds: time_rounds(target)?,
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
            measured: true,
        }
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
) -> Result<(Vec<CalibrationProbes>, bool), String> {
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
                return Err(error);
            }
        }
    }
    Ok((attached, forcing))
}

fn detach_kinds(probes: &mut KernelProbes, attached: Vec<CalibrationProbes>) {
    for kind in attached {
        probes.detach_calibration(kind);
    }
}

/// Nanoseconds per call of each kind (a row) in each round (a column),
/// the kinds taking turns within a round.
fn time_rounds(target: &mut Target) -> Result<[[f64; ROUNDS]; KINDS.len()], String> {
    let mut rounds = [[0.0; ROUNDS]; KINDS.len()];
    for round in 0..ROUNDS {
        for (copy, (kind, times)) in KINDS.iter().zip(rounds.iter_mut()).enumerate() {
            times[round] = target.time(kind.calls, kind.stride, copy)?;
        }
    }
    Ok(rounds)
}

/// The middle value (the upper of the two middle ones for an even count).
fn median<const N: usize>(mut values: [f64; N]) -> f64 {
    values.sort_by(f64::total_cmp);
    values[N / 2]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_name_calls_stride_and_a_copy_that_exists() {
        assert_eq!(parse_request("20000 48 4"), Some((20_000, 48, 4)));
        assert_eq!(parse_request("1000 0 0"), Some((1_000, 0, 0)));
        assert_eq!(parse_request("1000 0 6"), Some((1_000, 0, 6)));
        assert_eq!(parse_request("1000 0 7"), None);
        assert_eq!(parse_request("1000 0"), None);
        assert_eq!(parse_request(""), None);
    }

    #[test]
    fn a_kind_costs_its_median_round() {
        assert_eq!(median([0.9, 0.7, 5.0, 0.8, 0.75]), 0.8);
        assert_eq!(median([2.0, 1.0]), 2.0);
    }

    #[test]
    fn each_copy_of_the_target_returns() {
        for copy in 0..COPIES {
            // SAFETY: each copy is `endbr64; nop; ret`.
            unsafe { target_copy(copy)(0) };
        }
    }
}
