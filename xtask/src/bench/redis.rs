//! redis-server under redis-benchmark, with and without memprobe: the
//! request rate, redis-server's CPU time, and what memprobe said it added.
use std::{
    path::Path,
    process::{Command, Stdio},
    time::Duration,
};

use anyhow::{Context, Result, bail};

use super::{Usage, reported_added_seconds, start_memprobe, stop, usage};

/// redis-server under redis-benchmark without and with memprobe.
pub(super) struct RedisResult {
    /// Requests per second.
    without: f64,
    with: f64,
    /// redis-server's CPU seconds over the same requests.
    cpu_without: f64,
    cpu_with: f64,
    /// What memprobe's summary said it added to redis-server.
    reported_added: Option<f64>,
    /// memprobe's own CPU and peak RSS.
    own: Usage,
}

/// Requests per second and redis-server's CPU without and with memprobe.
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
    let benchmark = || requests_per_second(port);
    let server_pid = server.id();
    let cpu = || usage(server_pid).map_or(0.0, |(cpu, _)| cpu);
    // Two runs each; rates are the better run, CPU the sum of both.
    let measure = || -> Result<(f64, f64)> {
        let before = cpu();
        let rate = benchmark()?.max(benchmark()?);
        Ok((rate, cpu() - before))
    };
    let result = (|| {
        let (without, cpu_without) = measure()?;
        let pid = server_pid.to_string();
        let (mut probe, stderr) = start_memprobe(memprobe, &["--pid", &pid, "-o", profiles_dir])?;
        let (with, cpu_with) = measure()?;
        let own = usage(probe.id());
        stop(&mut probe);
        // The summary comes as memprobe exits; its reader may lag a little.
        std::thread::sleep(Duration::from_millis(200));
        Ok(RedisResult {
            without,
            with,
            cpu_without,
            cpu_with,
            reported_added: reported_added_seconds(&stderr),
            own,
        })
    })();
    let _ = server.kill();
    let _ = server.wait();
    result
}

/// The README's redis table, and how memprobe's reported cost compares
/// with what redis-server gained.
pub(super) fn redis_table(redis: &RedisResult) -> String {
    let gained = redis.cpu_with - redis.cpu_without;
    let reported = redis.reported_added.map_or("nothing".to_owned(), |r| {
        format!(
            "{r:.2} s ({:.0}% of what it gained)",
            100.0 * r / gained.max(1e-9)
        )
    });
    let mut table = format!(
        "\n| redis-server 7 (libjemalloc), redis-benchmark SET/GET, 50 clients, 2 runs of 200k SET + 200k GET | requests/s | redis-server CPU s |\n|---|---|---|\n\
         | without memprobe | {:.0} | {:.2} |\n| with memprobe attached | {:.0} ({:.1}% of the rate without) | {:.2} ({:.2}x) |\n\
         \nredis-server gained {gained:.2} CPU s with memprobe; memprobe's summary reported {reported} added (per-hit costs measured at its start).\n",
        redis.without,
        redis.cpu_without,
        redis.with,
        100.0 * redis.with / redis.without,
        redis.cpu_with,
        redis.cpu_with / redis.cpu_without.max(1e-9),
    );
    if let Some((cpu, rss)) = redis.own {
        table.push_str(&format!(
            "\nmemprobe itself during the redis run: {cpu:.2} s CPU, peak RSS {:.1} MiB.\n",
            rss as f64 / 1024.0
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
