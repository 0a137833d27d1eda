//! redis-server under redis-benchmark, with and without memprobe: the
//! request rate, redis-server's CPU per request, and what memprobe said it
//! added.
//!
//! Two redis-servers, twins filled alike, take turns in a crossover: while
//! one has memprobe (or the floor's counters) attached, the other, with
//! nothing attached, is its baseline, run by run in the order with,
//! without, without, with; then they swap roles. Runs a few seconds apart
//! cancel the VM's drift (redis-server's CPU for the same requests wanders
//! by up to 19% over minutes here), and each twin being once profiled and
//! once baseline cancels any lasting difference between the two (7% was
//! seen): the cost is the geometric mean of the two halves' ratios.
use std::{
    io::{Read, Write},
    net::TcpStream,
    path::Path,
    process::{Child, Command, Stdio},
    time::Duration,
};

use anyhow::{Context, Result, bail};

use super::{
    FELL_BACK, SLOW_PATH_KEPT, Usage,
    attached::ONE_TRAP,
    floor::{CountsHits, Floor, Place},
    line_with,
    one_trap::OneTrap,
    said, start_memprobe, stop, usage,
};

/// Where the profiled twin's memprobe serves /metrics, read for the time it
/// says it added over the measured runs.
const LISTEN: &str = "127.0.0.1:6071";

/// redis-server under redis-benchmark without memprobe, with the two-trap
/// floor and with memprobe in each mode.
pub(super) struct RedisResult {
    load: Load,
    /// Nothing attached: twin A's runs (`with`) and twin B's (`without`),
    /// taken in turn.
    unprofiled: Half,
    /// The floor, then memprobe in each mode.
    rows: Vec<Row>,
}

/// One configuration, attached to twin A against B, then to B against A.
struct Row {
    label: &'static str,
    halves: [Half; 2],
}

/// Runs of a twin with something attached, and of the other without,
/// taken in turn.
#[derive(Default)]
struct Half {
    with: Runs,
    without: Runs,
    /// memprobe's report of the time it added over the `with` runs.
    reported: Option<f64>,
    /// What a slow-path mode's trial had decided before the measured runs.
    trial: Option<&'static str>,
    /// memprobe's own CPU and peak RSS at the end of the half.
    own: Usage,
}

/// redis-benchmark runs, summed.
#[derive(Default, Clone, Copy)]
struct Runs {
    count: usize,
    /// Requests per second, summed over the runs.
    rates: f64,
    /// redis-server's CPU seconds over the runs.
    cpu: f64,
    /// Times redis-server's main thread slept (in epoll_wait) over the
    /// runs: a slower server finds more requests waiting each time it
    /// wakes, and spends less on system calls per request.
    sleeps: u64,
}

impl Runs {
    fn add(&mut self, run: Run) {
        self.count += 1;
        self.rates += run.rate;
        self.cpu += run.cpu;
        self.sleeps += run.sleeps;
    }

    fn rate(&self) -> f64 {
        self.rates / self.count.max(1) as f64
    }

    /// Every run serves the same requests, so CPU per run stands for CPU
    /// per request.
    fn cpu_per_run(&self) -> f64 {
        self.cpu / self.count.max(1) as f64
    }

    fn sleeps_per_run(&self) -> f64 {
        self.sleeps as f64 / self.count.max(1) as f64
    }
}

/// One redis-benchmark run.
struct Run {
    /// Requests per second.
    rate: f64,
    /// redis-server's CPU seconds.
    cpu: f64,
    /// Times its main thread slept.
    sleeps: u64,
}

/// The sampling modes compared: (label, memprobe's flags).
const MODES: [(&str, &[&str]); 4] = [
    ("memprobe, `--sampling entry`", &["--sampling", "entry"]),
    ("memprobe, default (jemalloc's slow path)", &[]),
    (
        "memprobe, `--track allocations --sampling entry`",
        &["--track", "allocations", "--sampling", "entry"],
    ),
    (
        "memprobe, `--track allocations`",
        &["--track", "allocations"],
    ),
];

const FLOOR: &str =
    "two-trap floor: counting uprobe perf events at malloc and free, no BPF program";

/// What redis-benchmark sends.
#[derive(Clone, Copy)]
pub(super) struct Load {
    /// The size of the values SET.
    pub value_bytes: u32,
    /// Requests each client sends before it waits for replies (`-P`): 1, a
    /// server that sleeps between requests; 16, one kept busy, as a
    /// saturated production server is.
    pub pipeline: u32,
}

impl Load {
    /// SETs (and as many GETs) in one run: some seconds of work either way.
    fn requests(&self) -> u32 {
        if self.pipeline > 1 { 600_000 } else { 200_000 }
    }
}

