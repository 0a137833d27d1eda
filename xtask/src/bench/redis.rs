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
    /// Both servers with nothing attached: how alike they are.
    without: Interleaved,
    /// Counting uprobe events at malloc and free only, on the profiled one.
    floor: Interleaved,
    with: Vec<Attached>,
}

/// Requests per second and redis-server's CPU seconds a pair of runs,
/// means over pairs taken in turn on the profiled server and the control.
#[derive(Clone, Copy)]
struct Interleaved {
    profiled: (f64, f64),
    control: (f64, f64),
}

/// One run with memprobe attached.
struct Attached {
    label: &'static str,
    /// What a slow-path mode's trial had decided before the measured runs,
    /// unless it kept the slow path.
    trial: Option<&'static str>,
    /// Run pairs on the profiled server while attached, the warm-up's
    /// included.
    pairs: usize,
    measured: Interleaved,
    /// The profiled server's CPU seconds over the warm-up and the measured
    /// runs: the time memprobe's report covers.
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

/// Pairs measured on each server, in turn, for a row.
const TURNS: usize = 2;

/// A redis-server under load, and the value size of its SETs.
#[derive(Clone, Copy)]
struct Server {
    pid: u32,
    port: &'static str,
    value_bytes: u32,
}

/// Two redis-servers alike, started afresh and filled: memprobe (or the
/// floor's counters) attaches to the first only, and each row's runs on it
/// take turns with the same runs on the second, so that both meet the same
/// moments of a VM whose speed wanders (a pair's CPU varied by up to 20%
/// over a bench run). Their SETs store values of `value_bytes`.
pub(super) fn redis_bench(
    memprobe: &Path,
    profiles_dir: &str,
    places: &[Place],
    value_bytes: u32,
) -> Result<RedisResult> {
    let mut children = Vec::new();
    let mut servers = Vec::new();
    for port in ["6399", "6398"] {
        // redis-server on one CPU, redis-benchmark on the other: neither
        // takes the other's time.
        let child = Command::new("taskset")
            .args(["-c", "0", "redis-server"])
            .args(["--port", port, "--save", "", "--appendonly", "no"])
            .args(["--bind", "127.0.0.1"])
            .stdout(Stdio::null())
            .spawn()
            .context("starting redis-server")?;
        servers.push(Server {
            pid: child.id(),
            port,
            value_bytes,
        });
        children.push(child);
    }
    std::thread::sleep(Duration::from_millis(500));
    let (profiled, control) = (servers[0], servers[1]);
    let result = (|| {
        fill(profiled)?;
        fill(control)?;
        let without = interleave(profiled, control)?;
        let counters = Floor::attach(profiled.pid, places)?;
        let floor = interleave(profiled, control)?;
        if counters.hits()? == 0 {
            bail!("the two-trap floor's uprobes counted no hit in redis-server");
        }
        drop(counters);
        let mut with = Vec::new();
        for mode in MODES {
            with.push(attached_run(
                memprobe,
                profiles_dir,
                (profiled, control),
                mode,
            )?);
        }
        Ok(RedisResult {
            value_bytes,
            without,
            floor,
            with,
        })
    })();
    for mut child in children {
        let _ = child.kill();
        let _ = child.wait();
    }
    result
}

/// [`TURNS`] pairs on each server, in turn: the means.
fn interleave(profiled: Server, control: Server) -> Result<Interleaved> {
    let mut sums = [(0.0, 0.0); 2];
    for _ in 0..TURNS {
        for (sum, server) in sums.iter_mut().zip([profiled, control]) {
            let (rate, cpu) = measure_pair(server)?;
            *sum = (sum.0 + rate, sum.1 + cpu);
        }
    }
    let mean = |(rate, cpu): (f64, f64)| (rate / TURNS as f64, cpu / TURNS as f64);
    Ok(Interleaved {
        profiled: mean(sums[0]),
        control: mean(sums[1]),
    })
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

/// memprobe attached to the profiled server in one mode: warm-up pairs
/// under load until the slow path's trial (if any) kept the slow path,
/// then pairs in turn with the control.
fn attached_run(
    memprobe: &Path,
    profiles_dir: &str,
    (server, control): (Server, Server),
    (label, flags): (&'static str, &[&str]),
) -> Result<Attached> {
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
    let measured = interleave(server, control)?;
    let own = usage(probe.id());
    stop(&mut probe);
    // The summary comes as memprobe exits; its reader may lag.
    std::thread::sleep(Duration::from_millis(200));
    Ok(Attached {
        label,
        trial: trial.filter(|&decision| decision != "kept the slow path"),
        pairs: pairs + TURNS,
        measured,
        cpu_while_attached: warm_cpu + TURNS as f64 * measured.profiled.1,
        reported_added: reported_added_seconds(&stderr),
        own,
    })
}

/// The README's redis table, and how memprobe's reported cost compares
/// with what redis-server gained. Each row compares the profiled server
/// with the control's runs taken in turn with its own.
pub(super) fn redis_table(redis: &RedisResult) -> String {
    let mut table = format!(
        "\n| redis-server 7 (libjemalloc), redis-benchmark SET/GET of {}-byte values, 50 clients, random keys (a million, mostly set first), each server and redis-benchmark on its own CPU, {TURNS} pairs of runs (200k SET + 200k GET each) on the profiled server in turn with {TURNS} on an unprofiled control | requests/s (vs the control) | redis-server CPU s a pair (the control's) | CPU per request vs the control | added CPU s while attached (warm-up included): measured / memprobe's report | memprobe's own CPU s, peak RSS |\n|---|---|---|---|---|---|\n",
        redis.value_bytes,
    );
    let floor = "two-trap floor: counting uprobe perf events at malloc and free, no BPF program";
    let rows = [
        (
            "without memprobe (both servers unprofiled)".to_owned(),
            redis.without,
            None,
        ),
        (floor.to_owned(), redis.floor, None),
    ]
    .into_iter()
    .chain(redis.with.iter().map(|run| {
        let undecided = run
            .trial
            .map_or(String::new(), |decision| format!(" (its trial {decision})"));
        let label = format!("memprobe, {}{undecided}", run.label);
        (label, run.measured, Some(run))
    }));
    for (label, measured, run) in rows {
        let Interleaved {
            profiled: (rate, cpu),
            control: (base_rate, base_cpu),
        } = measured;
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
