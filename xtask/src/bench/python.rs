//! What a sampled allocation costs a Python process (whose samples carry
//! their Python frames: the kernel walks them) against a C one: each a
//! loop of malloc and free on glibc, with no profiler and with every call
//! sampled, in rounds; the added nanoseconds per allocation compared.
use std::{
    path::Path,
    process::{Command, Stdio},
};

use anyhow::Result;

use super::{build_loop, median, printed_ns, start_memprobe, stop};
use crate::workspace_root;

const PYTHON: &str = "/usr/bin/python3.11";
const ROUNDS: usize = 3;
/// Untimed first: memprobe attaches in it.
const WARMUP_S: &str = "4";
const TIMED_S: &str = "10";

/// Nanoseconds per allocation of each loop, per round: (no profiler,
/// every call sampled).
pub(super) struct PythonCosts {
    c: Vec<(f64, f64)>,
    python: Vec<(f64, f64)>,
}

pub(super) fn python_costs(memprobe: &Path, out: &Path, profiles_dir: &str) -> Result<PythonCosts> {
    eprintln!("bench: a sampled allocation in Python against one in C");
    let c_loop = build_loop(out, "malloc_loop_glibc", &[])?;
    let script = workspace_root().join("tests/fixtures/python/alloc_loop.py");
    let c = || {
        let mut command = Command::new(&c_loop);
        command.args(["0", TIMED_S]);
        command
    };
    let python = || {
        let mut command = Command::new(PYTHON);
        command.arg(&script).arg(TIMED_S);
        command
    };
    let mut costs = PythonCosts {
        c: Vec::new(),
        python: Vec::new(),
    };
    for _ in 0..ROUNDS {
        costs.c.push(side_by_side(memprobe, profiles_dir, c)?);
        costs
            .python
            .push(side_by_side(memprobe, profiles_dir, python)?);
    }
    Ok(costs)
}

/// A loop's nanoseconds per allocation alone, then with memprobe attached
/// in its untimed start, sampling every call.
fn side_by_side(
    memprobe: &Path,
    profiles_dir: &str,
    make: impl Fn() -> Command,
) -> Result<(f64, f64)> {
    let alone = make()
        .env("FIXTURE_WARMUP_S", WARMUP_S)
        .stderr(Stdio::null())
        .output()?;
    let child = make()
        .env("FIXTURE_WARMUP_S", WARMUP_S)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()?;
    let pid = child.id().to_string();
    let args = [
        "--pid",
        &pid,
        "--sampling",
        "entry",
        "--sample-interval",
        "16",
        "--format",
        "heap",
        "-o",
        profiles_dir,
    ];
    let (mut profiler, _) = start_memprobe(memprobe, &args)?;
    let attached = child.wait_with_output()?;
    stop(&mut profiler);
    Ok((printed_ns(&alone.stdout)?, printed_ns(&attached.stdout)?))
}

pub(super) fn python_table(costs: &PythonCosts) -> String {
    let row = |name: &str, rounds: &[(f64, f64)]| {
        let median_of =
            |value: fn(&(f64, f64)) -> f64| median(&rounds.iter().map(value).collect::<Vec<_>>());
        let alone = median_of(|r| r.0);
        let attached = median_of(|r| r.1);
        let added = median_of(|r| r.1 - r.0);
        (
            format!("| {name} | {alone:.0} | {attached:.0} | {added:.0} |"),
            added,
        )
    };
    let (c, c_added) = row("C (malloc_loop, glibc)", &costs.c);
    let (python, python_added) = row("Python 3.11 (bytearray loop, 3 frames)", &costs.python);
    format!(
        "\n| every call sampled, glibc, medians of {ROUNDS} rounds | ns per allocation, no profiler | attached | added per sampled allocation |\n\
         |---|---|---|---|\n{c}\n{python}\n\n\
         A sampled allocation costs a Python process {:.2}x what it costs a C one (its Python frames walked in the kernel).\n",
        python_added / c_added
    )
}
