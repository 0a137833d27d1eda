//! A malloc/free loop that is already running when probes attach to it
//! (`--pid`): the two-trap and one-trap floors, memprobe at entry, and
//! memprobe at defaults (malloc in windows) once they have narrowed.
use std::{
    io::{BufRead, BufReader},
    path::Path,
    process::{Command, Stdio},
    time::Instant,
};

use anyhow::{Context, Result, bail};

use super::{
    ATTACH_DELAY_MS, LIBJEMALLOC,
    floor::{CountsHits, Floor, Place, memprobe_places},
    one_trap::OneTrap,
    printed_ns, said, start_memprobe, stop,
};

/// Nanoseconds per pair, attached to the running loop.
pub(super) struct AttachedLoops {
    /// Where memprobe probes jemalloc's malloc and free.
    pub(super) places: [Place; 2],
    floor: f64,
    one_trap: f64,
    entry: f64,
    /// At entry, with an idle process of the same binary profiled too.
    entry_shared: f64,
    windows: f64,
}

/// Seconds the loop allocates untimed while memprobe's windows narrow to
/// what its calls cost (judged after a second).
pub(super) const WINDOWS_WARMUP: &str = "3";

pub(super) fn attached_loops(
    memprobe: &Path,
    malloc_loop: &Path,
    profiles_dir: &str,
) -> Result<AttachedLoops> {
    eprintln!("bench: loops attached with --pid: two-trap and one-trap floors, entry, defaults");
    let places = memprobe_places(memprobe, malloc_loop, LIBJEMALLOC)?;
    // A 3-s timed loop.
    let timed_loop = || {
        let mut command = Command::new(malloc_loop);
        command.args(["0", "3"]);
        command
    };
    let floor = floor_ns(timed_loop, "two-trap floor", |pid| {
        Floor::attach(pid, &places)
    })?;
    let one_trap = floor_ns(timed_loop, "one-trap floor", |pid| {
        OneTrap::attach(pid, &places[1])
    })?;
    let attached = Attached::new(memprobe, profiles_dir, &["--sampling", "entry"]);
    let entry = attached.ns(timed_loop)?;
    let entry_shared = with_idle_twin(malloc_loop, |twin| {
        Attached {
            flags: &["--sampling", "entry", "--pid", twin],
            ..attached
        }
        .ns(timed_loop)
    })?;
    let windows = Attached {
        flags: &[],
        warmup: Some(WINDOWS_WARMUP),
        ..attached
    }
    .ns(timed_loop)?;
    Ok(AttachedLoops {
        places,
        floor,
        one_trap,
        entry,
        entry_shared,
        windows,
    })
}

/// `measure` run while an idle process of `binary` (its pid passed) lives.
fn with_idle_twin(binary: &Path, measure: impl FnOnce(&str) -> Result<f64>) -> Result<f64> {
    let mut twin = Command::new(binary)
        .arg("1")
        .env("FIXTURE_DELAY_MS", "3600000")
        .stdout(Stdio::null())
        .spawn()?;
    let measured = measure(&twin.id().to_string());
    let _ = twin.kill();
    let _ = twin.wait();
    measured
}

/// The timed loop's nanoseconds per pair, best of three, with a floor's
/// probes (`attach`ed to its pid) on it.
pub(super) fn floor_ns<P: CountsHits>(
    timed_loop: impl Fn() -> Command,
    floor: &str,
    attach: impl Fn(u32) -> Result<P>,
) -> Result<f64> {
    best_of_three(|| {
        let child = start_timed(timed_loop(), None)?;
        let probes = attach(child.id())?;
        let ns = wait_ns(child)?.0;
        if probes.hits()? == 0 {
            bail!("the {floor}'s probes counted no hit");
        }
        Ok(ns)
    })
}

/// memprobe attached with `--pid` (and `flags`) to a timed loop that
/// allocates `warmup` seconds untimed first.
#[derive(Clone, Copy)]
pub(super) struct Attached<'a> {
    pub(super) memprobe: &'a Path,
    pub(super) profiles_dir: &'a str,
    pub(super) flags: &'a [&'a str],
    pub(super) warmup: Option<&'a str>,
    /// What memprobe must have said before the loop's timing began.
    pub(super) said_first: Option<&'a str>,
}

