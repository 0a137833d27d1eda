//! The host agent's cost (`--all --allocator jemalloc --track
//! allocations --windows 0.3%`, as deploy/ ships it; and with the windows'
//! default cost, 1%): two busy jemalloc processes at once,
//! each a malloc/free loop (the dearest load for it: every operation is an
//! allocator call), timed once the agent has found them and its windows
//! have narrowed, in rounds that take turns with no profiler.
use std::{
    path::Path,
    process::{Command, Stdio},
};

use anyhow::Result;

use super::{build_loop, median, printed_ns, start_memprobe, stop, usage};

/// Nanoseconds per malloc+free pair, each round's mean over the loops;
/// and the agent's own CPU seconds in each round; per windows' cost.
pub(super) struct AgentCosts {
    none: Vec<f64>,
    agent: [Vec<f64>; 2],
    own_cpu: [Vec<f64>; 2],
}

/// What the agent's windows may cost (`--windows`): what deploy/ ships,
/// and the default.
const WINDOWS: [&str; 2] = ["0.3%", "1%"];

/// Loops running at once: one per CPU of this machine kind.
const LOOPS: usize = 2;
const ROUNDS: usize = 5;
/// Untimed first: the agent's scan finds the loops within a second, and
/// their windows narrow after three seconds at every call.
const WARMUP_S: &str = "6";
const TIMED_S: &str = "20";

pub(super) fn agent_costs(memprobe: &Path, out: &Path, profiles_dir: &str) -> Result<AgentCosts> {
    eprintln!("bench: the host agent, {LOOPS} busy jemalloc loops");
    let malloc_loop = build_loop(out, "malloc_loop", &["-ljemalloc"])?;
    let mut costs = AgentCosts {
        none: Vec::new(),
        agent: Default::default(),
        own_cpu: Default::default(),
    };
    for _ in 0..ROUNDS {
        costs.none.push(loops_ns(&malloc_loop)?);
        for (k, windows) in WINDOWS.into_iter().enumerate() {
            let args = [
                "--all",
                "--allocator",
                "jemalloc",
                "--track",
                "allocations",
                "--windows",
                windows,
                "--format",
                "heap",
                "-o",
                profiles_dir,
            ];
            let (mut agent, _) = start_memprobe(memprobe, &args)?;
            let timed = loops_ns(&malloc_loop);
            let own = usage(agent.id()).map_or(0.0, |(cpu, _)| cpu);
            stop(&mut agent);
            costs.agent[k].push(timed?);
            costs.own_cpu[k].push(own);
        }
    }
    Ok(costs)
}

/// The loops' mean nanoseconds per pair, run at once.
fn loops_ns(malloc_loop: &Path) -> Result<f64> {
    let children: Vec<_> = (0..LOOPS)
        .map(|_| {
            Command::new(malloc_loop)
                .args(["0", TIMED_S])
                .env("FIXTURE_WARMUP_S", WARMUP_S)
                .stdout(Stdio::piped())
                .stderr(Stdio::null())
                .spawn()
        })
        .collect::<Result<_, _>>()?;
    let mut total = 0.0;
    for child in children {
        total += printed_ns(&child.wait_with_output()?.stdout)?;
    }
    Ok(total / LOOPS as f64)
}

pub(super) fn agent_table(costs: &AgentCosts) -> String {
    let none = median(&costs.none);
    let rounds = |values: &[f64]| {
        values
            .iter()
            .map(|ns| format!("{ns:.1}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let rows: String = WINDOWS
        .iter()
        .zip(&costs.agent)
        .map(|(windows, ns)| {
            let agent = median(ns);
            format!(
                "| the agent, `--windows {windows}` | {agent:.1} ({}) | {:.3}x |\n",
                rounds(ns),
                agent / none
            )
        })
        .collect();
    let own: Vec<String> = WINDOWS
        .iter()
        .zip(&costs.own_cpu)
        .map(|(windows, cpu)| format!("{} s at {windows}", rounds(cpu)))
        .collect();
    format!(
        "\nThe host agent (`--all --allocator jemalloc --track allocations`, with the windows \
         deploy/ ships, 0.3%, and the default, 1%): {LOOPS} \
         malloc/free loops at once, timed for {TIMED_S} s after {WARMUP_S} s, {ROUNDS} rounds \
         taking turns\n\n| setup | ns per pair, median (each round) | vs no profiler |\n\
         |---|---|---|\n\
         | no profiler | {none:.1} ({}) | 1.00x |\n\
         {rows}\n\
         The agent's own CPU over each round's {} s (the loops' warm-up and timed part): \
         {}: on this two-CPU machine it takes time from the loops too.\n",
        rounds(&costs.none),
        WARMUP_S.parse::<u64>().unwrap_or(0) + TIMED_S.parse::<u64>().unwrap_or(0),
        own.join("; "),
    )
}
