//! The copy of memprobe whose probes are timed: a short function in
//! several copies, each probed for one kind of hit, called in a loop on
//! request, each loop timed in the calling thread's CPU time.
use std::{
    io::{BufRead, BufReader, Write},
    os::unix::process::CommandExt,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::Duration,
};

use crate::{
    clock::clock_ns,
    proc::CpuSet,
    run::cost::calibrate::{CalibrationError, KINDS},
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
pub(super) const ENDBR64: u64 = 0;
pub(super) const NOP: u64 = 4;
pub(super) const RET: u64 = 5;
/// Bytes from one copy to the next (the `.balign` above).
pub(super) const COPY_BYTES: u64 = 16;
/// A copy per kind, then the baselines' copy.
pub(super) const COPIES: usize = KINDS.len() + 1;
pub(super) const BASELINE_COPY: usize = KINDS.len();

unsafe extern "C" {
    fn memprobe_calibration_targets(size: u64);
}

/// Copy `index` (below [`COPIES`]) of the target function.
fn target_copy(index: usize) -> unsafe extern "C" fn(u64) {
    let address = memprobe_calibration_targets as *const () as u64 + index as u64 * COPY_BYTES;
    // SAFETY: each copy starts a function of this signature (see the asm).
    unsafe { std::mem::transmute::<u64, unsafe extern "C" fn(u64)>(address) }
}

/// The first pointer a free's timing passes, then one every `stride` bytes:
/// where a heap could be, never sampled (samples are keyed by process).
const POINTER_BASE: u64 = 0x7f00_0000_0000;

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

/// A request line `switch TRIPS MAIN CPU`: TRIPS round trips over pipes
/// between a timed thread and a partner that echoes, both kept to CPU, the
/// timed thread being the main one (MAIN 1: where perf-event probes are
/// bound) or another (MAIN 0).
fn parse_switch_request(line: &str) -> Option<SwitchRequest> {
    let mut words = line.split_whitespace();
    if words.next()? != "switch" {
        return None;
    }
    let trips = words.next()?.parse().ok()?;
    let on_main = match words.next()? {
        "1" => true,
        "0" => false,
        _ => return None,
    };
    let cpu = words.next()?.parse().ok()?;
    Some(SwitchRequest {
        trips,
        on_main,
        cpu,
    })
}

#[derive(Debug, PartialEq)]
struct SwitchRequest {
    trips: u64,
    on_main: bool,
    cpu: usize,
}

/// Nanoseconds of CPU time per round trip (see [`parse_switch_request`]),
/// the timed thread's and its partner's: each trip switches the timed
/// thread out and back in once, and what the kernel does for its perf
/// events on the way out is charged to the task switched in, its partner
/// (timing the thread alone priced a switch at half, and at a different
/// share each time). Both threads keep to the one CPU asked for, so each
/// switch hands that CPU over (a wake-up on another CPU costs several times
/// more, and where each one lands would swamp what is measured).
fn ping_pong(request: &SwitchRequest) -> Option<f64> {
    use std::io::Read;
    let SwitchRequest {
        trips,
        on_main,
        cpu,
    } = *request;
    let cpu = CpuSet::one(cpu)?;
    let (mut there_in, mut there_out) = std::io::pipe().ok()?;
    let (mut back_in, mut back_out) = std::io::pipe().ok()?;
    let echo = std::thread::spawn(move || {
        cpu.keep_thread(0)?;
        let started = thread_cpu_time();
        let mut byte = [0u8];
        while there_in.read_exact(&mut byte).is_ok() && back_out.write_all(&byte).is_ok() {}
        Some(thread_cpu_time().saturating_sub(started))
    });
    let timed = move || {
        let started = thread_cpu_time();
        let mut byte = [0u8];
        for _ in 0..trips {
            there_out.write_all(&byte).ok()?;
            back_in.read_exact(&mut byte).ok()?;
        }
        let elapsed = thread_cpu_time().saturating_sub(started);
        drop(there_out); // ends the echo
        Some(elapsed)
    };
    let elapsed = if on_main {
        let before = CpuSet::of_thread(0)?;
        cpu.keep_thread(0)?;
        let elapsed = timed();
        before.keep_thread(0)?;
        elapsed
    } else {
        std::thread::spawn(move || {
            cpu.keep_thread(0)?;
            timed()
        })
        .join()
        .ok()?
    };
    let echoed = echo.join().ok()??;
    Some((elapsed? + echoed).as_nanos() as f64 / trips.max(1) as f64)
}

/// In memprobe's calibration copy: answers each request line on stdin
/// (see [`parse_request`], [`parse_switch_request`]) with the nanoseconds
/// of CPU time per call or round trip, until the end of input; then exits.
/// Does nothing in any other process.
pub fn serve_as_target() {
    if std::env::var_os(TARGET_ENV).is_none() {
        return;
    }
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "ready");
    let _ = out.flush();
    for line in std::io::stdin().lock().lines() {
        let line = line.unwrap_or_default();
        if let Some(request) = parse_switch_request(&line) {
            let Some(per_trip) = ping_pong(&request) else {
                break;
            };
            let _ = writeln!(out, "{per_trip}");
            let _ = out.flush();
            continue;
        }
        let Some((calls, stride, copy)) = parse_request(&line) else {
            break;
        };
        // In a thread other than the main one: a kernel whose uprobe_multi
        // links filter by thread, not process (6.6 to 6.9), runs no program
        // there, and memprobe sees no hit and falls back.
        let target = target_copy(copy);
        let timing = std::thread::spawn(move || {
            let mut elapsed = Duration::ZERO;
            let mut call = 0;
            while call < calls {
                let end = calls.min(call + CALLS_PER_READING);
                let started = thread_cpu_time();
                for call in call..end {
                    let argument = if stride == 0 {
                        0
                    } else {
                        POINTER_BASE + call * stride
                    };
                    // SAFETY: the function touches no memory and returns at once.
                    unsafe { target(std::hint::black_box(argument)) };
                }
                elapsed += thread_cpu_time().saturating_sub(started);
                call = end;
            }
            elapsed
        });
        let Ok(elapsed) = timing.join() else { break };
        let per_call = elapsed.as_nanos() as f64 / calls.max(1) as f64;
        let _ = writeln!(out, "{per_call}");
        let _ = out.flush();
    }
    std::process::exit(0);
}