/// A redis-server under load.
#[derive(Clone, Copy)]
struct Server {
    pid: u32,
    port: &'static str,
    load: Load,
}

/// Twin redis-servers started afresh, filled, and measured under `load`
/// without memprobe, with the two-trap floor and with memprobe in each mode.
pub(super) fn redis_bench(
    memprobe: &Path,
    profiles_dir: &str,
    places: &[Place],
    load: Load,
) -> Result<RedisResult> {
    let mut children = Vec::new();
    let result = (|| {
        let mut twins = Vec::new();
        for port in ["6399", "6400"] {
            let child = start_server(port)?;
            let server = Server {
                pid: child.id(),
                port,
                load,
            };
            children.push(child);
            fill(server)?;
            twins.push(server);
        }
        let twins = [twins[0], twins[1]];
        let mut unprofiled = Half::default();
        in_turn(twins, &mut unprofiled)?;
        let mut rows = Vec::new();
        rows.push(Row {
            label: FLOOR,
            halves: floor_halves(twins, |pid| Floor::attach(pid, places))?,
        });
        rows.push(Row {
            label: ONE_TRAP,
            halves: floor_halves(twins, |pid| OneTrap::attach(pid, &places[1]))?,
        });
        for (label, flags) in MODES {
            let halves = crossover(twins, |pair, half| {
                attached_half(memprobe, profiles_dir, pair, flags, half)
            })?;
            report_trial(label, &halves);
            rows.push(Row { label, halves });
        }
        Ok(RedisResult {
            load,
            unprofiled,
            rows,
        })
    })();
    for mut child in children {
        let _ = child.kill();
        let _ = child.wait();
    }
    result
}

/// redis-server on CPU 0 (redis-benchmark runs on the other: neither takes
/// the other's time).
fn start_server(port: &str) -> Result<Child> {
    let child = Command::new("taskset")
        .args(["-c", "0", "redis-server"])
        .args(["--port", port, "--save", "", "--appendonly", "no"])
        .args(["--bind", "127.0.0.1"])
        .stdout(Stdio::null())
        .spawn()
        .context("starting redis-server")?;
    std::thread::sleep(Duration::from_millis(500));
    Ok(child)
}

/// Both halves of a crossover: `measure` with something attached to the
/// first twin of the pair, then with the twins' roles swapped.
fn crossover(
    [a, b]: [Server; 2],
    mut measure: impl FnMut([Server; 2], &mut Half) -> Result<()>,
) -> Result<[Half; 2]> {
    let mut halves = [Half::default(), Half::default()];
    measure([a, b], &mut halves[0])?;
    measure([b, a], &mut halves[1])?;
    Ok(halves)
}

/// Both halves of a crossover with a floor's probes (`attach`ed to a pid)
/// on the first twin of the pair.
fn floor_halves<P: CountsHits>(
    twins: [Server; 2],
    attach: impl Fn(u32) -> Result<P>,
) -> Result<[Half; 2]> {
    crossover(twins, |pair, half| {
        let probes = attach(pair[0].pid)?;
        in_turn(pair, half)?;
        if probes.hits()? == 0 {
            bail!("a floor's probes counted no hit in redis-server");
        }
        Ok(())
    })
}

/// Runs of `pair[0]` (into `half.with`) and `pair[1]` (into
/// `half.without`) in the order with, without, without, with: a drift
/// that is steady over them cancels out.
fn in_turn(pair: [Server; 2], half: &mut Half) -> Result<()> {
    for profiled in [true, false, false, true] {
        if profiled {
            half.with.add(measure_run(pair[0])?);
        } else {
            half.without.add(measure_run(pair[1])?);
        }
    }
    Ok(())
}

