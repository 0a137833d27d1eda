//! `cargo xtask bench`: what memprobe costs the profiled process, side by
//! side in one run: a malloc/free loop with no profiler, with probes placed
//! as bcc's memleak places them (a bpftrace script), and with memprobe; then
//! redis-server under redis-benchmark with and without memprobe attached.
use std::{
    io::{BufRead, BufReader},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::Instant,
};

use anyhow::{Context, Result, bail};
use clap::ValueEnum;

use crate::{run_command, workspace_root};

mod agent;
mod agent_scan;
mod attached;
mod floor;
mod glibc;
mod loops;
mod mappings;
mod one_trap;
mod own_profiler;
mod python;
mod redis;
mod switches;
use loops::{loop_table, measure_loops};
use redis::{Load, redis_bench, redis_table};

const LIBJEMALLOC: &str = "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2";
/// How long a fixture waits, untimed, for `--pid` to attach: memprobe loads
/// its programs (a second or more of the kernel's verifier) and measures
/// its probes' costs (under a second) before it attaches.
const ATTACH_DELAY_MS: &str = "4000";

/// A C fixture (`tests/fixtures/SOURCE.c`) built as `name` in `out`, with
/// `libs`.
fn build_fixture(out: &Path, source: &str, name: &str, libs: &[&str]) -> Result<PathBuf> {
    let binary = out.join(name);
    run_command(
        Command::new("cc")
            .args(["-O2", "-o"])
            .arg(&binary)
            .arg(workspace_root().join(format!("tests/fixtures/{source}.c")))
            .args(libs),
    )?;
    Ok(binary)
}

/// The malloc/free loop, linked to jemalloc or (`libs` empty) on glibc's.
fn build_loop(out: &Path, name: &str, libs: &[&str]) -> Result<PathBuf> {
    build_fixture(out, "malloc_loop", name, libs)
}

/// Nanoseconds per malloc+free pair printed by the loop (best of `runs`).
fn loop_ns(mut make: impl FnMut() -> Command, runs: usize) -> Result<f64> {
    let mut best = f64::INFINITY;
    for _ in 0..runs {
        let output = make().stderr(Stdio::null()).output()?;
        best = best.min(printed_ns(&output.stdout)?);
    }
    Ok(best)
}

/// The nanoseconds per pair a loop printed last.
fn printed_ns(stdout: &[u8]) -> Result<f64> {
    let text = String::from_utf8_lossy(stdout);
    text.lines()
        .filter_map(|l| l.trim().parse().ok())
        .next_back()
        .with_context(|| format!("no timing in {text:?}"))
}

/// The middle of `values` (the upper one of an even count).
fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    sorted[sorted.len() / 2]
}

/// CPU seconds and peak RSS (KiB) of a live process.
fn usage(pid: u32) -> Usage {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let ticks: f64 = fields.get(11)?.parse::<f64>().ok()? + fields.get(12)?.parse::<f64>().ok()?;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let peak = status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()?;
    Some((ticks / hz, peak))
}

/// memprobe's stderr lines, collected as they come, with when each came.
type Stderr = std::sync::Arc<std::sync::Mutex<Vec<(Instant, String)>>>;

