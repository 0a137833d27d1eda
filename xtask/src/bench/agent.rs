//! The host agent's cost (`--all --allocator jemalloc --track
//! allocations --windows 0.3%`, as deploy/ ships it; and with the windows'
//! default cost, 1%): two busy jemalloc processes, each a malloc/free loop
//! (the dearest load for it: every operation is an allocator call).
//!
//! The same two loops run through the whole part, and the agent comes and
//! goes: each span beside it (timed once it has found them and its windows
//! have narrowed) is set against the spans with no profiler just before
//! and after it, in the same processes. Loops started anew for each span
//! differed by 6% from one start to the next with no profiler at all (a
//! process's speed here depends on where its memory lands), so a ratio
//! between separate runs could not tell 1.01x from 1.03x.
//!
//! Each span is timed two ways: the loops' wall time per pair, and the CPU
//! a pair costs the host: the loops' own CPU time (their probes' traps run
//! in their threads) with the agent's CPU over the span shared out over
//! their pairs, what a fleet pays.
use std::{
    io::{BufRead, BufReader},
    path::Path,
    process::{Child, Command, Stdio},
    sync::{Arc, Mutex},
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context, Result};

use super::{build_loop, median, start_memprobe, stop, usage};

/// What deploy/ ships the agent's windows to cost (`--windows`).
pub(super) const SHIPPED_WINDOWS: &str = "0.3%";
/// What the agent's windows may cost: what deploy/ ships, and the default.
const WINDOWS: [&str; 2] = [SHIPPED_WINDOWS, "1%"];

/// Loops running at once: one per CPU of this machine kind.
const LOOPS: usize = 2;
const ROUNDS: usize = 5;
/// With no profiler, between two spans beside the agent.
const BARE: Duration = Duration::from_secs(10);
/// Untimed once the agent attached: its scan finds the loops within a
/// second, and the first window of each (busy before it) closes after
/// 100 ms at every call.
const WARMUP: Duration = Duration::from_secs(6);
/// Timed beside the agent: at their least share of time (0.5%) windows
/// open for 100 ms every 20 s or so, and a span of 20 s held one or
/// none (rounds read 1.004x to 1.020x); this one holds about three.
const TIMED: Duration = Duration::from_secs(60);
/// After the agent stops: its probes' links close.
const SETTLE: Duration = Duration::from_secs(2);
/// How often each loop reports its pairs and the time they took.
const TICK_MS: &str = "250";

/// One span's timing of the loops together.
#[derive(Clone, Copy, Debug, Default)]
struct Span {
    pairs: f64,
    wall_ns: f64,
    cpu_ns: f64,
}

impl Span {
    fn wall_per_pair(&self) -> f64 {
        self.wall_ns / self.pairs.max(1.0)
    }

    fn cpu_per_pair(&self) -> f64 {
        self.cpu_ns / self.pairs.max(1.0)
    }
}

/// One span beside the agent, the spans with no profiler around it, and
/// the agent's CPU seconds over it.
#[derive(Clone, Copy, Debug)]
struct Turn {
    before: Span,
    agent: Span,
    after: Span,
    agent_cpu: f64,
}

impl Turn {
    /// Wall time per pair beside the agent over that with no profiler.
    fn wall_ratio(&self) -> f64 {
        let bare = (self.before.wall_per_pair() + self.after.wall_per_pair()) / 2.0;
        self.agent.wall_per_pair() / bare
    }

    /// The host's CPU per pair beside the agent (the agent's own included)
    /// over the loops' with no profiler.
    fn cpu_ratio(&self) -> f64 {
        let bare = (self.before.cpu_per_pair() + self.after.cpu_per_pair()) / 2.0;
        let host = (self.agent.cpu_ns + self.agent_cpu * 1e9) / self.agent.pairs.max(1.0);
        host / bare
    }
}

/// Each windows' cost's turns, round by round.
pub(super) struct AgentCosts {
    turns: [Vec<Turn>; 2],
}

/// What the loops reported, each tick with when it came.
#[derive(Clone, Default)]
struct Ticks(Arc<Mutex<Vec<(Instant, Span)>>>);

impl Ticks {
    /// Reads `child`'s tick lines as they come.
    fn follow(&self, child: &mut Child) -> Result<()> {
        let stdout = child.stdout.take().context("the loop's stdout")?;
        let ticks = self.0.clone();
        thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(|l| l.ok()) {
                let Some(span) = parse_tick(&line) else {
                    continue;
                };
                if let Ok(mut ticks) = ticks.lock() {
                    ticks.push((Instant::now(), span));
                }
            }
        });
        Ok(())
    }

    /// The ticks that came from `from` to `to`, summed.
    fn between(&self, from: Instant, to: Instant) -> Span {
        let Ok(ticks) = self.0.lock() else {
            return Span::default();
        };
        ticks.iter().filter(|(at, _)| *at > from && *at <= to).fold(
            Span::default(),
            |sum, (_, t)| Span {
                pairs: sum.pairs + t.pairs,
                wall_ns: sum.wall_ns + t.wall_ns,
                cpu_ns: sum.cpu_ns + t.cpu_ns,
            },
        )
    }
}

/// "tick PAIRS WALL_NS CPU_NS".
fn parse_tick(line: &str) -> Option<Span> {
    let mut fields = line.strip_prefix("tick ")?.split_whitespace();
    let mut next = || fields.next()?.parse::<f64>().ok();
    Some(Span {
        pairs: next()?,
        wall_ns: next()?,
        cpu_ns: next()?,
    })
}

