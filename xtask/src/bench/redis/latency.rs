//! redis-server's request latency at a fixed rate, as a user of a server
//! at a third of its capacity waits: the one-trap floor against nothing,
//! then memprobe against the floor on its twin in the same rounds, timed
//! from memprobe's attach on. A window (every call trapped for up to a
//! tenth of a second) slows the requests it catches; an open-loop client
//! (see [`open_loop`](super::open_loop)) shows by how much, and how often.
//! A run's p99 hangs on how many windows it caught (a few percent of its
//! requests are in one), so the windows are traced (see
//! [`window_trace`](super::window_trace)): every run's requests are also
//! pooled, those a window caught apart from the rest.
use std::{path::Path, time::Duration};

use anyhow::{Result, bail};

use super::{
    LOADS,
    open_loop::{Latencies, Schedule, Served, Stalls, fixed_rate},
    table::geometric_mean_ratio,
    twins::{Server, Twins, crossover},
    window_trace::{EDGE_NS, Part, Window, WindowTrace, part_of_window},
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
    /// memprobe with these flags, against the floor; whether it samples
    /// in windows.
    Memprobe {
        flags: &'static [&'static str],
        windowed: bool,
    },
}

const SETUPS: [(&str, Setup); 3] = [
    ("one-trap floor, against nothing on its twin", Setup::Floor),
    (
        "memprobe at defaults (malloc in windows), against the one-trap floor on its twin",
        Setup::Memprobe {
            flags: &[],
            windowed: true,
        },
    ),
    (
        "memprobe `--sampling entry` (every call trapped), against the one-trap floor on its twin",
        Setup::Memprobe {
            flags: &["--sampling", "entry"],
            windowed: false,
        },
    ),
];

/// The latency figures of a setup, the twins in both roles.
pub(in crate::bench) struct LatencyResult {
    rows: Vec<Row>,
}

/// A setup's rounds in both halves, and memprobe's windows on the
/// measured twin in each (none for the floor).
struct Row {
    label: &'static str,
    halves: [Vec<Round>; 2],
    windows: [Vec<Window>; 2],
}

/// Runs with, without, without, with.
#[derive(Default)]
struct Round {
    with: [Figures; 2],
    without: [Figures; 2],
}

/// One run of the open-loop client.
#[derive(Default)]
struct Figures {
    /// Latency quantiles in milliseconds: p50, p99, p99.9, the largest.
    quantiles_ms: [f64; 4],
    /// redis-server's CPU seconds over the run.
    cpu: f64,
    /// Each request, when it was due and its latency.
    served: Served,
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
        let mut windows = [Vec::new(), Vec::new()];
        let mut half = 0;
        let halves = crossover(running.servers, |pair, rounds| {
            let seen = attached_half(memprobe, profiles_dir, &places[1], setup, pair, rounds)?;
            windows[half] = seen;
            half += 1;
            Ok(())
        })?;
        let row = Row {
            label,
            halves,
            windows,
        };
        eprintln!(
            "bench:   {label}: p99 {}",
            ratio(&row.halves, |f| f.quantiles_ms[1])
        );
        rows.push(row);
    }
    Ok(LatencyResult { rows })
}