/// Calls timed between two readings of the thread's CPU clock. Each
/// reading is a system call, where a task woken meanwhile takes the CPU:
/// the kernel leaves a task that runs in user mode alone until its next
/// tick (4 ms at 250 Hz), and the baselines' million unprobed calls, which
/// never trap, held a server's requests up that long.
const CALLS_PER_READING: u64 = 4096;

/// The CPU time the calling thread has used: a round preempted by another
/// task is not counted long, and trap handling, done in the kernel on the
/// thread's behalf, is counted in it (as in the target's CPU time).
fn thread_cpu_time() -> Duration {
    Duration::from_nanos(clock_ns(libc::CLOCK_THREAD_CPUTIME_ID))
}

/// How a copy shares its CPU with the host's other tasks.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum Policy {
    /// The normal policy: timed at start, before memprobe attaches, where
    /// waiting for an idle CPU would delay the run on a busy host.
    Normal,
    /// `SCHED_IDLE` from before its `exec`: timed again while a run goes on
    /// (see [`yield_to_others`]).
    Idle,
}

/// Has the calling thread, and the threads it starts, yield the CPU to
/// every other task (`SCHED_IDLE`). Measured again while a run goes on, a
/// copy's loops took a CPU from the host's work for 0.15 s at a time, and
/// a server's requests waited behind them for up to 4 ms each (at nice 19
/// as well: the scheduler lets a running task finish its slice whatever
/// its weight, where a task of the idle policy gives way at once). Set
/// before the copy's `exec`: given the policy once started, copies were
/// still seen now and then holding a CPU until the tick, likely while the
/// loader mapped and relocated memprobe's executable. Its CPU time is what
/// is timed, not how long the loops took; on a host with no idle CPU the
/// measurement waits, and the costs measured before stay.
fn yield_to_others() {
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: a plain system call on the calling process with a valid
    // parameter.
    unsafe { libc::sched_setscheduler(0, libc::SCHED_IDLE, &param) };
}

/// The copy of memprobe being timed.
pub(super) struct Target {
    pub(super) child: Child,
    lines: std::io::Lines<BufReader<std::process::ChildStdout>>,
}

impl Target {
    /// Starts the copy and waits until it serves.
    pub(super) fn start(executable: &Path, policy: Policy) -> Result<Self, CalibrationError> {
        let mut target = Self::spawn(executable, policy)?;
        target.wait_ready()?;
        Ok(target)
    }

