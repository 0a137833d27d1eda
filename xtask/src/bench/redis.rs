//! redis-server under redis-benchmark, with and without memprobe: the
//! request rate, redis-server's CPU time, and what memprobe said it added.
use std::{
    path::Path,
    process::{Command, Stdio},
    time::Duration,
};

use anyhow::{Context, Result, bail};

use super::{Usage, reported_added_seconds, start_memprobe, stop, usage};

/// redis-server under redis-benchmark without memprobe and with it in
/// each sampling mode.
pub(super) struct RedisResult {
    /// Requests per second, and redis-server's CPU seconds over the same
    /// requests, without memprobe.
    without: (f64, f64),
    with: Vec<Attached>,
}

/// One run with memprobe attached.
struct Attached {
    label: &'static str,
    rate: f64,
    cpu: f64,
    /// CPU seconds redis-server gained over the warm-up and the measured
    /// runs: what memprobe's report covers.
    gained_while_attached: f64,
    /// What memprobe's summary said it added to redis-server.
    reported_added: Option<f64>,
    /// memprobe's own CPU and peak RSS.
    own: Usage,
}

/// The sampling modes compared: (label, memprobe's flags).
const MODES: [(&str, &[&str]); 4] = [
    ("entry sampling (default)", &[]),
    ("`--sampling slow-path`", &["--sampling", "slow-path"]),
    ("`--track allocations`", &["--track", "allocations"]),
    (
        "`--track allocations --sampling slow-path`",
        &["--track", "allocations", "--sampling", "slow-path"],
    ),
];

pub(super) fn redis_bench(memprobe: &Path, profiles_dir: &str) -> Result<RedisResult> {
    let port = "6399";
    let mut server = Command::new("redis-server")
        .args([
            "--port",
            port,
            "--save",
            "",
            "--appendonly",
            "no",
            "--bind",
            "127.0.0.1",
        ])
        .stdout(Stdio::null())
        .spawn()
        .context("starting redis-server")?;
    std::thread::sleep(Duration::from_millis(500));
    let server_pid = server.id();
    let cpu = || usage(server_pid).map_or(0.0, |(cpu, _)| cpu);
    // Two runs each; rates are the better run, CPU the sum of both.
    let measure = || -> Result<(f64, f64)> {
        let before = cpu();
        let rate = requests_per_second(port)?.max(requests_per_second(port)?);
        Ok((rate, cpu() - before))
    };
    let result = (|| {
        let without = measure()?;
        let pid = server_pid.to_string();
        let mut with = Vec::new();
        for (label, flags) in MODES {
            let mut args = vec!["--pid", &pid, "-o", profiles_dir];
            args.extend_from_slice(flags);
            let (mut probe, stderr) = start_memprobe(memprobe, &args)?;
            // A warm-up under load: the slow path's trial (5 s on it, 5 s
            // at entry) is over before the measured runs.
            let (_, warm_cpu) = measure()?;
            let (rate, cpu) = measure()?;
            let own = usage(probe.id());
            stop(&mut probe);
            // The summary comes as memprobe exits; its reader may lag.
            std::thread::sleep(Duration::from_millis(200));
            with.push(Attached {
                label,
                rate,
                cpu,
                gained_while_attached: warm_cpu + cpu - 2.0 * without.1,
                reported_added: reported_added_seconds(&stderr),
                own,
            });
        }
        Ok(RedisResult { without, with })
    })();
    let _ = server.kill();
    let _ = server.wait();
    result
}

/// The README's redis table, and how memprobe's reported cost compares
/// with what redis-server gained.
pub(super) fn redis_table(redis: &RedisResult) -> String {
    let (rate, cpu) = redis.without;
    let mut table = format!(
        "\n| redis-server 7 (libjemalloc), redis-benchmark SET/GET, 50 clients, random keys, 2 runs of 200k SET + 200k GET | requests/s | redis-server CPU s | CPU per request vs without | added CPU s while attached (warm-up included): measured / memprobe's report | memprobe's own CPU s, peak RSS |\n|---|---|---|---|---|---|\n\
         | without memprobe | {rate:.0} | {cpu:.2} | 1.00x | - | - |\n"
    );
    for run in &redis.with {
        let gained = run.gained_while_attached;
        let reported = run.reported_added.map_or("-".to_owned(), |r| {
            format!("{r:.2} ({:.0}%)", 100.0 * r / gained.max(1e-9))
        });
        let own = run.own.map_or("-".to_owned(), |(cpu, rss)| {
            format!("{cpu:.2} s, {:.1} MiB", rss as f64 / 1024.0)
        });
        table.push_str(&format!(
            "| memprobe, {} | {:.0} ({:.1}%) | {:.2} | {:.2}x | {gained:.2} / {reported} | {own} |\n",
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
    let output = Command::new("redis-benchmark")
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
