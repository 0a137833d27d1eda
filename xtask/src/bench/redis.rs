//! redis-server under redis-benchmark, with and without memprobe: the
//! request rate, redis-server's CPU time, and what memprobe said it added.
use std::{
    path::Path,
    process::{Command, Stdio},
    time::Duration,
};

use anyhow::{Context, Result, bail};

use super::{
    FELL_BACK, SLOW_PATH_KEPT, Usage,
    floor::{Floor, Place},
    line_with, reported_added_seconds, said, start_memprobe, stop, usage,
};

/// redis-server under redis-benchmark without memprobe and with it in
/// each sampling mode.
pub(super) struct RedisResult {
    /// Requests per second, and redis-server's CPU seconds over the same
    /// requests, without memprobe (the mean of a pair first and a pair
    /// last).
    without: (f64, f64),
    /// The CPU seconds of those first and last pairs.
    drift: (f64, f64),
    /// The same with counting uprobe events at malloc and free only.
    floor: (f64, f64),
    with: Vec<Attached>,
}

/// One run with memprobe attached.
struct Attached {
    label: &'static str,
    /// What a slow-path mode's trial had decided before the measured runs,
    /// unless it kept the slow path.
    trial: Option<&'static str>,
    /// Run pairs while attached, the warm-up's included.
    pairs: usize,
    rate: f64,
    cpu: f64,
    /// redis-server's CPU seconds over the warm-up and the measured runs:
    /// the time memprobe's report covers.
    cpu_while_attached: f64,
    /// What memprobe's summary said it added to redis-server.
    reported_added: Option<f64>,
    /// memprobe's own CPU and peak RSS.
    own: Usage,
}

/// The sampling modes compared: (label, memprobe's flags).
const MODES: [(&str, &[&str]); 4] = [
    ("`--sampling entry`", &["--sampling", "entry"]),
    ("default (jemalloc's slow path)", &[]),
    (
        "`--track allocations --sampling entry`",
        &["--track", "allocations", "--sampling", "entry"],
    ),
    ("`--track allocations`", &["--track", "allocations"]),
];

pub(super) fn redis_bench(
    memprobe: &Path,
    profiles_dir: &str,
    places: &[Place],
) -> Result<RedisResult> {
    let port = "6399";
    // redis-server on one CPU, redis-benchmark on the other: neither
    // takes the other's time, so CPU per request is steady run to run.
    let mut server = Command::new("taskset")
        .args(["-c", "0", "redis-server"])
        .args(["--port", port, "--save", "", "--appendonly", "no"])
        .args(["--bind", "127.0.0.1"])
        .stdout(Stdio::null())
        .spawn()
        .context("starting redis-server")?;
    std::thread::sleep(Duration::from_millis(500));
    let server_pid = server.id();
    let result = (|| {
        fill(port)?;
        let measure = || measure_pair(server_pid, port);
        let before = measure()?;
        let counters = Floor::attach(server_pid, places)?;
        let floor = measure()?;
        if counters.hits()? == 0 {
            bail!("the two-trap floor's uprobes counted no hit in redis-server");
        }
        drop(counters);
        let mut with = Vec::new();
        for (label, flags) in MODES {
            with.push(attached_run(
                memprobe,
                profiles_dir,
                server_pid,
                port,
                (label, flags),
            )?);
        }
        // Without again at the end: the table uses the mean of both.
        let after = measure()?;
        let without = ((before.0 + after.0) / 2.0, (before.1 + after.1) / 2.0);
        Ok(RedisResult {
            without,
            drift: (before.1, after.1),
            floor,
            with,
        })
    })();
    let _ = server.kill();
    let _ = server.wait();
    result
}

