//! redis-server's request latency at a fixed rate, as a user of a server
//! at a third of its capacity waits: the one-trap floor against nothing,
//! then memprobe against the floor on its twin in the same rounds, timed
//! from memprobe's attach on. A window (every call trapped for up to a
//! tenth of a second) slows the requests it catches; an open-loop client
//! (see [`open_loop`](super::open_loop)) shows by how much, and how often.
use std::{path::Path, time::Duration};

use anyhow::{Result, bail};

use super::{
    LOADS,
    open_loop::{Schedule, fixed_rate},
    table::geometric_mean_ratio,
    twins::{Server, Twins, crossover},
};
use crate::bench::{
    floor::CountsHits, floor::Place, one_trap::OneTrap, start_memprobe, stop, usage,
};

/// The client's rate: about a third of what redis-server served unpipelined
/// here, so that a window's slower calls show as latency, not as a queue
/// that never drains.
const RATE: f64 = 15_000.0;

/// One run's length: 120,000 requests, 120 beyond the p99.9.
const RUN: Duration = Duration::from_secs(8);

/// Connections the client deals its requests over.
const CONNECTIONS: usize = 4;

/// Rounds of runs (with, without, without, with) in each half: each half
/// spans memprobe's first minute and a half.
const ROUNDS: usize = 3;

/// What is attached to the measured twin, against what on the other.
#[derive(Clone, Copy)]
enum Setup {
    /// The one-trap floor, against nothing.
    Floor,
    /// memprobe with these flags, against the floor.
    Memprobe(&'static [&'static str]),
}

const SETUPS: [(&str, Setup); 3] = [
    ("one-trap floor, against nothing on its twin", Setup::Floor),
    (
        "memprobe at defaults (malloc in windows), against the one-trap floor on its twin",
        Setup::Memprobe(&[]),
    ),
    (
        "memprobe `--sampling entry` (every call trapped), against the one-trap floor on its twin",
        Setup::Memprobe(&["--sampling", "entry"]),
    ),
];