/// `setup` attached to `measured` (and the floor to `other` where it is
/// the baseline), then the rounds: memprobe's windows on `measured` over
/// them.
fn attached_half(
    memprobe: &Path,
    profiles_dir: &str,
    free_place: &Place,
    setup: Setup,
    [measured, other]: [Server; 2],
    rounds: &mut Vec<Round>,
) -> Result<Vec<Window>> {
    let floor = OneTrap::attach(
        match setup {
            Setup::Floor => measured.pid,
            Setup::Memprobe { .. } => other.pid,
        },
        free_place,
    )?;
    let memprobe = match setup {
        Setup::Floor => None,
        Setup::Memprobe { flags, .. } => {
            let pid = measured.pid.to_string();
            let mut args = vec!["--pid", &pid, "-o", profiles_dir];
            args.extend_from_slice(flags);
            Some(start_memprobe(memprobe, &args)?.0)
        }
    };
    let traced = memprobe
        .as_ref()
        .map(|m| WindowTrace::start(m.id(), measured.pid))
        .transpose();
    let measuring = traced.and_then(|trace| {
        measure_rounds([measured, other], rounds)?;
        trace.map(WindowTrace::finish).transpose()
    });
    if let Some(mut memprobe) = memprobe {
        stop(&mut memprobe);
    }
    let windows = measuring?.unwrap_or_default();
    if floor.hits()? == 0 {
        bail!("the one-trap floor counted no hit in redis-server");
    }
    if matches!(setup, Setup::Memprobe { windowed: true, .. }) && windows.is_empty() {
        bail!("no window of memprobe's was seen in redis-server");
    }
    Ok(windows)
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
    let served = fixed_rate(
        server.port,
        Schedule {
            rate: RATE,
            length: RUN,
            connections: CONNECTIONS,
            value_bytes: server.load.value_bytes as usize,
            seed,
        },
    )?;
    let latencies = served.latencies(|_| true);
    Ok(Figures {
        quantiles_ms: QUANTILES.map(|q| latencies.quantile_ms(q)),
        cpu: cpu() - before,
        served,
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

/// docs/overhead.md's latency table, and below it the requests memprobe's
/// windows caught against the rest.
pub(in crate::bench) fn latency_table(result: &LatencyResult) -> String {
    let mut table = format!(
        "\n| redis-server 7 (libjemalloc), SET/GET of 3-byte values at {:.0}k requests/s (Poisson arrivals over {CONNECTIONS} connections, each latency counted from when its request was due), runs of {} s, {} rounds of 4 runs a half, timed from the attach on (memprobe's from when bpftrace follows its windows, a second or two later); twin servers in turn | redis-server's share of a CPU, with (without) | CPU vs without | p50 ms, with (without): ratio | p99 | p99.9 | largest ms, with (without) | p99 ms of every run's requests pooled, with (without) |\n|---|---|---|---|---|---|---|---|\n",
        RATE / 1000.0,
        RUN.as_secs(),
        ROUNDS,
    );
    for row in &result.rows {
        let halves = &row.halves;
        let both = |figure: &dyn Fn(&Figures) -> f64| {
            (
                mean(halves, |r| &r.with, figure),
                mean(halves, |r| &r.without, figure),
            )
        };
        let quantile = |which: usize| {
            let at = |f: &Figures| f.quantiles_ms[which];
            let (with, without) = both(&at);
            format!("{with:.3} ({without:.3}): {}", ratio(halves, at))
        };
        let share = both(&|f: &Figures| 100.0 * f.cpu / RUN.as_secs_f64());
        let largest = both(&|f: &Figures| f.quantiles_ms[3]);
        let pooled =
            |side: fn(&Round) -> &[Figures; 2]| pool(halves, side, |_, _| true).quantile_ms(0.99);
        let (with, without) = (pooled(|r| &r.with), pooled(|r| &r.without));
        table.push_str(&format!(
            "| {} | {:.0}% ({:.0}%) | {} | {} | {} | {} | {:.1} ({:.1}) | {with:.3} ({without:.3}): {:.2}x |\n",
            row.label,
            share.0,
            share.1,
            ratio(halves, |f| f.cpu),
            quantile(0),
            quantile(1),
            quantile(2),
            largest.0,
            largest.1,
            with / without.max(1e-9),
        ));
    }
    table.push_str(&windows_table(result));
    table
}

/// The requests due while one of memprobe's windows was open on the
/// measured twin, against the rest and the floor twin's, every run of a
/// side pooled; those caught as its links were made, in its middle and as
/// they were closed apart.
fn windows_table(result: &LatencyResult) -> String {
    let mut table = format!(
        "\n| memprobe's windows on the measured twin (traced: its `uprobe_multi` links made and closed), every run pooled | windows, mean length | requests due in one (or within {edge} ms of its close) | their p50 ms | their p99 ms | p99 ms: due in its first {edge} ms | in its middle | from {half} ms before its close | p99 ms of the others | the others' p99 over the floor twin's | stalls per 10k requests (in all), due from {half} ms before a close | the others' | the floor twin's |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
        edge = EDGE_NS / 1_000_000,
        half = EDGE_NS / 2_000_000,
    );
    for row in result.rows.iter().filter(|r| !r.windows[0].is_empty()) {
        let halves = &row.halves;
        let measured = |keep: &dyn Fn(Part) -> bool| {
            pool(
                halves,
                |r| &r.with,
                |half, ns| keep(part_of_window(&row.windows[half], ns)),
            )
        };
        let inside = measured(&|part| part != Part::Outside);
        let outside = measured(&|part| part == Part::Outside);
        let p99_in = |wanted: Part| measured(&|part| part == wanted).quantile_ms(0.99);
        let floor = pool(halves, |r| &r.without, |_, _| true);
        let count = row.windows.iter().map(Vec::len).sum::<usize>();
        let open_ns: u64 = row.windows.iter().flatten().map(|(o, c)| c - o).sum();
        let share = inside.len() as f64 / (inside.len() + outside.len()).max(1) as f64;
        let others = outside.quantile_ms(0.99);
        let stalls = |side: fn(&Round) -> &[Figures; 2], keep: &dyn Fn(Part) -> bool| {
            stalls(halves, side, |half, ns| {
                keep(part_of_window(&row.windows[half], ns))
            })
        };
        let closing_stalls = stalls(|r| &r.with, &|part| part == Part::Closing);
        let other_stalls = stalls(|r| &r.with, &|part| part != Part::Closing);
        let floor_stalls = stalls(|r| &r.without, &|_| true);
        table.push_str(&format!(
            "| {} | {count}, {:.0} ms | {:.1}% | {:.3} | {:.3} | {:.3} | {:.3} | {:.3} | {others:.3} | {:.2}x | {closing_stalls} | {other_stalls} | {floor_stalls} |\n",
            row.label,
            open_ns as f64 / count.max(1) as f64 / 1e6,
            100.0 * share,
            inside.quantile_ms(0.5),
            inside.quantile_ms(0.99),
            p99_in(Part::Opening),
            p99_in(Part::Middle),
            p99_in(Part::Closing),
            others / floor.quantile_ms(0.99).max(1e-9),
        ));
    }
    table
}

/// The latencies of every run on one `side`, of requests `keep` keeps
/// (given the half and when the request was due).
fn pool(
    halves: &[Vec<Round>; 2],
    side: fn(&Round) -> &[Figures; 2],
    keep: impl Fn(usize, u64) -> bool,
) -> Latencies {
    let mut pooled = Vec::new();
    for (half, figures) in runs(halves, side) {
        pooled.extend(figures.served.kept(|ns| keep(half, ns)));
    }
    Latencies::of(pooled)
}

/// The stalls among the requests of every run on one `side` that `keep`
/// keeps (given the half and when the request was due).
fn stalls(
    halves: &[Vec<Round>; 2],
    side: fn(&Round) -> &[Figures; 2],
    keep: impl Fn(usize, u64) -> bool,
) -> Stalls {
    let mut pooled = Stalls::default();
    for (half, figures) in runs(halves, side) {
        pooled += figures.served.stalls(|ns| keep(half, ns));
    }
    pooled
}

/// Every run on one `side`, with the half it was in.
fn runs(
    halves: &[Vec<Round>; 2],
    side: fn(&Round) -> &[Figures; 2],
) -> impl Iterator<Item = (usize, &Figures)> {
    halves
        .iter()
        .enumerate()
        .flat_map(move |(half, rounds)| rounds.iter().flat_map(side).map(move |f| (half, f)))
}

/// The mean of `figure` over every run on one `side` (with or without).
fn mean(
    halves: &[Vec<Round>; 2],
    side: fn(&Round) -> &[Figures; 2],
    figure: &dyn Fn(&Figures) -> f64,
) -> f64 {
    let values: Vec<f64> = runs(halves, side).map(|(_, f)| figure(f)).collect();
    values.iter().sum::<f64>() / values.len().max(1) as f64
}