/// Sets most of the million keys the measured runs use (with pipelining,
/// in seconds): without this the first runs would find fewer keys to
/// replace, and free less, than the later ones.
fn fill(port: &str) -> Result<()> {
    let status = Command::new("taskset")
        .args(["-c", "1", "redis-benchmark", "-h", "127.0.0.1", "-p", port])
        .args(["-t", "set", "-n", "3000000", "-r", "1000000", "-d", "256"])
        .args(["-P", "16", "-q"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()?;
    if !status.success() {
        bail!("redis-benchmark could not fill redis-server");
    }
    Ok(())
}

/// Two redis-benchmark runs: the better rate, and redis-server's CPU
/// seconds over both.
fn measure_pair(server_pid: u32, port: &str) -> Result<(f64, f64)> {
    let cpu = || usage(server_pid).map_or(0.0, |(cpu, _)| cpu);
    let before = cpu();
    let rate = requests_per_second(port)?.max(requests_per_second(port)?);
    Ok((rate, cpu() - before))
}

/// Most warm-up pairs while the slow path's trial decides.
const MAX_WARMUP: usize = 4;

/// memprobe attached in one mode: warm-up pairs under load until the slow
/// path's trial (if any) kept the slow path, then a measured pair.
fn attached_run(
    memprobe: &Path,
    profiles_dir: &str,
    server_pid: u32,
    port: &str,
    (label, flags): (&'static str, &[&str]),
) -> Result<Attached> {
    let pid = server_pid.to_string();
    let mut args = vec!["--pid", &pid, "-o", profiles_dir];
    args.extend_from_slice(flags);
    let (mut probe, stderr) = start_memprobe(memprobe, &args)?;
    let on_trial = !flags.contains(&"entry");
    let mut warm_cpu = 0.0;
    let mut pairs = 0;
    while pairs < MAX_WARMUP && (pairs == 0 || on_trial && said(&stderr, SLOW_PATH_KEPT).is_none())
    {
        warm_cpu += measure_pair(server_pid, port)?.1;
        pairs += 1;
    }
    let kept = said(&stderr, SLOW_PATH_KEPT).map(|_| "kept the slow path");
    let fell_back = said(&stderr, FELL_BACK).map(|_| "fell back to entry sampling");
    let trial = on_trial.then(|| kept.or(fell_back).unwrap_or("had not decided"));
    if let Some(decision) = trial {
        eprintln!("bench: {label}: after {pairs} warm-up pairs the trial {decision}");
        if let Some(line) = line_with(&stderr, FELL_BACK) {
            eprintln!("bench:   {line}");
        }
    }
    let (rate, cpu) = measure_pair(server_pid, port)?;
    let own = usage(probe.id());
    stop(&mut probe);
    // The summary comes as memprobe exits; its reader may lag.
    std::thread::sleep(Duration::from_millis(200));
    Ok(Attached {
        label,
        trial: trial.filter(|&decision| decision != "kept the slow path"),
        rate,
        cpu,
        pairs: pairs + 1,
        cpu_while_attached: warm_cpu + cpu,
        reported_added: reported_added_seconds(&stderr),
        own,
    })
}

/// The README's redis table, and how memprobe's reported cost compares
/// with what redis-server gained.
pub(super) fn redis_table(redis: &RedisResult) -> String {
    let (rate, cpu) = redis.without;
    let (floor_rate, floor_cpu) = redis.floor;
    let mut table = format!(
        "\n| redis-server 7 (libjemalloc), redis-benchmark SET/GET, 50 clients, random keys (a million, mostly set first), each on its own CPU, 2 runs of 200k SET + 200k GET | requests/s | redis-server CPU s | CPU per request vs without | added CPU s while attached (warm-up included): measured / memprobe's report | memprobe's own CPU s, peak RSS |\n|---|---|---|---|---|---|\n\
         | without memprobe (CPU: mean of {:.2} first and {:.2} last) | {rate:.0} | {cpu:.2} | 1.00x | - | - |\n\
         | two-trap floor: counting uprobe perf events at malloc and free, no BPF program | {floor_rate:.0} ({:.1}%) | {floor_cpu:.2} | {:.2}x | - | - |\n",
        redis.drift.0,
        redis.drift.1,
        100.0 * floor_rate / rate,
        floor_cpu / cpu.max(1e-12),
    );
    for run in &redis.with {
        // What it gained: its CPU while attached less the same pairs' without.
        let gained = run.cpu_while_attached - run.pairs as f64 * cpu;
        let reported = run.reported_added.map_or("-".to_owned(), |r| {
            format!("{r:.2} ({:.0}%)", 100.0 * r / gained.max(1e-9))
        });
        let own = run.own.map_or("-".to_owned(), |(cpu, rss)| {
            format!("{cpu:.2} s, {:.1} MiB", rss as f64 / 1024.0)
        });
        let undecided = run
            .trial
            .map_or(String::new(), |decision| format!(" (its trial {decision})"));
        table.push_str(&format!(
            "| memprobe, {}{undecided} | {:.0} ({:.1}%) | {:.2} | {:.2}x | {gained:.2} / {reported} | {own} |\n",
            run.label,
            run.rate,
            100.0 * run.rate / rate,
            run.cpu,
            // The same requests each time: CPU per request is CPU.
            run.cpu / cpu.max(1e-12),
        ));
    }
    table
}

/// One redis-benchmark run's mean requests per second over SET and GET.
fn requests_per_second(port: &str) -> Result<f64> {
    let output = Command::new("taskset")
        .args(["-c", "1", "redis-benchmark"])
        .args([
            "-h",
            "127.0.0.1",
            "-p",
            port,
            "-t",
            "set,get",
            "-n",
            "200000",
            "-d",
            "256",
            // Random keys, as real clients' are: with one fixed key every
            // request allocates the same sizes, a cycle the slow path's
            // trial rightly refuses (see README).
            "-r",
            "1000000",
            "-q",
        ])
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
