//! What one probe hit costs on this host, measured at start (trap costs
//! differ 2x between hosts of one kind, so constants from elsewhere
//! mislead): memprobe starts a copy of itself that calls a two-instruction
//! function in a loop, and times the loop with no probe, with the
//! allocation program on the first instruction (`nop`, which the kernel
//! emulates), on the second (`ret`, which it single-steps), with a
//! uretprobe added and with a free's program on the `nop` instead; and a
//! probe on `endbr64`, which CET builds (Ubuntu's, Fedora's glibc) start
//! every function with. The function is called with
//! a size of 0, so the countdown never samples: each hit costs what an
//! unsampled call costs. A free's program is timed with a new pointer each
//! call, none of them sampled: like a real free, each hit reads its
//! pointer's slot in the counts of sampled pointers (and looks it up in
//! the sampled set where the slot counts any), a slot the previous hit did
//! not warm (a null pointer returns before either).
use std::{
    io::{BufRead, BufReader, Write},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::Duration,
};

use profiler_common::programs;

use crate::{kernel::KernelProbes, run::cost::CostModel};

/// Set in the copy's environment: it serves timings instead of profiling.
const TARGET_ENV: &str = "MEMPROBE_CALIBRATION_TARGET";

// `endbr64` (at +0, for CET builds' first instruction), `nop` (+4,
// emulated: where the probe goes), `ret` (+5, single-stepped).
core::arch::global_asm!(
    ".pushsection .text.memprobe_calibration_target,\"ax\",@progbits",
    ".globl memprobe_calibration_target",
    ".type memprobe_calibration_target,@function",
    "memprobe_calibration_target:",
    "endbr64",
    "nop",
    "ret",
    ".size memprobe_calibration_target, .-memprobe_calibration_target",
    ".popsection",
);

/// Offsets in the target function.
const ENDBR64: u64 = 0;
const NOP: u64 = 4;
const RET: u64 = 5;

unsafe extern "C" {
    fn memprobe_calibration_target(size: u64);
}

/// Calls timed per request, by what each one costs.
const FAST_CALLS: u64 = 20_000;
const SLOW_CALLS: u64 = 2_000;
const BASELINE_CALLS: u64 = 1_000_000;
/// Each timing is the least of this many rounds.
const ROUNDS: usize = 3;
/// The first pointer a free's timing passes, then one every `stride` bytes:
/// where a heap could be, never sampled (samples are keyed by process).
const POINTER_BASE: u64 = 0x7f00_0000_0000;
/// Bytes between the pointers a free's timing passes: a small size class.
const FREE_STRIDE: u64 = 48;

/// A request line: `CALLS` (argument 0) or `CALLS STRIDE` (pointers
/// [`POINTER_BASE`] + i * STRIDE).
fn parse_request(line: &str) -> Option<(u64, u64)> {
    let mut words = line.split_whitespace();
    let calls = words.next()?.parse().ok()?;
    let stride = match words.next() {
        Some(word) => word.parse().ok()?,
        None => 0,
    };
    Some((calls, stride))
}

/// In memprobe's calibration copy: answers each line `N` on stdin with the
/// nanoseconds per call of N calls, until the end of input; then exits.
/// Does nothing in any other process.
pub fn serve_as_target() {
    if std::env::var_os(TARGET_ENV).is_none() {
        return;
    }
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "ready");
    let _ = out.flush();
    for line in std::io::stdin().lock().lines() {
        let Some((calls, stride)) = parse_request(&line.unwrap_or_default()) else {
            break;
        };
        // In a thread other than the main one: a kernel whose uprobe_multi
        // links filter by thread, not process (6.6 to 6.9), runs no program
        // there, and memprobe sees no hit and falls back.
        let timing = std::thread::spawn(move || {
            let started = std::time::Instant::now();
            for call in 0..calls {
                let argument = if stride == 0 {
                    0
                } else {
                    POINTER_BASE + call * stride
                };
                // SAFETY: the function touches no memory and returns at once.
                unsafe { memprobe_calibration_target(std::hint::black_box(argument)) };
            }
            started.elapsed()
        });
        let Ok(elapsed) = timing.join() else { break };
        let per_call = elapsed.as_nanos() as f64 / calls.max(1) as f64;
        let _ = writeln!(out, "{per_call}");
        let _ = out.flush();
    }
    std::process::exit(0);
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

    /// Least nanoseconds per call over [`ROUNDS`] runs of `calls` calls,
    /// with pointers `stride` bytes apart (0: a null argument).
    fn time(&mut self, calls: u64, stride: u64) -> Result<f64, String> {
        let mut best = f64::INFINITY;
        for _ in 0..ROUNDS {
            let stdin = self.child.stdin.as_mut().ok_or("no stdin")?;
            writeln!(stdin, "{calls} {stride}").map_err(|e| e.to_string())?;
            let line = self.read_line()?;
            best = best.min(
                line.trim()
                    .parse()
                    .map_err(|_| format!("bad timing {line:?}"))?,
            );
        }
        Ok(best)
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        drop(self.child.stdin.take());
        let _ = self.child.wait();
    }
}

/// Where the target function is in memprobe's executable: its path and
/// the file offset of its first instruction.
fn target_location() -> Result<(PathBuf, u64), String> {
    let address = memprobe_calibration_target as *const () as u64;
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

/// Measures the per-hit costs of this host's probes with `probes`' own
/// programs; nothing stays attached.
pub fn measure(probes: &mut KernelProbes) -> Result<CostModel, String> {
    let (executable, offset) = target_location()?;
    let mut target = Target::start(&executable)?;
    let pid = target.child.id();
    // First: how probes are linked decides what they cost.
    probes.check_links(&executable, offset + NOP, pid);
    let baseline = target.time(BASELINE_CALLS, 0)?;
    let pointers_baseline = target.time(BASELINE_CALLS, FREE_STRIDE)?;
    let mut timed = |probes: &mut KernelProbes, programs: &[(&'static str, u64)], calls, stride| {
        let handle = probes.attach_for_calibration(programs, &executable, offset, pid)?;
        let time = target.time(calls, stride);
        probes.detach_calibration(handle);
        time
    };
    let entry = programs::ALLOC_SIZE_ARG0;
    let mut emulated = timed(probes, &[(entry, NOP)], FAST_CALLS, 0)?;
    if probes.calibration_hits() == 0 {
        probes.give_up_entry_links();
        emulated = timed(probes, &[(entry, NOP)], FAST_CALLS, 0)?;
    }
    let single_stepped = timed(probes, &[(entry, RET)], SLOW_CALLS, 0)?;
    let returns = [(entry, NOP), (programs::CALL_RETURN, NOP)];
    let with_return = timed(probes, &returns, FAST_CALLS, 0)?;
    let endbr64 = timed(probes, &[(entry, ENDBR64)], SLOW_CALLS, 0)?;
    let free_program = [(programs::FREE_ARG0, NOP)];
    let free = timed(probes, &free_program, FAST_CALLS, FREE_STRIDE)?;
    let nanos = |ns: f64| Duration::from_nanos(ns.max(1.0) as u64);
    Ok(CostModel {
        emulated: nanos(emulated - baseline),
        free: nanos(free - pointers_baseline),
        single_stepped: nanos(single_stepped - baseline),
        return_half: nanos(with_return - emulated),
        endbr64: nanos(endbr64 - baseline),
        measured: true,
    })
}
