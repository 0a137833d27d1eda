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

use super::{start_memprobe, stop};
use crate::{run_command, workspace_root};

/// CPU nanoseconds per round trip, the median of [`ROUNDS`] runs each.
pub(super) struct Switches {
    none: f64,
    links: f64,
    perf_events: f64,
}

const ROUNDS: usize = 3;

/// The kernel features memprobe is told to do without, for each
/// configuration with it.
const LINKS: &str = "";
const PERF_EVENTS: &str = "uprobe-multi";

pub(super) fn switches(memprobe: &Path, out: &Path, profiles_dir: &str) -> Result<Switches> {
    eprintln!("bench: a pipe ping-pong with unhit probes attached");
    let ping_pong = out.join("ping_pong");
    run_command(
        Command::new("cc")
            .args(["-O2", "-o"])
            .arg(&ping_pong)
            .arg(workspace_root().join("tests/fixtures/ping_pong.c")),
    )?;
    let mut runs: [Vec<f64>; 3] = Default::default();
    for _ in 0..ROUNDS {
        for (k, lacks) in [None, Some(LINKS), Some(PERF_EVENTS)]
            .into_iter()
            .enumerate()
        {
            runs[k].push(round_trip_ns(memprobe, &ping_pong, profiles_dir, lacks)?);
        }
    }
    eprintln!("bench:   ns a round trip (none, links, perf events): {runs:?}");
    let [none, links, perf_events] = runs.map(median);
    Ok(Switches {
        none,
        links,
        perf_events,
    })
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// One timed ping-pong on CPU 0, with memprobe (on CPU 1) attached to it
/// during its untimed start when told what kernel features to do without
/// (`lacks`). Entry sampling: no slow-path trial swaps probes meanwhile.
fn round_trip_ns(
    memprobe: &Path,
    ping_pong: &Path,
    profiles_dir: &str,
    lacks: Option<&str>,
) -> Result<f64> {
    let child = Command::new("taskset")
        .args(["-c", "0"])
        .arg(ping_pong)
        .arg("3")
        .env("FIXTURE_DELAY_MS", "1500")
        .stdout(Stdio::piped())
        .spawn()?;
    let pid = child.id().to_string();
    let memprobe_path = memprobe.to_str().context("memprobe's path")?;
    let probe = match lacks {
        Some(lacks) => {
            let lacks = format!("MEMPROBE_KERNEL_LACKS={lacks}");
            let mut args = vec![lacks.as_str(), "taskset", "-c", "1", memprobe_path];
            args.extend_from_slice(&["--pid", &pid, "--sampling", "entry"]);
            args.extend_from_slice(&["-o", profiles_dir, "--format", "heap"]);
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

/// The README's table.
pub(super) fn switches_table(s: &Switches) -> String {
    let vs = |ns: f64| format!("+{:.1}%", 100.0 * (ns / s.none - 1.0));
    format!(
        "\n| a pipe ping-pong, no allocator call (two context switches a round trip; CPU 0, memprobe on CPU 1; median of {ROUNDS}) | CPU ns a round trip | vs no profiler |\n|---|---|---|\n\
         | no profiler | {:.0} | - |\n\
         | memprobe `--sampling entry`: probes as uprobe_multi links (Linux 6.10+) | {:.0} | {} |\n\
         | the same with perf-event uprobes (as on older kernels; `MEMPROBE_KERNEL_LACKS=uprobe-multi`) | {:.0} | {} |\n",
        s.none,
        s.links,
        vs(s.links),
        s.perf_events,
        vs(s.perf_events),
    )
}
