//! What attached probes cost a process where they are not hit: a pipe
//! ping-pong (two context switches of the profiled process a round trip,
//! no allocator call) without memprobe and with it, its probes linked as
//! uprobe_multi links (the default where the kernel filters them by
//! process, 6.10+) and as perf-event uprobes (as on older kernels, played
//! with `MEMPROBE_KERNEL_LACKS=uprobe-multi`), whose per-task perf events
//! are switched with the task.
use std::{
    path::Path,
    process::{Command, Stdio},
};

use anyhow::{Context, Result, bail};

use super::{ATTACH_DELAY_MS, build_fixture, median, start_memprobe, stop};

/// CPU nanoseconds per round trip of each configuration (no profiler
/// first), the median of [`ROUNDS`] runs each.
pub(super) struct Switches(Vec<f64>);

const ROUNDS: usize = 3;

/// memprobe's configurations: (label, kernel features it is told to do
/// without, flags). Entry sampling: no window attaches probes.
const CONFIGS: [(&str, &str, &[&str]); 3] = [
    (
        "memprobe `--sampling entry`: uprobe sessions and uprobe_multi links (Linux 6.13+)",
        "",
        &[],
    ),
    (
        "the same with `--return-probes uretprobes`: uretprobes, all uprobe_multi links (as on 6.10 to 6.12)",
        "",
        &["--return-probes", "uretprobes"],
    ),
    (
        "the same with `MEMPROBE_KERNEL_LACKS=uprobe-multi`: perf-event uprobes and uretprobes (as on 6.1 to 6.9)",
        "uprobe-multi",
        &["--return-probes", "uretprobes"],
    ),
];

pub(super) fn switches(memprobe: &Path, out: &Path, profiles_dir: &str) -> Result<Switches> {
    eprintln!("bench: a pipe ping-pong with unhit probes attached");
    let ping_pong = build_fixture(out, "ping_pong", "ping_pong", &[])?;
    let mut runs = vec![Vec::new(); CONFIGS.len() + 1];
    for _ in 0..ROUNDS {
        runs[0].push(round_trip_ns(memprobe, &ping_pong, profiles_dir, None)?);
        for (k, (_, lacks, flags)) in CONFIGS.iter().enumerate() {
            let with = Some((*lacks, *flags));
            runs[k + 1].push(round_trip_ns(memprobe, &ping_pong, profiles_dir, with)?);
        }
    }
    eprintln!("bench:   ns a round trip, no profiler first: {runs:?}");
    Ok(Switches(runs.iter().map(|run| median(run)).collect()))
}

/// One timed ping-pong on CPU 0, with memprobe (on CPU 1) attached to it
/// during its untimed start when given what kernel features to do without
/// and its flags.
fn round_trip_ns(
    memprobe: &Path,
    ping_pong: &Path,
    profiles_dir: &str,
    with: Option<(&str, &[&str])>,
) -> Result<f64> {
    let child = Command::new("taskset")
        .args(["-c", "0"])
        .arg(ping_pong)
        .arg("3")
        .env("FIXTURE_DELAY_MS", ATTACH_DELAY_MS)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()?;
    let pid = child.id().to_string();
    let memprobe_path = memprobe.to_str().context("memprobe's path")?;
    let probe = match with {
        Some((lacks, flags)) => {
            let lacks = format!("MEMPROBE_KERNEL_LACKS={lacks}");
            let mut args = vec![lacks.as_str(), "taskset", "-c", "1", memprobe_path];
            args.extend_from_slice(&["--pid", &pid, "--sampling", "entry"]);
            args.extend_from_slice(&["-o", profiles_dir, "--format", "heap"]);
            args.extend_from_slice(flags);
            Some(start_memprobe(Path::new("env"), &args)?.0)
        }
        None => None,
    };
    let output = child.wait_with_output()?;
    if let Some(mut probe) = probe {
        stop(&mut probe);
    }
    let text = String::from_utf8_lossy(&output.stdout);
    match text.trim().parse() {
        Ok(ns) if output.status.success() => Ok(ns),
        _ => bail!("ping_pong printed no timing: {text:?}"),
    }
}

/// docs/overhead.md's table.
pub(super) fn switches_table(Switches(ns): &Switches) -> String {
    let mut table = format!(
        "\n| a pipe ping-pong, no allocator call (two context switches a round trip; CPU 0, memprobe on CPU 1; median of {ROUNDS}) | CPU ns a round trip (both processes) | vs no profiler |\n|---|---|---|\n\
         | no profiler | {:.0} | - |\n",
        ns[0]
    );
    for ((label, _, _), &with) in CONFIGS.iter().zip(&ns[1..]) {
        table.push_str(&format!(
            "| {label} | {with:.0} | {:+.1}% |\n",
            100.0 * (with / ns[0] - 1.0)
        ));
    }
    table
}