/// Waits `span` from now and returns when it ended.
fn wait(span: Duration) -> (Instant, Instant) {
    let from = Instant::now();
    thread::sleep(span);
    (from, Instant::now())
}

/// The agent's CPU seconds over `span` from now, and when it began and
/// ended.
pub(super) fn cpu_over(agent: &Child, span: Duration) -> (f64, (Instant, Instant)) {
    let cpu = || usage(agent.id()).map_or(0.0, |(cpu, _)| cpu);
    let before = cpu();
    let timed = wait(span);
    ((cpu() - before).max(0.0), timed)
}

/// The host agent as deploy/ ships it, its windows at `windows`.
pub(super) fn start_agent(memprobe: &Path, windows: &str, profiles_dir: &str) -> Result<Child> {
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
    Ok(start_memprobe(memprobe, &args)?.0)
}

pub(super) fn agent_costs(memprobe: &Path, out: &Path, profiles_dir: &str) -> Result<AgentCosts> {
    eprintln!("bench: the host agent, {LOOPS} busy jemalloc loops");
    let malloc_loop = build_loop(out, "malloc_loop", &["-ljemalloc"])?;
    let turn_secs = (BARE + WARMUP + TIMED + SETTLE).as_secs() + 3;
    let whole = (turn_secs * (ROUNDS * WINDOWS.len()) as u64 + BARE.as_secs() + 10).to_string();
    let ticks = Ticks::default();
    let mut loops = Vec::with_capacity(LOOPS);
    for _ in 0..LOOPS {
        let mut child = Command::new(&malloc_loop)
            .args(["0", &whole])
            .env("FIXTURE_TICK_MS", TICK_MS)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()?;
        ticks.follow(&mut child)?;
        loops.push(child);
    }
    let costs = take_turns(memprobe, profiles_dir, &ticks);
    for mut child in loops {
        let _ = child.kill();
        let _ = child.wait();
    }
    costs
}

/// Rounds of turns, the agent at each windows' cost beside the loops.
fn take_turns(memprobe: &Path, profiles_dir: &str, ticks: &Ticks) -> Result<AgentCosts> {
    let mut costs = AgentCosts {
        turns: Default::default(),
    };
    let mut before = wait(BARE);
    for _ in 0..ROUNDS {
        for (k, windows) in WINDOWS.into_iter().enumerate() {
            let mut agent = start_agent(memprobe, windows, profiles_dir)?;
            thread::sleep(WARMUP);
            let (agent_cpu, timed) = cpu_over(&agent, TIMED);
            stop(&mut agent);
            thread::sleep(SETTLE);
            let after = wait(BARE);
            costs.turns[k].push(Turn {
                before: ticks.between(before.0, before.1),
                agent: ticks.between(timed.0, timed.1),
                after: ticks.between(after.0, after.1),
                agent_cpu,
            });
            before = after;
        }
    }
    Ok(costs)
}

pub(super) fn agent_table(costs: &AgentCosts) -> String {
    let each = |values: &[f64]| {
        let shown: Vec<String> = values.iter().map(|v| format!("{v:.3}x")).collect();
        format!("{:.3}x ({})", median(values), shown.join(", "))
    };
    let rows: String = WINDOWS
        .iter()
        .zip(&costs.turns)
        .map(|(windows, turns)| {
            let wall: Vec<f64> = turns.iter().map(Turn::wall_ratio).collect();
            let cpu: Vec<f64> = turns.iter().map(Turn::cpu_ratio).collect();
            let own: Vec<f64> = turns.iter().map(|t| t.agent_cpu).collect();
            let bare: Vec<f64> = turns.iter().map(|t| t.before.wall_per_pair()).collect();
            format!(
                "| the agent, `--windows {windows}` | {:.1} | {} | {} | {:.2} s |\n",
                median(&bare),
                each(&wall),
                each(&cpu),
                median(&own),
            )
        })
        .collect();
    format!(
        "\nThe host agent (`--all --allocator jemalloc --track allocations`, with the windows \
         deploy/ ships, 0.3%, and the default, 1%): {LOOPS} malloc/free loops running \
         throughout, the agent beside them for {} s at a time ({} s after its attach \
         untimed), each such span set against the {} s with no profiler before and after it, \
         {ROUNDS} rounds. CPU per pair: the loops' own CPU time (their traps in it) and the \
         agent's over the span, over the pairs they made.\n\n\
         | setup | ns per pair, no profiler | wall time vs no profiler, median (each round) | \
         CPU per pair, loops and agent, vs no profiler | agent's CPU per span |\n\
         |---|---|---|---|---|\n\
         {rows}",
        TIMED.as_secs(),
        WARMUP.as_secs(),
        BARE.as_secs(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tick_line_is_read() {
        let span = parse_tick("tick 13411328 300006946 171050072").unwrap();
        assert_eq!(span.pairs, 13_411_328.0);
        assert!((span.wall_per_pair() - 22.37).abs() < 0.01);
        assert!(parse_tick("20.47").is_none());
    }

    #[test]
    fn a_turn_is_set_against_the_bare_spans_around_it() {
        let span = |pairs: f64, ns: f64| Span {
            pairs,
            wall_ns: pairs * ns,
            cpu_ns: pairs * ns,
        };
        let turn = Turn {
            before: span(1e9, 10.0),
            agent: span(1e9, 10.5),
            after: span(1e9, 11.0),
            agent_cpu: 0.1,
        };
        assert!((turn.wall_ratio() - 1.0).abs() < 1e-9);
        // 0.1 s of the agent's over 1e9 pairs: 0.1 ns a pair more.
        assert!((turn.cpu_ratio() - 10.6 / 10.5).abs() < 1e-9);
    }
}