    /// Starts the copy without waiting for it: its pid is known at once,
    /// and probes attached to it before it maps memprobe's executable go
    /// in when it does.
    pub(super) fn spawn(executable: &Path, policy: Policy) -> Result<Self, CalibrationError> {
        let mut command = Command::new(executable);
        command
            .env(TARGET_ENV, "1")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null());
        if policy == Policy::Idle {
            // SAFETY: the closure makes one system call, which is safe
            // between fork and exec; a failure leaves the policy as it was.
            unsafe {
                command.pre_exec(|| {
                    yield_to_others();
                    Ok(())
                })
            };
        }
        let mut child = command
            .spawn()
            .map_err(|e| CalibrationError::Start(executable.into(), e))?;
        let stdout = child.stdout.take().ok_or(CalibrationError::Stopped)?;
        Ok(Self {
            child,
            lines: BufReader::new(stdout).lines(),
        })
    }

    /// Waits for the copy's first line, said once it serves requests.
    pub(super) fn wait_ready(&mut self) -> Result<(), CalibrationError> {
        self.read_line().map(drop)
    }

    fn read_line(&mut self) -> Result<String, CalibrationError> {
        match self.lines.next() {
            Some(Ok(line)) => Ok(line),
            _ => Err(CalibrationError::Stopped),
        }
    }

    /// Nanoseconds per call of one run of `calls` calls of the target's
    /// copy `copy`, with pointers `stride` bytes apart (0: a null argument).
    pub(super) fn time(
        &mut self,
        calls: u64,
        stride: u64,
        copy: usize,
    ) -> Result<f64, CalibrationError> {
        self.ask(&format!("{calls} {stride} {copy}"))
    }

    /// CPU nanoseconds per round trip of `trips` pipe round trips, on
    /// `cpu`, of the copy's main thread (`on_main`) or of another of its
    /// threads.
    pub(super) fn time_switches(
        &mut self,
        trips: u64,
        on_main: bool,
        cpu: usize,
    ) -> Result<f64, CalibrationError> {
        self.ask(&format!("switch {trips} {} {cpu}", u8::from(on_main)))
    }

    /// The CPU, of those the copy may run on, that was busy least over
    /// `look`, for timing switches: each switch out is charged to the task
    /// switched in, at times a third one's on a busy CPU (a CPU shared with
    /// a busy target priced a switch 15% low). `None` if the CPUs' times
    /// or the copy's CPUs cannot be read.
    pub(super) fn quietest_cpu(&self, look: Duration) -> Option<usize> {
        let allowed = CpuSet::of_thread(self.child.id())?;
        let before = crate::proc::cpu_busy_ticks()?;
        std::thread::sleep(look);
        let after = crate::proc::cpu_busy_ticks()?;
        after
            .iter()
            .filter(|(cpu, _)| allowed.contains(*cpu))
            .filter_map(|&(cpu, busy)| {
                let (_, earlier) = before.iter().find(|(c, _)| *c == cpu)?;
                Some((busy.saturating_sub(*earlier), cpu))
            })
            .min()
            .map(|(_, cpu)| cpu)
    }

    fn ask(&mut self, request: &str) -> Result<f64, CalibrationError> {
        let stdin = self.child.stdin.as_mut().ok_or(CalibrationError::Stopped)?;
        writeln!(stdin, "{request}").map_err(CalibrationError::Ask)?;
        let line = self.read_line()?;
        line.trim()
            .parse()
            .map_err(|_| CalibrationError::BadTiming(line))
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
pub(super) fn target_location() -> Result<(PathBuf, u64), CalibrationError> {
    let address = memprobe_calibration_targets as *const () as u64;
    let maps = std::fs::read_to_string("/proc/self/maps").map_err(CalibrationError::OwnMaps)?;
    let mapping = crate::proc::parse_maps(&maps)
        .into_iter()
        .find(|m| m.range().contains(address))
        .ok_or(CalibrationError::NotMapped)?;
    let path = mapping.path.clone().ok_or(CalibrationError::NotMapped)?;
    Ok((
        PathBuf::from(path),
        address - mapping.start + mapping.offset,
    ))
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
        let request = |trips, on_main, cpu| SwitchRequest {
            trips,
            on_main,
            cpu,
        };
        let parsed = parse_switch_request("switch 1000 1 3");
        assert_eq!(parsed, Some(request(1_000, true, 3)));
        let parsed = parse_switch_request("switch 1000 0 0");
        assert_eq!(parsed, Some(request(1_000, false, 0)));
        assert_eq!(parse_switch_request("switch 1000 2 0"), None);
        assert_eq!(parse_switch_request("switch 1000 1"), None);
        assert_eq!(parse_switch_request("1000 0 1"), None);
    }

    #[test]
    fn a_ping_pong_takes_cpu_time_on_either_thread() {
        // SAFETY: sched_getcpu takes nothing and only answers.
        let cpu = usize::try_from(unsafe { libc::sched_getcpu() }).unwrap();
        for on_main in [false, true] {
            let per_trip = ping_pong(&SwitchRequest {
                trips: 200,
                on_main,
                cpu,
            })
            .unwrap();
            assert!(per_trip > 0.0, "{per_trip}");
        }
    }

    /// A shell started as a copy is, says its own policy (the 41st field
    /// of its stat): an idle one is idle before its first instruction.
    #[test]
    fn a_copy_runs_at_its_policy_from_its_exec() {
        for (policy, expected) in [(Policy::Idle, libc::SCHED_IDLE), (Policy::Normal, 0)] {
            let mut shell = Target::spawn(Path::new("/bin/sh"), policy).unwrap();
            let stdin = shell.child.stdin.as_mut().unwrap();
            writeln!(stdin, "cut -d' ' -f41 /proc/$$/stat").unwrap();
            assert_eq!(
                shell.read_line().unwrap(),
                expected.to_string(),
                "{policy:?}"
            );
        }
    }

    #[test]
    fn each_copy_of_the_target_returns() {
        for copy in 0..COPIES {
            // SAFETY: each copy is `endbr64; nop; ret`.
            unsafe { target_copy(copy)(0) };
        }
    }
}
