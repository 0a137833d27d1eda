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
    /// The size of the values SET.
    value_bytes: u32,
    /// Requests per second, and redis-server's CPU seconds over the same
    /// requests, without memprobe: one pair before the floor's and before
    /// each mode's, one last.
    without: Vec<(f64, f64)>,
    /// The same with counting uprobe events at malloc and free only
    /// (measured between the first two pairs without).
    floor: (f64, f64),
    with: Vec<Attached>,
}

/// One run with memprobe attached.
struct Attached {
    label: &'static str,
    /// What a slow-path mode's trial had decided before the measured runs,
    /// unless it kept the slow path.
    trial: Option<&'static str>,
    /// The pair without memprobe measured just before attaching (the
    /// table compares each run with the pairs before and after it:
    /// redis-server's CPU per pair drifts by 10-20% over the bench).
    before: (f64, f64),
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

/// The redis-server under load, and the value size of its SETs.
#[derive(Clone, Copy)]
struct Server {
    pid: u32,
    port: &'static str,
    value_bytes: u32,
}

/// redis-server started afresh, filled, and measured without memprobe,
/// with the two-trap floor and with memprobe in each mode, its SETs storing
/// values of `value_bytes`.
pub(super) fn redis_bench(
    memprobe: &Path,
    profiles_dir: &str,
    places: &[Place],
    value_bytes: u32,
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
    let target = Server {
        pid: server.id(),
        port,
        value_bytes,
    };
    let result = (|| {
        fill(target)?;
        let measure = || measure_pair(target);
        let mut without = vec![measure()?];
        let counters = Floor::attach(target.pid, places)?;
        let floor = measure()?;
        if counters.hits()? == 0 {
            bail!("the two-trap floor's uprobes counted no hit in redis-server");
        }
        drop(counters);
        let mut with = Vec::new();
        for (label, flags) in MODES {
            let run = attached_run(memprobe, profiles_dir, target, (label, flags))?;
            without.push(run.before);
            with.push(run);
        }
        without.push(measure()?);
        Ok(RedisResult {
            value_bytes,
            without,
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
fn fill(server: Server) -> Result<()> {
    let status = Command::new("taskset")
        .args([
            "-c",
            "1",
            "redis-benchmark",
            "-h",
            "127.0.0.1",
            "-p",
            server.port,
        ])
        .args(["-t", "set", "-n", "3000000", "-r", "1000000"])
        .args(["-d", &server.value_bytes.to_string()])
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
fn measure_pair(server: Server) -> Result<(f64, f64)> {
    let cpu = || usage(server.pid).map_or(0.0, |(cpu, _)| cpu);
    let before = cpu();
    let rate = requests_per_second(server)?.max(requests_per_second(server)?);
    Ok((rate, cpu() - before))
}

/// Most warm-up pairs while the slow path's trial decides.
const MAX_WARMUP: usize = 4;

/// A pair without memprobe, then memprobe attached in one mode: warm-up
/// pairs under load until the slow path's trial (if any) kept the slow
/// path, then a measured pair.
fn attached_run(
    memprobe: &Path,
    profiles_dir: &str,
    server: Server,
    (label, flags): (&'static str, &[&str]),
) -> Result<Attached> {
    let before = measure_pair(server)?;
    let pid = server.pid.to_string();
    let mut args = vec!["--pid", &pid, "-o", profiles_dir];
    args.extend_from_slice(flags);
    let (mut probe, stderr) = start_memprobe(memprobe, &args)?;
    let on_trial = !flags.contains(&"entry");
    let mut warm_cpu = 0.0;
    let mut pairs = 0;
    while pairs < MAX_WARMUP && (pairs == 0 || on_trial && said(&stderr, SLOW_PATH_KEPT).is_none())
    {
        warm_cpu += measure_pair(server)?.1;
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
    let (rate, cpu) = measure_pair(server)?;
    let own = usage(probe.id());
    stop(&mut probe);
    // The summary comes as memprobe exits; its reader may lag.
    std::thread::sleep(Duration::from_millis(200));
    Ok(Attached {
        label,
        trial: trial.filter(|&decision| decision != "kept the slow path"),
        before,
        rate,
        cpu,
        pairs: pairs + 1,
        cpu_while_attached: warm_cpu + cpu,
        reported_added: reported_added_seconds(&stderr),
        own,
    })
}

/// The README's redis table, and how memprobe's reported cost compares
/// with what redis-server gained. Each row is compared with the pairs
/// without memprobe measured just before and just after it.
pub(super) fn redis_table(redis: &RedisResult) -> String {
    let cpus: Vec<f64> = redis.without.iter().map(|&(_, cpu)| cpu).collect();
    let rates: Vec<f64> = redis.without.iter().map(|&(rate, _)| rate).collect();
    let mean = |values: &[f64]| values.iter().sum::<f64>() / values.len().max(1) as f64;
    let (low, high) = cpus
        .iter()
        .fold((f64::MAX, f64::MIN), |(l, h), &c| (l.min(c), h.max(c)));
    let mut table = format!(
        "\n| redis-server 7 (libjemalloc), redis-benchmark SET/GET of {}-byte values, 50 clients, random keys (a million, mostly set first), each on its own CPU, 2 runs of 200k SET + 200k GET | requests/s (vs without, around it) | redis-server CPU s (without, around it) | CPU per request vs without, around it | added CPU s while attached (warm-up included): measured / memprobe's report | memprobe's own CPU s, peak RSS |\n|---|---|---|---|---|---|\n\
         | without memprobe: mean of {} pairs, one before and after each row below (CPU {low:.2} to {high:.2}) | {:.0} | {:.2} | 1.00x | - | - |\n",
        redis.value_bytes,
        cpus.len(),
        mean(&rates),
        mean(&cpus),
    );
    let floor = "two-trap floor: counting uprobe perf events at malloc and free, no BPF program";
    let rows = std::iter::once((floor.to_owned(), redis.floor, None)).chain(redis.with.iter().map(
        |run| {
            let undecided = run
                .trial
                .map_or(String::new(), |decision| format!(" (its trial {decision})"));
            let label = format!("memprobe, {}{undecided}", run.label);
            (label, (run.rate, run.cpu), Some(run))
        },
    ));
    for (row, (label, (rate, cpu), run)) in rows.enumerate() {
        // Row k ran between pairs k and k + 1 without.
        let around =
            |values: &[f64]| mean(&values[row.min(values.len())..(row + 2).min(values.len())]);
        let (base_rate, base_cpu) = (around(&rates), around(&cpus));
        let (added, own) = run.map_or(("-".to_owned(), "-".to_owned()), |run| {
            added_and_own(run, base_cpu)
        });
        table.push_str(&format!(
            "| {label} | {rate:.0} ({:.1}%) | {cpu:.2} ({base_cpu:.2}) | {:.2}x | {added} | {own} |\n",
            100.0 * rate / base_rate.max(1e-12),
            // The same requests each time: CPU per request is CPU.
            cpu / base_cpu.max(1e-12),
        ));
    }
    table
}

/// What redis-server gained while attached (its CPU less the same pairs'
/// without, at `base_cpu` a pair) against memprobe's report; memprobe's
/// own CPU and RSS.
fn added_and_own(run: &Attached, base_cpu: f64) -> (String, String) {
    let gained = run.cpu_while_attached - run.pairs as f64 * base_cpu;
    let reported = run.reported_added.map_or("-".to_owned(), |r| {
        format!("{r:.2} ({:.0}%)", 100.0 * r / gained.max(1e-9))
    });
    let own = run.own.map_or("-".to_owned(), |(cpu, rss)| {
        format!("{cpu:.2} s, {:.1} MiB", rss as f64 / 1024.0)
    });
    (format!("{gained:.2} / {reported}"), own)
}

/// One redis-benchmark run's mean requests per second over SET and GET.
fn requests_per_second(server: Server) -> Result<f64> {
    let output = Command::new("taskset")
        .args(["-c", "1", "redis-benchmark"])
        .args([
            "-h",
            "127.0.0.1",
            "-p",
            server.port,
            "-t",
            "set,get",
            "-n",
            "200000",
            "-d",
            &server.value_bytes.to_string(),
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