impl<'a> Attached<'a> {
    /// memprobe with `flags`, no warm-up and nothing it must say first.
    pub(super) fn new(memprobe: &'a Path, profiles_dir: &'a str, flags: &'a [&'a str]) -> Self {
        Self {
            memprobe,
            profiles_dir,
            flags,
            warmup: None,
            said_first: None,
        }
    }

    /// The loop's nanoseconds per pair, best of three. A run whose loop
    /// began its timing before memprobe said it attached (a slow start)
    /// timed the loop partly unprobed: it is run again,
    /// not counted (once, such a run made the twin row read as one trap).
    pub(super) fn ns(&self, mut command: impl FnMut() -> Command) -> Result<f64> {
        best_of_three(|| {
            for _ in 0..LATE_STARTS {
                if let Some(ns) = self.run_once(&mut command)? {
                    return Ok(ns);
                }
                eprintln!("bench: memprobe attached after the loop's timing began: run again");
            }
            bail!("memprobe attached after the loop's timing began {LATE_STARTS} times running")
        })
    }

    /// One timed run; `None` where memprobe attached too late for it.
    fn run_once(&self, command: &mut impl FnMut() -> Command) -> Result<Option<f64>> {
        let mut child = start_timed(command(), self.warmup)?;
        // Watched from the start: a line read late would say it came late.
        let timing = watch_timing(&mut child)?;
        let pid = child.id().to_string();
        let mut args = vec!["--pid", &pid, "-o", self.profiles_dir, "--format", "heap"];
        args.extend_from_slice(self.flags);
        let (mut probe, stderr) = start_memprobe(self.memprobe, &args)?;
        let (ns, timing) = finish_timed(child, timing)?;
        stop(&mut probe);
        let before_timing = |text: &str| {
            said(&stderr, text)
                .zip(timing)
                .is_some_and(|(first, timing)| first < timing)
        };
        if !before_timing("memprobe: attached") {
            return Ok(None);
        }
        if let Some(text) = self.said_first
            && !before_timing(text)
        {
            bail!("memprobe did not say '{text}' before the loop's timing began");
        }
        Ok(Some(ns))
    }
}

/// Runs in a row that may start too late before the bench gives up.
const LATE_STARTS: usize = 4;

pub(super) fn best_of_three(mut run: impl FnMut() -> Result<f64>) -> Result<f64> {
    let mut best = f64::INFINITY;
    for _ in 0..3 {
        best = best.min(run()?);
    }
    Ok(best)
}

/// A timed loop (malloc_loop's protocol) that first waits
/// [`ATTACH_DELAY_MS`] (probes attach) and allocates `warmup` seconds
/// untimed.
pub(super) fn start_timed(
    mut command: Command,
    warmup: Option<&str>,
) -> Result<std::process::Child> {
    command.env("FIXTURE_DELAY_MS", ATTACH_DELAY_MS);
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
    let timing = watch_timing(&mut child)?;
    finish_timed(child, timing)
}

/// Reads the loop's stderr from now on for the line that says its timing
/// began: when it came.
fn watch_timing(
    child: &mut std::process::Child,
) -> Result<std::thread::JoinHandle<Option<Instant>>> {
    let stderr = child.stderr.take().context("stderr")?;
    Ok(std::thread::spawn(move || {
        let mut lines = BufReader::new(stderr).lines();
        lines
            .any(|l| l.is_ok_and(|l| l == "timing"))
            .then(Instant::now)
    }))
}

/// Waits for the loop: its nanoseconds per pair, and when its timing
/// began.
fn finish_timed(
    child: std::process::Child,
    timing: std::thread::JoinHandle<Option<Instant>>,
) -> Result<(f64, Option<Instant>)> {
    let output = child.wait_with_output()?;
    let timing = timing.join().ok().flatten();
    Ok((printed_ns(&output.stdout)?, timing))
}

/// docs/overhead.md's table of the attached loop.
pub(super) fn attached_table(none: f64, r: &AttachedLoops) -> String {
    let (floor, one_trap) = (r.floor - none, r.one_trap - none);
    let row = |name: &str, ns: f64| {
        format!(
            "| {name} | {ns:.0} | {:.0} | {:.2}x | {:.2}x |\n",
            ns - none,
            (ns - none) / floor,
            (ns - none) / one_trap
        )
    };
    let mut table = String::from(
        "\n| the same loop, attached with `--pid` while it runs | ns per pair | added ns | vs two-trap floor | vs one-trap floor |\n|---|---|---|---|---|\n",
    );
    table.push_str(&format!("| no profiler | {none:.1} | - | - | - |\n"));
    table.push_str(&row(
        "two-trap floor: counting uprobe perf events, no BPF program, at memprobe's `malloc` and `free` places",
        r.floor,
    ));
    table.push_str(&row(ONE_TRAP, r.one_trap));
    table.push_str(&row(
        "memprobe `--sampling entry` (malloc traps at every call)",
        r.entry,
    ));
    table.push_str(&row(
        "the same, with an idle process of the same binary profiled too (`--pid` twice): each one's uprobe sessions make every malloc of the other trap at its return",
        r.entry_shared,
    ));
    table.push_str(&row(
        "memprobe at defaults, timed once its windows narrowed (malloc traps in windows only, and for requests no thread cache holds, above 32 KiB)",
        r.windows,
    ));
    table
}

/// The one-trap floor's row label, in both tables.
pub(super) const ONE_TRAP: &str = "one-trap floor: a uprobe_multi link at memprobe's `free` place, its program counting hits (nothing else probed)";