/// Starts memprobe and waits for its line saying it attached; every line
/// is kept.
/// No budget: the bench measures what memprobe costs, unbounded.
fn start_memprobe(memprobe: &Path, args: &[&str]) -> Result<(Child, Stderr)> {
    let mut child = Command::new(memprobe)
        .args(args)
        .args(["--max-overhead", "none"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()?;
    let mut lines = BufReader::new(child.stderr.take().context("stderr")?).lines();
    let kept = Stderr::default();
    for line in lines.by_ref() {
        let line = line?;
        let attached = line.contains("memprobe: attached");
        if let Ok(mut kept) = kept.lock() {
            kept.push((Instant::now(), line));
        }
        if attached {
            // Keep draining stderr so memprobe never blocks on it.
            let sink = kept.clone();
            std::thread::spawn(move || {
                for line in lines.map_while(|l| l.ok()) {
                    if let Ok(mut sink) = sink.lock() {
                        sink.push((Instant::now(), line));
                    }
                }
            });
            return Ok((child, kept));
        }
    }
    let said: Vec<String> = kept
        .lock()
        .map(|k| k.iter().map(|(_, l)| l.clone()).collect())
        .unwrap_or_default();
    bail!("memprobe did not attach: {}", said.join("\n"))
}

/// memprobe's first line containing `text`.
fn line_with(stderr: &Stderr, text: &str) -> Option<String> {
    let lines = stderr.lock().ok()?;
    lines
        .iter()
        .find(|(_, l)| l.contains(text))
        .map(|(_, l)| l.clone())
}

/// When memprobe first said something containing `text`.
fn said(stderr: &Stderr, text: &str) -> Option<Instant> {
    let lines = stderr.lock().ok()?;
    lines
        .iter()
        .find(|(_, l)| l.contains(text))
        .map(|(at, _)| *at)
}

fn stop(child: &mut Child) {
    // SAFETY: signalling our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    let _ = child.wait();
}

/// A part of the bench run alone (while working on it).
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Part {
    /// The malloc/free loops.
    Loops,
    /// A context-switching process with unhit probes.
    Switches,
    /// A loop running jemalloc's own profiler (prof:true).
    OwnProfiler,
    /// redis-server under redis-benchmark, each load.
    Redis,
    /// redis-server under redis-benchmark's own load alone (3-byte values,
    /// not pipelined), in the most rounds.
    RedisDefaultLoad,
    /// redis-server under the other loads: other requests, value sizes and
    /// pipelining.
    RedisOtherLoads,
    /// redis-server under LPUSHes of 3-byte values alone: a list grown
    /// in place, its listpack reallocated now and then.
    RedisLists,
    /// redis-server under HSETs of 4 KiB values alone: requests above
    /// jemalloc's fast path that a thread cache holds.
    RedisMiddleSized,
    /// redis-server under pipelined SET/GET of 3-byte values alone: a
    /// server kept busy, where the traps' indirect costs show.
    RedisPipelined,
    /// redis-server's request latency under SET/GET sent at a fixed rate.
    RedisLatency,
    /// Offline reports of a large profile.
    Offline,
    /// An mmap/munmap loop: what tracing mappings costs.
    Mappings,
    /// The host agent (`--all --track allocations`) beside busy loops.
    Agent,
    /// The host agent's own CPU beside many idle processes with many
    /// mappings.
    AgentScan,
    /// A malloc/free loop on glibc's malloc, attached while it runs: the
    /// one-trap floor, defaults and `--track allocations`.
    Glibc,
    /// A sampled allocation in a Python process against one in C.
    Python,
}

pub fn bench(only: Option<Part>) -> Result<()> {
    let root = workspace_root();
    let out = root.join("target/bench");
    let _ = std::fs::remove_dir_all(&out);
    std::fs::create_dir_all(&out)?;
    let memprobe = root.join("target/release/memprobe");
    let profiles = out.join("profiles");
    std::fs::create_dir_all(&profiles)?;
    let profiles_dir = profiles.to_str().context("path")?.to_owned();
    let runs = |part| only.is_none_or(|only| only == part);

    let started = Instant::now();
    let stolen_before = steal_seconds();
    let mut results = Results::new(out.join("results.md"), only);
    let mut places = None;
    if runs(Part::Loops) {
        let loops = measure_loops(&memprobe, &out, &profiles_dir)?;
        results.add("loops", &loop_table(&loops))?;
        places = Some(loops.attached.places);
    }
    if runs(Part::Mappings) {
        let costs = mappings::mapping_costs(&memprobe, &out, &profiles_dir)?;
        results.add("mappings", &mappings::mapping_table(&costs))?;
    }
    if runs(Part::Agent) {
        let costs = agent::agent_costs(&memprobe, &out, &profiles_dir)?;
        results.add("agent", &agent::agent_table(&costs))?;
    }
    if runs(Part::AgentScan) {
        let costs = agent_scan::scan_costs(&memprobe, &out, &profiles_dir)?;
        results.add("agent-scan", &agent_scan::scan_table(&costs))?;
    }
    if runs(Part::Glibc) {
        let costs = glibc::glibc_costs(&memprobe, &out, &profiles_dir)?;
        results.add("glibc", &glibc::glibc_table(&costs))?;
    }
    if runs(Part::Python) {
        let costs = python::python_costs(&memprobe, &out, &profiles_dir)?;
        results.add("python", &python::python_table(&costs))?;
    }
    if runs(Part::Switches) {
        let result = switches::switches(&memprobe, &out, &profiles_dir)?;
        results.add("switches", &switches::switches_table(&result))?;
    }
    if runs(Part::OwnProfiler) {
        let result = own_profiler::own_profiler(&memprobe, &profiles_dir)?;
        results.add("own-profiler", &own_profiler::own_profiler_table(&result))?;
    }
    let loads: &[Load] = match only {
        None | Some(Part::Redis) => &redis::LOADS,
        Some(Part::RedisDefaultLoad) => &redis::LOADS[..1],
        Some(Part::RedisOtherLoads) => &redis::LOADS[1..],
        Some(Part::RedisLists) => &redis::LOADS[2..3],
        Some(Part::RedisMiddleSized) => &redis::LOADS[3..4],
        Some(Part::RedisPipelined) => &redis::LOADS[4..5],
        Some(_) => &[],
    };
    let latency = runs(Part::RedisLatency);
    if places.is_none() && (!loads.is_empty() || latency) {
        let malloc_loop = build_loop(&out, "malloc_loop", &["-ljemalloc"])?;
        places = Some(floor::memprobe_places(
            &memprobe,
            &malloc_loop,
            LIBJEMALLOC,
        )?);
    }
    let places = places.unwrap_or_default();
    let on_client_cpu = (!loads.is_empty() || latency).then(redis::OnClientCpu::enter);
    if !loads.is_empty() {
        for &load in loads {
            let part = format!(
                "redis {} {} B{}",
                load.tests,
                load.value_bytes,
                match load.pipeline {
                    1 => String::new(),
                    depth => format!(" pipelined {depth}"),
                }
            );
            eprintln!("bench: {part}: redis-server under redis-benchmark");
            let redis = redis_bench(&memprobe, &profiles_dir, &places, load)?;
            results.add(&part, &redis_table(&redis))?;
        }
    }
    if latency {
        eprintln!("bench: redis-server's latency under SET/GET at a fixed rate");
        let latency = redis::redis_latency(&memprobe, &profiles_dir, &places)?;
        results.add("redis-latency", &redis::latency_table(&latency))?;
    }
    drop(on_client_cpu);
    if runs(Part::Offline) {
        eprintln!("bench: offline reports of a large program's profile");
        results.add("offline", &offline_bench(&memprobe, &out)?)?;
    }
    let minutes = started.elapsed().as_secs_f64() / 60.0;
    let stolen = match (stolen_before, steal_seconds()) {
        (Some(before), Some(after)) => {
            let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
            let share = (after - before) / (started.elapsed().as_secs_f64() * cpus as f64);
            format!(
                " The hypervisor held back {:.2}% of the guest's CPU time over it (steal), {:.1} s in all.",
                100.0 * share,
                after - before
            )
        }
        _ => String::new(),
    };
    let parts = results.minutes_per_part();
    results.write(&format!(
        "\nThe run took {minutes:.0} minutes ({parts}).{stolen}\n"
    ))?;
    println!("{}", results.text);
    eprintln!("bench: results in {}", results.path.display());
    Ok(())
}

/// CPU time the hypervisor gave to others while the guest wanted it
/// (`/proc/stat`'s steal, all CPUs), in seconds: a host that steals in
/// bursts lengthens every latency tail, profiled or not.
fn steal_seconds() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let ticks: f64 = stat
        .lines()
        .next()?
        .split_whitespace()
        .nth(8)?
        .parse()
        .ok()?;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    Some(ticks / hz)
}

/// The tables measured so far, written out after each part, so that a run
/// cut short keeps what it measured; and how long each part took, so that
/// a run can be planned.
struct Results {
    path: PathBuf,
    text: String,
    /// When the last part ended (or the run began).
    since: Instant,
    /// Each part's name and seconds, in order.
    took: Vec<(String, f64)>,
}

impl Results {
    /// Headed with what was measured and when, for the docs that quote it.
    fn new(path: PathBuf, only: Option<Part>) -> Self {
        let said = |program: &str, args: &[&str]| {
            Command::new(program)
                .args(args)
                .output()
                .ok()
                .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
                .unwrap_or_default()
        };
        let part = only
            .and_then(|p| p.to_possible_value())
            .map(|p| format!(" --only {}", p.get_name()))
            .unwrap_or_default();
        let text = format!(
            "`cargo xtask bench{part}` at commit {}, begun {}, Linux {}.\n\n",
            said("git", &["describe", "--always", "--dirty"]),
            said("date", &["-u", "+%Y-%m-%d %H:%M UTC"]),
            said("uname", &["-r"]),
        );
        Results {
            path,
            text,
            since: Instant::now(),
            took: Vec::new(),
        }
    }

    /// `part`'s table, measured since the last part ended.
    fn add(&mut self, part: &str, table: &str) -> Result<()> {
        let now = Instant::now();
        let seconds = now.duration_since(self.since).as_secs_f64();
        self.took.push((part.to_owned(), seconds));
        self.since = now;
        self.write(table)
    }

    fn write(&mut self, text: &str) -> Result<()> {
        self.text.push_str(text);
        std::fs::write(&self.path, &self.text)?;
        Ok(())
    }

    /// "loops 6, mappings 2, ...": each part's minutes.
    fn minutes_per_part(&self) -> String {
        let parts: Vec<String> = self
            .took
            .iter()
            .map(|(part, seconds)| format!("{part} {:.0}", seconds / 60.0))
            .collect();
        format!("minutes per part: {}", parts.join(", "))
    }
}

/// CPU seconds and peak RSS in KiB of a process.
type Usage = Option<(f64, u64)>;

/// Seconds of the fastest of `runs` runs of `command`.
fn best_time(mut make: impl FnMut() -> Command, runs: usize) -> Result<f64> {
    let mut best = f64::INFINITY;
    for _ in 0..runs {
        let started = Instant::now();
        let status = make()
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()?;
        if !status.success() {
            bail!("{:?} failed", make());
        }
        best = best.min(started.elapsed().as_secs_f64());
    }
    Ok(best)
}

/// A JVM's start-up profiled at 4 KiB (libjvm.so is 20 MB with a large
/// symbol table): jeprof --collapsed (binutils) against memprobe's own
/// symbolization (blazesym), same profile, same machine, one run.
fn offline_bench(memprobe: &Path, out: &Path) -> Result<String> {
    let java = PathBuf::from("/usr/lib/jvm/java-17-openjdk-amd64/bin/java");
    let dir = out.join("jvm");
    std::fs::create_dir_all(&dir)?;
    let status = Command::new(memprobe)
        .args(["--sample-interval", "4096", "--format", "heap", "-o"])
        .arg(&dir)
        .arg("--")
        .arg(&java)
        .args(["-Xshare:off", "-XX:+UseSerialGC", "-version"])
        .env("LD_PRELOAD", LIBJEMALLOC)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()?;
    if !status.success() {
        bail!("profiling the JVM failed");
    }
    let heap = std::fs::read_dir(&dir)?
        .flatten()
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|e| e == "heap"))
        .context("no JVM profile")?;
    let text = std::fs::read_to_string(&heap)?;
    let stacks = text.lines().filter(|l| l.starts_with('@')).count();
    let jeprof = best_time(
        || {
            let mut c = Command::new("jeprof");
            c.arg("--collapsed").arg(&java).arg(&heap);
            c
        },
        3,
    )?;
    let folded = best_time(
        || {
            let mut c = Command::new(memprobe);
            c.args(["convert", "--to", "folded", "-o", "/dev/null"])
                .arg(&heap);
            c
        },
        3,
    )?;
    let report = best_time(
        || {
            let mut c = Command::new(memprobe);
            c.arg("report").arg(&heap);
            c
        },
        3,
    )?;
    Ok(format!(
        "\n| offline, JVM start-up profile ({stacks} stacks, libjvm.so) | seconds | vs jeprof |\n|---|---|---|\n\
         | `jeprof --collapsed` | {jeprof:.2} | 1.0x |\n\
         | `memprobe convert --to folded` | {folded:.3} | {:.0}x faster |\n\
         | `memprobe report` | {report:.3} | {:.0}x faster |\n",
        jeprof / folded,
        jeprof / report
    ))
}