/// The latency figures of a setup, the twins in both roles.
pub(in crate::bench) struct LatencyResult {
    rows: Vec<(&'static str, [Vec<Round>; 2])>,
}

/// Runs with, without, without, with.
#[derive(Default, Clone, Copy)]
struct Round {
    with: [Figures; 2],
    without: [Figures; 2],
}

/// One run of the open-loop client.
#[derive(Default, Clone, Copy)]
struct Figures {
    /// Latency quantiles in milliseconds: p50, p99, p99.9, the largest.
    quantiles_ms: [f64; 4],
    /// redis-server's CPU seconds over the run.
    cpu: f64,
}

/// The quantiles [`Figures::quantiles_ms`] holds.
const QUANTILES: [f64; 4] = [0.5, 0.99, 0.999, 1.0];

/// Twin redis-servers filled with 3-byte values, then each setup's rounds.
pub(in crate::bench) fn redis_latency(
    memprobe: &Path,
    profiles_dir: &str,
    places: &[Place],
) -> Result<LatencyResult> {
    let running = Twins::start(LOADS[0])?;
    let mut rows = Vec::new();
    for (label, setup) in SETUPS {
        let halves = crossover(running.servers, |pair, rounds| {
            attached_half(memprobe, profiles_dir, &places[1], setup, pair, rounds)
        })?;
        eprintln!(
            "bench:   {label}: p99 {}",
            ratio(&halves, |f| f.quantiles_ms[1])
        );
        rows.push((label, halves));
    }
    Ok(LatencyResult { rows })
}

/// `setup` attached to `measured` (and the floor to `other` where it is
/// the baseline), then the rounds.
fn attached_half(
    memprobe: &Path,
    profiles_dir: &str,
    free_place: &Place,
    setup: Setup,
    [measured, other]: [Server; 2],
    rounds: &mut Vec<Round>,
) -> Result<()> {
    let floor = OneTrap::attach(
        match setup {
            Setup::Floor => measured.pid,
            Setup::Memprobe(_) => other.pid,
        },
        free_place,
    )?;
    let memprobe = match setup {
        Setup::Floor => None,
        Setup::Memprobe(flags) => {
            let pid = measured.pid.to_string();
            let mut args = vec!["--pid", &pid, "-o", profiles_dir];
            args.extend_from_slice(flags);
            Some(start_memprobe(memprobe, &args)?.0)
        }
    };
    let measuring = measure_rounds([measured, other], rounds);
    if let Some(mut memprobe) = memprobe {
        stop(&mut memprobe);
    }
    measuring?;
    if floor.hits()? == 0 {
        bail!("the one-trap floor counted no hit in redis-server");
    }
    Ok(())
}

/// [`ROUNDS`] rounds of the client's runs on the measured twin and the
/// other in turn.
fn measure_rounds([measured, other]: [Server; 2], rounds: &mut Vec<Round>) -> Result<()> {
    for round_index in 0..ROUNDS {
        let mut round = Round::default();
        for (run, server) in [measured, other, other, measured].into_iter().enumerate() {
            let seed = (round_index * 4 + run) as u64;
            let figures = measure_run(server, seed)?;
            match run {
                0 => round.with[0] = figures,
                3 => round.with[1] = figures,
                _ => round.without[run - 1] = figures,
            }
        }
        rounds.push(round);
    }
    Ok(())
}

/// One run of the client at [`RATE`], with redis-server's CPU over it.
fn measure_run(server: Server, seed: u64) -> Result<Figures> {
    let cpu = || usage(server.pid).map_or(0.0, |(cpu, _)| cpu);
    let before = cpu();
    let latencies = fixed_rate(
        server.port,
        Schedule {
            rate: RATE,
            length: RUN,
            connections: CONNECTIONS,
            value_bytes: server.load.value_bytes as usize,
            seed,
        },
    )?;
    Ok(Figures {
        quantiles_ms: QUANTILES.map(|q| latencies.quantile_ms(q)),
        cpu: cpu() - before,
    })
}

/// The geometric mean over rounds of `figure` with over without (each side
/// the mean of its two runs), with a 95% interval.
fn ratio(halves: &[Vec<Round>; 2], figure: impl Fn(&Figures) -> f64) -> String {
    let side = |runs: &[Figures; 2]| (figure(&runs[0]) + figure(&runs[1])) / 2.0;
    let log_ratios = |rounds: &[Round]| -> Vec<f64> {
        rounds
            .iter()
            .map(|r| (side(&r.with) / side(&r.without).max(1e-12)).max(1e-12))
            .map(f64::ln)
            .collect()
    };
    geometric_mean_ratio([&log_ratios(&halves[0]), &log_ratios(&halves[1])])
}

/// docs/overhead.md's latency table.
pub(in crate::bench) fn latency_table(result: &LatencyResult) -> String {
    let mut table = format!(
        "\n| redis-server 7 (libjemalloc), SET/GET of 3-byte values at {:.0}k requests/s (Poisson arrivals over {CONNECTIONS} connections, each latency counted from when its request was due), runs of {} s, {} rounds of 4 runs a half, timed from the attach on; twin servers in turn | redis-server's share of a CPU, with (without) | CPU vs without | p50 ms, with (without): ratio | p99 | p99.9 | largest ms, with (without) |\n|---|---|---|---|---|---|---|\n",
        RATE / 1000.0,
        RUN.as_secs(),
        ROUNDS,
    );
    for (label, halves) in &result.rows {
        let both = |figure: &dyn Fn(&Figures) -> f64| {
            (
                mean(halves, |r| r.with, figure),
                mean(halves, |r| r.without, figure),
            )
        };
        let quantile = |which: usize| {
            let at = |f: &Figures| f.quantiles_ms[which];
            let (with, without) = both(&at);
            format!("{with:.3} ({without:.3}): {}", ratio(halves, at))
        };
        let share = both(&|f: &Figures| 100.0 * f.cpu / RUN.as_secs_f64());
        let largest = both(&|f: &Figures| f.quantiles_ms[3]);
        table.push_str(&format!(
            "| {label} | {:.0}% ({:.0}%) | {} | {} | {} | {} | {:.1} ({:.1}) |\n",
            share.0,
            share.1,
            ratio(halves, |f| f.cpu),
            quantile(0),
            quantile(1),
            quantile(2),
            largest.0,
            largest.1,
        ));
    }
    table
}

/// The mean of `figure` over every run on one `side` (with or without).
fn mean(
    halves: &[Vec<Round>; 2],
    side: fn(&Round) -> [Figures; 2],
    figure: &dyn Fn(&Figures) -> f64,
) -> f64 {
    let values: Vec<f64> = halves
        .iter()
        .flatten()
        .flat_map(|round| side(round).map(|f| figure(&f)))
        .collect();
    values.iter().sum::<f64>() / values.len().max(1) as f64
}
