//! `cargo xtask soak [--duration 10m]`: memprobe as a host agent for a long
//! unattended run (`--all`, a 4 KiB sampling interval, snapshots every 30 s
//! kept 3 at a time, the endpoints scraped every 10 s) while a busy
//! allocator runs, its resident memory read every 10 s. The memory must
//! stay bounded: the second half's peak at most 20% above the first half's.
//! Writes target/soak/results.md.
use std::{
    io::{BufRead, BufReader, Read, Write},
    net::TcpStream,
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};

use crate::{run_command, workspace_root};

/// How often memory is read and the endpoints scraped.
const EVERY: Duration = Duration::from_secs(10);

pub fn soak(duration: Duration, memprobe: &std::path::Path) -> Result<()> {
    let dir = workspace_root().join("target/soak");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    let busy = dir.join("malloc_loop");
    run_command(
        Command::new("cc")
            .args(["-O2", "-o"])
            .arg(&busy)
            .arg(workspace_root().join("tests/fixtures/malloc_loop.c"))
            .arg("-ljemalloc"),
    )?;
    let seconds = (duration + Duration::from_secs(30)).as_secs().to_string();
    let mut busy = Command::new(&busy)
        .args(["0", &seconds])
        .stdout(Stdio::null())
        .spawn()?;
    let mut agent = Command::new(memprobe)
        .args([
            "--all",
            // As the shipped agent runs.
            "--allocator",
            "jemalloc,mimalloc,tcmalloc",
            "--sample-interval",
            "4096",
            "--listen",
            "127.0.0.1:0",
        ])
        .args(["--interval", "30s", "--keep", "3", "--output"])
        .arg(dir.join("out"))
        .arg("--duration")
        .arg(format!("{}s", duration.as_secs()))
        .stderr(Stdio::piped())
        .spawn()
        .context("starting memprobe")?;
    let mut stderr = BufReader::new(agent.stderr.take().context("stderr")?);
    let address = listening_address(&mut stderr)?;
    std::thread::spawn(move || stderr.lines().for_each(drop));
    let started = Instant::now();
    let mut readings = Vec::new();
    while agent.try_wait()?.is_none() {
        std::thread::sleep(EVERY);
        let scraped = scrape(&address, "/metrics").is_some()
            && scrape(&address, "/debug/pprof/?format=json").is_some();
        if let Some(rss) = resident_kib(agent.id()) {
            eprintln!(
                "xtask: soak: {:>4} s: memprobe resident {rss} KiB{}",
                started.elapsed().as_secs(),
                if scraped { "" } else { " (scrape failed)" }
            );
            readings.push((started.elapsed().as_secs(), rss));
        }
    }
    let _ = busy.kill();
    let _ = busy.wait();
    report(&readings, duration, &dir)
}

fn report(readings: &[(u64, u64)], duration: Duration, dir: &std::path::Path) -> Result<()> {
    if readings.len() < 4 {
        bail!("too few readings of memprobe's memory: {readings:?}");
    }
    let half = readings.len() / 2;
    let peak = |r: &[(u64, u64)]| r.iter().map(|(_, k)| *k).max().unwrap_or(0);
    let (first, second) = (peak(&readings[..half]), peak(&readings[half..]));
    let mut table = format!(
        "Soak: `cargo xtask soak --duration {}m` (--all, 4 KiB interval, snapshots every \
         30 s, --keep 3, endpoints scraped every 10 s, a malloc/free loop busy throughout)\n\n\
         | elapsed | memprobe resident |\n|---|---|\n",
        duration.as_secs() / 60
    );
    for (seconds, kib) in readings {
        table.push_str(&format!(
            "| {seconds} s | {:.1} MiB |\n",
            *kib as f64 / 1024.0
        ));
    }
    table.push_str(&format!(
        "\nPeak of the first half {:.1} MiB, of the second {:.1} MiB.\n",
        first as f64 / 1024.0,
        second as f64 / 1024.0
    ));
    println!("{table}");
    std::fs::write(dir.join("results.md"), &table)?;
    if second as f64 > first as f64 * 1.2 {
        bail!("memprobe's memory grew: {first} KiB then {second} KiB");
    }
    Ok(())
}

/// The address from "memprobe: serving http://ADDR/debug/pprof/ ...".
fn listening_address(stderr: &mut impl BufRead) -> Result<String> {
    let mut line = String::new();
    while stderr.read_line(&mut line)? > 0 {
        if let Some(rest) = line.trim().strip_prefix("memprobe: serving http://") {
            return Ok(rest.split('/').next().unwrap_or_default().to_owned());
        }
        eprint!("{line}");
        line.clear();
    }
    bail!("memprobe ended before serving")
}

/// The body of `GET path`, if the answer was 200.
fn scrape(address: &str, path: &str) -> Option<String> {
    let mut stream = TcpStream::connect(address).ok()?;
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .ok()?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut text = String::new();
    stream.read_to_string(&mut text).ok()?;
    text.starts_with("HTTP/1.1 200")
        .then(|| text.split_once("\r\n\r\n").map(|(_, b)| b.to_owned()))?
}

fn resident_kib(pid: u32) -> Option<u64> {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()?
        .lines()
        .find(|l| l.starts_with("VmRSS:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}