/// Sets most of the million keys the measured runs use (with pipelining,
/// in seconds): without this the first runs would find fewer keys to
/// replace, and free less, than the later ones.
fn fill(server: Server) -> Result<()> {
    let status = Command::new("taskset")
        .args(["-c", "1", "redis-benchmark", "-h", "127.0.0.1"])
        .args(["-p", server.port])
        .args(["-t", "set", "-n", "3000000", "-r", "1000000"])
        .args(["-d", &server.load.value_bytes.to_string()])
        .args(["-P", "16", "-q"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()?;
    if !status.success() {
        bail!("redis-benchmark could not fill redis-server");
    }
    Ok(())
}

/// One redis-benchmark run: its rate, redis-server's CPU seconds and how
/// often its main thread slept.
fn measure_run(server: Server) -> Result<Run> {
    let cpu = || usage(server.pid).map_or(0.0, |(cpu, _)| cpu);
    let (cpu_before, sleeps_before) = (cpu(), sleeps(server.pid));
    let rate = requests_per_second(server)?;
    Ok(Run {
        rate,
        cpu: cpu() - cpu_before,
        sleeps: sleeps(server.pid).saturating_sub(sleeps_before),
    })
}

/// Voluntary context switches of a process's main thread so far.
fn sleeps(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|line| line.strip_prefix("voluntary_ctxt_switches:"))
        .and_then(|count| count.trim().parse().ok())
        .unwrap_or(0)
}

/// Most warm-up runs while the slow path's trial decides.
const MAX_WARMUP: usize = 8;

/// memprobe attached to `pair[0]` in one mode: warm-up runs under load
/// until the slow path's trial (if any) has decided, then the runs in
/// turn, with memprobe's report of what it added over them read from its
/// /metrics just before and after.
fn attached_half(
    memprobe: &Path,
    profiles_dir: &str,
    pair: [Server; 2],
    flags: &[&str],
    half: &mut Half,
) -> Result<()> {
    let pid = pair[0].pid.to_string();
    let mut args = vec!["--pid", &pid, "-o", profiles_dir, "--listen", LISTEN];
    args.extend_from_slice(flags);
    let (mut probe, stderr) = start_memprobe(memprobe, &args)?;
    let on_trial = !flags.contains(&"entry");
    let decided = || said(&stderr, SLOW_PATH_KEPT).or(said(&stderr, FELL_BACK));
    let mut runs = 0;
    while runs < MAX_WARMUP && (runs < 2 || on_trial && decided().is_none()) {
        measure_run(pair[0])?;
        runs += 1;
    }
    let kept = said(&stderr, SLOW_PATH_KEPT).map(|_| "kept the slow path");
    let fell_back = said(&stderr, FELL_BACK).map(|_| "fell back to entry sampling");
    half.trial = on_trial.then(|| kept.or(fell_back).unwrap_or("had not decided"));
    if let (Some(decision), Some(line)) = (half.trial, line_with(&stderr, FELL_BACK)) {
        eprintln!("bench:   after {runs} warm-up runs the trial {decision}: {line}");
    }
    let added = || {
        // /metrics is refreshed every second; redis is idle meanwhile.
        std::thread::sleep(Duration::from_millis(1500));
        scraped_added_seconds(pair[0].pid)
    };
    let start = added();
    in_turn(pair, half)?;
    let end = added();
    half.reported = start.zip(end).map(|(start, end)| end - start);
    half.own = usage(probe.id());
    stop(&mut probe);
    Ok(())
}

/// Says on stderr what a slow-path mode's trials decided.
fn report_trial(label: &str, halves: &[Half; 2]) {
    let decisions: Vec<&str> = halves.iter().filter_map(|half| half.trial).collect();
    if !decisions.is_empty() {
        eprintln!("bench: {label}: the trials {}", decisions.join(", then "));
    }
}

/// `memprobe_added_seconds_total` of `pid`, read from memprobe's /metrics.
fn scraped_added_seconds(pid: u32) -> Option<f64> {
    let mut stream = TcpStream::connect(LISTEN).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(stream, "GET /metrics HTTP/1.0\r\nHost: {LISTEN}\r\n\r\n").ok()?;
    let mut text = String::new();
    stream.read_to_string(&mut text).ok()?;
    let series = format!("memprobe_added_seconds_total{{pid=\"{pid}\"");
    let line = text.lines().find(|line| line.starts_with(&series))?;
    line.rsplit(' ').next()?.parse().ok()
}

/// The README's redis table, and how memprobe's reported cost compares
/// with what redis-server gained.
pub(super) fn redis_table(redis: &RedisResult) -> String {
    let plain = &redis.unprofiled;
    let mut table = format!(
        "\n| redis-server 7 (libjemalloc), redis-benchmark SET/GET of {}-byte values, 50 clients{}, random keys (a million, mostly set first), each run {}k SET + {}k GET; twin servers in turn, each once profiled and once the baseline | requests/s (vs without) | redis-server CPU s a run, with (without) | CPU per request vs without | redis-server's sleeps a run, with (without) | added CPU s over the 4 measured runs: measured / memprobe's report | memprobe's own CPU s, peak RSS |\n|---|---|---|---|---|---|---|\n\
         | without memprobe (twin B's CPU per request over twin A's, nothing attached: {:.2}x) | {:.0} | {:.2} | 1.00x | {:.0} | - | - |\n",
        redis.load.value_bytes,
        match redis.load.pipeline {
            1 => String::new(),
            depth => format!(" each pipelining {depth} requests (the server never idle)"),
        },
        redis.load.requests() / 1000,
        redis.load.requests() / 1000,
        plain.without.cpu_per_run() / plain.with.cpu_per_run().max(1e-12),
        (plain.with.rate() + plain.without.rate()) / 2.0,
        (plain.with.cpu_per_run() + plain.without.cpu_per_run()) / 2.0,
        (plain.with.sleeps_per_run() + plain.without.sleeps_per_run()) / 2.0,
    );
    for row in &redis.rows {
        table.push_str(&table_row(row));
    }
    table
}

/// One configuration's line: the geometric means of its two halves'
/// ratios, so that the twins' own difference cancels.
fn table_row(row: &Row) -> String {
    let [a, b] = &row.halves;
    let ratio = |value: fn(&Runs) -> f64| {
        let half = |h: &Half| value(&h.with) / value(&h.without).max(1e-12);
        (half(a) * half(b)).sqrt()
    };
    let (rate, cpu) = (ratio(Runs::rate), ratio(Runs::cpu_per_run));
    let mean =
        |value: fn(&Runs) -> f64, runs: fn(&Half) -> &Runs| (value(runs(a)) + value(runs(b))) / 2.0;
    let trials: Vec<&str> = row.halves.iter().filter_map(|h| h.trial).collect();
    let undecided = if trials.iter().all(|&t| t == "kept the slow path") {
        String::new()
    } else {
        format!(" (its trials: {})", trials.join("; "))
    };
    format!(
        "| {}{undecided} | {:.0} ({:.1}%) | {:.2} ({:.2}) | {cpu:.2}x | {:.0} ({:.0}) | {} | {} |\n",
        row.label,
        mean(Runs::rate, |h| &h.with),
        100.0 * rate,
        mean(Runs::cpu_per_run, |h| &h.with),
        mean(Runs::cpu_per_run, |h| &h.without),
        mean(Runs::sleeps_per_run, |h| &h.with),
        mean(Runs::sleeps_per_run, |h| &h.without),
        added(row, cpu),
        own(row),
    )
}

/// What redis-server gained over the measured runs (their CPU less the same
/// at `cpu_ratio` less per request) against memprobe's report.
fn added(row: &Row, cpu_ratio: f64) -> String {
    let gained: f64 = row
        .halves
        .iter()
        .map(|h| h.with.cpu * (1.0 - 1.0 / cpu_ratio))
        .sum();
    let reported: Option<f64> = row.halves.iter().map(|h| h.reported).sum();
    match reported {
        // Within the twins' noise a mode that traps almost never can read
        // a loss: no ratio to give.
        Some(reported) if gained <= 0.0 => {
            format!("{gained:.2} / {reported:.2} (no gain measured)")
        }
        Some(reported) => format!(
            "{gained:.2} / {reported:.2} ({:.0}%)",
            100.0 * reported / gained.max(1e-9)
        ),
        None => "-".to_owned(),
    }
}

/// memprobe's own CPU over both halves and its larger peak RSS.
fn own(row: &Row) -> String {
    let usages: Option<Vec<(f64, u64)>> = row.halves.iter().map(|h| h.own).collect();
    match usages {
        Some(usages) => format!(
            "{:.2} s, {:.1} MiB",
            usages.iter().map(|u| u.0).sum::<f64>(),
            usages.iter().map(|u| u.1).max().unwrap_or(0) as f64 / 1024.0
        ),
        None => "-".to_owned(),
    }
}

/// One redis-benchmark run's mean requests per second over SET and GET.
fn requests_per_second(server: Server) -> Result<f64> {
    let load = server.load;
    let output = Command::new("taskset")
        .args(["-c", "1", "redis-benchmark", "-h", "127.0.0.1"])
        .args(["-p", server.port, "-t", "set,get"])
        .args(["-n", &load.requests().to_string()])
        .args(["-d", &load.value_bytes.to_string()])
        .args(["-P", &load.pipeline.to_string()])
        // Random keys, as real clients' are: with one fixed key every
        // request allocates the same sizes, a cycle the slow path's trial
        // rightly refuses (see README).
        .args(["-r", "1000000", "-q"])
        .output()?;
    let text = String::from_utf8_lossy(&output.stdout);
    // "SET: 98765.43 requests per second, p50=..." per test.
    let rates: Vec<f64> = text
        .split(['\r', '\n'])
        .filter_map(|line| {
            line.split_once(": ")?
                .1
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        })
        .collect();
    if rates.is_empty() {
        bail!("no rate in redis-benchmark output: {text}");
    }
    Ok(rates.iter().sum::<f64>() / rates.len() as f64)
}
