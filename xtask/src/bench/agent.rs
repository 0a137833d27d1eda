//! The host agent's cost (`--all --allocator jemalloc --track
//! allocations --windows 0.3%`, as deploy/ ships it; and with the windows'
//! default cost, 1%): two busy jemalloc processes at once,
//! each a malloc/free loop (the dearest load for it: every operation is an
//! allocator call), timed once the agent has found them and its windows
//! have narrowed, in rounds that take turns with no profiler.
//!
//! Timed two ways: the loops' wall time per pair, and the CPU a pair costs
//! the host (the loops' own CPU time, their probes' traps in it, and the
//! agent's CPU over the same span, shared out over their pairs): what a
//! fleet pays. Wall time on this two-CPU VM moved a round by 6% to 22%
//! either way, too much to tell 1.01x from 1.03x.
use std::{
    path::Path,
    process::{Command, Stdio},
};

use anyhow::{Context, Result};

use super::{build_loop, median, printed_ns, start_memprobe, stop, usage};

/// Each round's timing of the loops, with no profiler and beside the agent
/// at each windows' cost.
pub(super) struct AgentCosts {
    none: Vec<LoopsTiming>,
    agent: [Vec<LoopsTiming>; 2],
}

/// One round of the loops run at once.
#[derive(Clone, Copy, Default)]
struct LoopsTiming {
    /// Nanoseconds per pair, the mean over the loops.
    wall_ns: f64,
    /// CPU nanoseconds per pair: the loops' own, and with the agent's over
    /// the timed span shared out over their pairs.
    cpu_ns: f64,
    host_ns: f64,
    /// The agent's CPU seconds over the timed span.
    agent_cpu: f64,
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
    };
    for _ in 0..ROUNDS {
        costs.none.push(time_loops(&malloc_loop, None)?);
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
            let timed = time_loops(&malloc_loop, Some(agent.id()));
            stop(&mut agent);
            costs.agent[k].push(timed?);
        }
    }
    Ok(costs)
}

/// Runs the loops at once, beside `agent` if one runs (its CPU read as
/// their timed span begins and ends).
fn time_loops(malloc_loop: &Path, agent: Option<u32>) -> Result<LoopsTiming> {
    let children: Vec<_> = (0..LOOPS)
        .map(|_| {
            Command::new(malloc_loop)
                .args(["0", TIMED_S])
                .env("FIXTURE_WARMUP_S", WARMUP_S)
                .env("FIXTURE_CPU_NS", "1")
                .stdout(Stdio::piped())
                .stderr(Stdio::null())
                .spawn()
        })
        .collect::<Result<_, _>>()?;
    let agent_cpu = || agent.and_then(usage).map_or(0.0, |(cpu, _)| cpu);
    std::thread::sleep(std::time::Duration::from_secs(WARMUP_S.parse()?));
    let agent_before = agent_cpu();
    let (mut wall, mut cpu, mut pairs) = (0.0, 0.0, 0.0);
    for child in children {
        let stdout = child.wait_with_output()?.stdout;
        let made = printed_value(&stdout, "pairs ")?;
        wall += printed_ns(&stdout)?;
        cpu += printed_value(&stdout, "cpu ")? * made;
        pairs += made;
    }
    let agent_cpu = (agent_cpu() - agent_before).max(0.0);
    Ok(LoopsTiming {
        wall_ns: wall / LOOPS as f64,
        cpu_ns: cpu / pairs,
        host_ns: (cpu + agent_cpu * 1e9) / pairs,
        agent_cpu,
    })
}

/// The number after `prefix` on a line of the loop's output.
fn printed_value(stdout: &[u8], prefix: &str) -> Result<f64> {
    let text = String::from_utf8_lossy(stdout);
    text.lines()
        .find_map(|l| l.strip_prefix(prefix)?.trim().parse().ok())
        .with_context(|| format!("no {prefix:?} in {text:?}"))
}

pub(super) fn agent_table(costs: &AgentCosts) -> String {
    let of = |rounds: &[LoopsTiming], value: fn(&LoopsTiming) -> f64| {
        let values: Vec<f64> = rounds.iter().map(value).collect();
        let each: Vec<String> = values.iter().map(|v| format!("{v:.1}")).collect();
        (median(&values), each.join(", "))
    };
    let (none_wall, none_walls) = of(&costs.none, |t| t.wall_ns);
    let (none_cpu, none_cpus) = of(&costs.none, |t| t.cpu_ns);
    let rows: String = WINDOWS
        .iter()
        .zip(&costs.agent)
        .map(|(windows, rounds)| {
            let (wall, walls) = of(rounds, |t| t.wall_ns);
            let (host, hosts) = of(rounds, |t| t.host_ns);
            let (agent_cpu, _) = of(rounds, |t| t.agent_cpu);
            format!(
                "| the agent, `--windows {windows}` | {wall:.1} ({walls}) | {:.3}x | \
                 {host:.1} ({hosts}) | {:.3}x | {agent_cpu:.2} s |\n",
                wall / none_wall,
                host / none_cpu
            )
        })
        .collect();
    format!(
        "\nThe host agent (`--all --allocator jemalloc --track allocations`, with the windows \
         deploy/ ships, 0.3%, and the default, 1%): {LOOPS} \
         malloc/free loops at once, timed for {TIMED_S} s after {WARMUP_S} s, {ROUNDS} rounds \
         taking turns. CPU per pair: the loops' own CPU time (their traps in it) and the \
         agent's over the timed span, over the pairs they made.\n\n\
         | setup | wall ns per pair, median (each round) | vs no profiler | CPU ns per pair, \
         loops and agent | vs no profiler | agent's CPU over {TIMED_S} s |\n\
         |---|---|---|---|---|---|\n\
         | no profiler | {none_wall:.1} ({none_walls}) | 1.00x | {none_cpu:.1} ({none_cpus}) | \
         1.00x | |\n\
         {rows}",
    )
}
