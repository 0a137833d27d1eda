//! A malloc/free loop that is already running when probes attach to it
//! (`--pid`): the two-trap floor, memprobe at entry, and memprobe on
//! jemalloc's slow path once its trial has kept it.
use std::{
    io::{BufRead, BufReader},
    path::Path,
    process::{Command, Stdio},
    time::Instant,
};

use anyhow::{Context, Result, bail};

use super::{
    LIBJEMALLOC, SLOW_PATH_KEPT,
    floor::{Floor, Place, memprobe_places},
    said, start_memprobe, stop,
};

/// Nanoseconds per pair, attached to the running loop.
pub(super) struct AttachedLoops {
    /// Where memprobe probes jemalloc's malloc and free.
    pub(super) places: [Place; 2],
    floor: f64,
    entry: f64,
    slow: f64,
}

/// Seconds the loop allocates untimed while the slow path's trial (5 s on
/// each side, in alternating slices) decides.
pub(super) const TRIAL_WARMUP: &str = "20";

pub(super) fn attached_loops(
    memprobe: &Path,
    malloc_loop: &Path,
    profiles_dir: &str,
) -> Result<AttachedLoops> {
    eprintln!("bench: loops attached with --pid: two-trap floor, entry, slow path");
    let places = memprobe_places(memprobe, malloc_loop, LIBJEMALLOC)?;
    let floor = best_of_three(|| {
        let child = start_loop(malloc_loop, None)?;
        let counters = Floor::attach(child.id(), &places)?;
        let ns = wait_ns(child)?.0;
        if counters.hits()? == 0 {
            bail!("the two-trap floor's uprobes counted no hit");
        }
        Ok(ns)
    })?;
    let memprobe_ns = |flags: &[&str], warmup: Option<&str>| {
        best_of_three(|| {
            let child = start_loop(malloc_loop, warmup)?;
            let pid = child.id().to_string();
            let mut args = vec!["--pid", &pid, "-o", profiles_dir, "--format", "heap"];
            args.extend_from_slice(flags);
            let (mut probe, stderr) = start_memprobe(memprobe, &args)?;
            let (ns, timing) = wait_ns(child)?;
            stop(&mut probe);
            if warmup.is_some() {
                let kept = said(&stderr, SLOW_PATH_KEPT);
                if kept.zip(timing).is_none_or(|(kept, timing)| kept >= timing) {
                    bail!("the slow path's trial did not keep it before the loop's timing began");
                }
            }
            Ok(ns)
        })
    };
    let entry = memprobe_ns(&["--sampling", "entry"], None)?;
    let slow = memprobe_ns(&[], Some(TRIAL_WARMUP))?;
    Ok(AttachedLoops {
        places,
        floor,
        entry,
        slow,
    })
}

pub(super) fn best_of_three(mut run: impl FnMut() -> Result<f64>) -> Result<f64> {
    let mut best = f64::INFINITY;
    for _ in 0..3 {
        best = best.min(run()?);
    }
    Ok(best)
}

/// A 3-s timed malloc_loop that first waits 1.5 s (probes attach) and
/// allocates `warmup` seconds untimed.
fn start_loop(malloc_loop: &Path, warmup: Option<&str>) -> Result<std::process::Child> {
    let mut command = Command::new(malloc_loop);
    command.args(["0", "3"]);
    start_timed(command, warmup)
}

/// A timed loop (malloc_loop's protocol) that first waits 1.5 s (probes
/// attach) and allocates `warmup` seconds untimed.
pub(super) fn start_timed(
    mut command: Command,
    warmup: Option<&str>,
) -> Result<std::process::Child> {
    command.env("FIXTURE_DELAY_MS", "1500");
    if let Some(seconds) = warmup {
        command.env("FIXTURE_WARMUP_S", seconds);
    }
    Ok(command
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?)
}

/// The loop's nanoseconds per pair, and when it said its timing began.
pub(super) fn wait_ns(mut child: std::process::Child) -> Result<(f64, Option<Instant>)> {
    let stderr = child.stderr.take().context("stderr")?;
    let timing = std::thread::spawn(move || {
        let mut lines = BufReader::new(stderr).lines();
        lines
            .any(|l| l.is_ok_and(|l| l == "timing"))
            .then(Instant::now)
    });
    let output = child.wait_with_output()?;
    let timing = timing.join().ok().flatten();
    let text = String::from_utf8_lossy(&output.stdout);
    let ns = text
        .trim()
        .parse()
        .with_context(|| format!("no timing in {text:?}"))?;
    Ok((ns, timing))
}

/// The README's table of the attached loop.
pub(super) fn attached_table(none: f64, r: &AttachedLoops) -> String {
    let floor = r.floor - none;
    let row = |name: &str, ns: f64| {
        format!(
            "| {name} | {ns:.0} | {:.0} | {:.2}x |\n",
            ns - none,
            (ns - none) / floor
        )
    };
    let mut table = String::from(
        "\n| the same loop, attached with `--pid` while it runs | ns per pair | added ns | vs two-trap floor |\n|---|---|---|---|\n",
    );
    table.push_str(&format!("| no profiler | {none:.1} | - | - |\n"));
    table.push_str(&row(
        "two-trap floor: counting uprobe perf events, no BPF program, at memprobe's `malloc` and `free` places",
        r.floor,
    ));
    table.push_str(&row(
        "memprobe `--sampling entry` (malloc traps at every call)",
        r.entry,
    ));
    table.push_str(&row(
        "memprobe (default: on jemalloc's slow path), timed after its trial kept it (malloc traps on jemalloc's slow path only)",
        r.slow,
    ));
    table
}
