//! redis-server under redis-benchmark, with and without memprobe: the
//! request rate, redis-server's CPU per request, and what memprobe said it
//! added.
//!
//! Two redis-servers, twins filled alike, take turns in a crossover: while
//! one has memprobe (or the floor's counters) attached, the other, with
//! nothing attached, is its baseline, in rounds of runs in the order with,
//! without, without, with; then they swap roles. Runs a few seconds apart
//! cancel the VM's drift (redis-server's CPU for the same requests wanders
//! by up to 19% over minutes here), and each twin being once profiled and
//! once baseline, for as many rounds, cancels any lasting difference
//! between the two (7% was seen): the cost is the geometric mean of the
//! rounds' ratios. The last rows put the one-trap floor on the baseline
//! twin instead of nothing: memprobe against the floor in the same rounds.
use std::{
    io::{Read, Write},
    net::TcpStream,
    path::Path,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};

mod latency;
mod open_loop;
mod table;
mod twins;
mod window_trace;
pub(super) use latency::{latency_table, redis_latency};
use table::cpu_per_request;
pub(super) use table::redis_table;
use twins::{Server, Twins, crossover};

use super::{
    Usage,
    attached::ONE_TRAP,
    floor::{CountsHits, Place},
    one_trap::OneTrap,
    start_memprobe, stop, usage,
};

/// Where the profiled twin's memprobe serves /metrics, read for the time it
/// says it added over the measured runs.
const LISTEN: &str = "127.0.0.1:6071";

/// redis-server under redis-benchmark without memprobe, with the one-trap
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
    /// The runs round by round: how much a round's ratio wanders says how
    /// far the totals can be trusted.
    rounds: Vec<Round>,
    /// memprobe's report of the time it added over the `with` runs.
    reported: Option<f64>,
    /// memprobe's own CPU and peak RSS at the end of the half.
    own: Usage,
}

impl Half {
    /// All the runs of the twin with something attached.
    fn with(&self) -> Runs {
        self.total(|round| round.with)
    }

    /// All the runs of the twin without.
    fn without(&self) -> Runs {
        self.total(|round| round.without)
    }

    fn total(&self, side: fn(&Round) -> Runs) -> Runs {
        let mut total = Runs::default();
        for round in &self.rounds {
            total.merge(&side(round));
        }
        total
    }
}

/// One round of runs in turn: with, without, without, with.
#[derive(Default, Clone, Copy)]
struct Round {
    with: Runs,
    without: Runs,
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
    /// The runs' 99th percentile request latencies in milliseconds, summed.
    p99s_ms: f64,
}

impl Runs {
    fn add(&mut self, run: Run) {
        self.count += 1;
        self.rates += run.rate;
        self.cpu += run.cpu;
        self.sleeps += run.sleeps;
        self.p99s_ms += run.p99_ms;
    }

    fn merge(&mut self, other: &Runs) {
        self.count += other.count;
        self.rates += other.rates;
        self.cpu += other.cpu;
        self.sleeps += other.sleeps;
        self.p99s_ms += other.p99s_ms;
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

    fn p99_ms(&self) -> f64 {
        self.p99s_ms / self.count.max(1) as f64
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
    /// Its tests' 99th percentile latency in milliseconds, averaged: a
    /// window makes the requests it catches slower while it lasts.
    p99_ms: f64,
}

/// When a row's timed runs start, against memprobe's attach.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Timed {
    /// After warm-up runs under load: time for the windows to narrow to
    /// what the calls cost.
    Settled,
    /// From the attach on, to a server idle until then: its load starts
    /// once memprobe is there, a burst that began with memprobe to it.
    FromIdleAttach,
    /// From the attach on, to a server already under load (as a server in
    /// production is): the load that ran through the attach stops as it
    /// is announced, and the timed runs follow at once.
    FromBusyAttach,
}

/// Warm-up runs of each twin under load before the timed ones of
/// [`Timed::Settled`].
const WARMUP_RUNS: usize = 2;

/// What rows timed from the attach span at least: rounds go on until then
/// (a load's three rounds of LPUSH take some 20 s, a third of it).
const FIRST_MINUTE: Duration = Duration::from_secs(60);

/// The modes set against no profiler, settled: (label, memprobe's flags).
/// Each row has memprobe's report of what it added beside the CPU the
/// server gained. The goals are read from the rows against the one-trap
/// floor ([`AGAINST_FLOOR`]): a row here set against the floor's, taken
/// minutes apart, carries both rows' drift.
const MODES: [(&str, &[&str]); 3] = [
    ("memprobe, `--sampling entry`", &["--sampling", "entry"]),
    ("memprobe, default (malloc in windows)", &[]),
    (
        "memprobe, `--track allocations`",
        &["--track", "allocations"],
    ),
];

/// memprobe at defaults against the one-trap floor on the baseline twin, in
/// the same rounds: (label, when timed). Rows taken minutes apart ran on
/// a host whose speed differed (one pipelined row's baseline used 4.46 s a
/// run, the floor's 3.12 s), so a row's ratio over another's carried both
/// rows' drift; here it cancels, as a baseline's does.
const AGAINST_FLOOR: [(&str, Timed); 3] = [
    (
        "memprobe, default, against the one-trap floor on its twin in the same rounds (its ratios are over the floor's; added CPU s above the floor's)",
        Timed::Settled,
    ),
    (
        "memprobe, default, timed from its attach on, against the one-trap floor on its twin in the same rounds",
        Timed::FromIdleAttach,
    ),
    (
        "memprobe, default, attached to the server under load, timed from its attach on, against the one-trap floor on its twin in the same rounds",
        Timed::FromBusyAttach,
    ),
];

/// What redis-benchmark sends.
#[derive(Clone, Copy)]
pub(super) struct Load {
    /// redis-benchmark's tests run (`-t`): `set,get`, `lpush`, `hset`.
    pub tests: &'static str,
    /// The size of the values written.
    pub value_bytes: u32,
    /// Requests each client sends before it waits for replies (`-P`): 1, a
    /// server that sleeps between requests; 16, one kept busy, as a
    /// saturated production server is.
    pub pipeline: u32,
    /// Rounds of runs in turn (with, without, without, with) that each
    /// half measures: more rounds, a narrower interval.
    pub rounds: u32,
}

impl Load {
    /// SETs (and as many GETs) in one run: two to four seconds of work
    /// either way, redis-server's CPU time counted to the 10 ms tick (some
    /// 0.5% of a run). Runs of twice that took the whole bench past three
    /// hours on a slow host; at this length a load's intervals are some
    /// 1.5x as wide (redis-benchmark's own load on one host: the floor's
    /// ±4% and ±8%, the defaults' ±9% and ±8%).
    fn requests(&self) -> u32 {
        if self.pipeline > 1 { 300_000 } else { 100_000 }
    }
}

/// The loads redis-server is measured under. First redis-benchmark's own
/// (SET and GET of 3-byte values, not pipelined), in the most rounds: the
/// load the goals (docs/overhead.md) are stated for. The others take
/// three: one round could not tell 1.12x from 1.05x (their twin servers
/// alone differed by up to 1.13x; LPUSH's `--track allocations` read
/// 1.03x, 1.15x and 1.06x in three runs of one round, 512-byte SETs'
/// 1.06x in one). Then other shapes a
/// server's requests take, each request allocating the same sizes: SETs
/// of 512-byte values, LPUSHes onto one list, HSETs of 4 KiB values (above
/// jemalloc's fast path: its slow path sees each); and 3-byte values
/// pipelined, which keep the server busy: where the traps' indirect costs
/// show.
pub(super) const LOADS: [Load; 5] = [
    Load {
        tests: "set,get",
        value_bytes: 3,
        pipeline: 1,
        rounds: 4,
    },
    Load {
        tests: "set,get",
        value_bytes: 512,
        pipeline: 1,
        rounds: 3,
    },
    Load {
        tests: "lpush",
        value_bytes: 3,
        pipeline: 1,
        rounds: 3,
    },
    Load {
        tests: "hset",
        value_bytes: 4096,
        pipeline: 1,
        rounds: 3,
    },
    Load {
        tests: "set,get",
        value_bytes: 3,
        pipeline: 16,
        rounds: 3,
    },
];

/// Twin redis-servers started afresh, filled, and measured under `load`
/// without memprobe, with the one-trap floor, with memprobe in each mode
/// and with memprobe at defaults against the floor.
pub(super) fn redis_bench(
    memprobe: &Path,
    profiles_dir: &str,
    places: &[Place],
    load: Load,
) -> Result<RedisResult> {
    let running = Twins::start(load)?;
    let twins = running.servers;
    let mut unprofiled = Half::default();
    in_turn(twins, &mut unprofiled, None)?;
    let mut rows = Vec::new();
    let measured = |rows: &mut Vec<Row>, label, halves| {
        let row = Row { label, halves };
        eprintln!(
            "bench:   {label}: CPU per request {}",
            cpu_per_request(&row)
        );
        rows.push(row);
    };
    let halves = floor_halves(twins, &places[1])?;
    measured(&mut rows, ONE_TRAP, halves);
    for (label, flags) in MODES {
        let halves = crossover(twins, |pair, half| {
            attached_half(
                memprobe,
                profiles_dir,
                pair,
                (flags, Timed::Settled),
                true,
                half,
            )
        })?;
        measured(&mut rows, label, halves);
    }
    for (label, timed) in AGAINST_FLOOR {
        let halves = crossover(twins, |pair, half| {
            let floor = OneTrap::attach(pair[1].pid, &places[1])?;
            // Not its report: that includes the frees the floor pays.
            attached_half(memprobe, profiles_dir, pair, (&[], timed), false, half)?;
            if floor.hits()? == 0 {
                bail!("the floor beside memprobe counted no hit in redis-server");
            }
            Ok(())
        })?;
        measured(&mut rows, label, halves);
    }
    Ok(RedisResult {
        load,
        unprofiled,
        rows,
    })
}

/// Both halves of a crossover with the one-trap floor at `free_place` on
/// the first twin of the pair.
fn floor_halves(twins: [Server; 2], free_place: &Place) -> Result<[Half; 2]> {
    crossover(twins, |pair, half| {
        let probes = OneTrap::attach(pair[0].pid, free_place)?;
        in_turn(pair, half, None)?;
        if probes.hits()? == 0 {
            bail!("the floor's probes counted no hit in redis-server");
        }
        Ok(())
    })
}

/// Rounds of runs of `pair[0]` (with) and `pair[1]` (without), each in
/// the order with, without, without, with: a drift that is steady over a
/// round cancels out. The load's rounds, and more until `until` if given.
fn in_turn(pair: [Server; 2], half: &mut Half, until: Option<Instant>) -> Result<()> {
    let mut rounds = 0;
    while rounds < pair[0].load.rounds || until.is_some_and(|until| Instant::now() < until) {
        rounds += 1;
        let mut round = Round::default();
        for profiled in [true, false, false, true] {
            if profiled {
                round.with.add(measure_run(pair[0])?);
            } else {
                round.without.add(measure_run(pair[1])?);
            }
        }
        half.rounds.push(round);
    }
    Ok(())
}

/// One redis-benchmark run: its rate, redis-server's CPU seconds and how
/// often its main thread slept.
fn measure_run(server: Server) -> Result<Run> {
    let cpu = || usage(server.pid).map_or(0.0, |(cpu, _)| cpu);
    let (cpu_before, sleeps_before) = (cpu(), sleeps(server.pid));
    let (rate, p99_ms) = rate_and_p99(server)?;
    Ok(Run {
        rate,
        cpu: cpu() - cpu_before,
        sleeps: sleeps(server.pid).saturating_sub(sleeps_before),
        p99_ms,
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

/// memprobe attached to `pair[0]` in one mode, then the runs in turn,
/// `timed` from when; with `report`, memprobe's report of what it added
/// over them, read from its /metrics just before and after.
fn attached_half(
    memprobe: &Path,
    profiles_dir: &str,
    pair: [Server; 2],
    (flags, timed): (&[&str], Timed),
    report: bool,
    half: &mut Half,
) -> Result<()> {
    let pid = pair[0].pid.to_string();
    let mut args = vec!["--pid", &pid, "-o", profiles_dir, "--listen", LISTEN];
    args.extend_from_slice(flags);
    let mut through_attach = match timed {
        Timed::FromBusyAttach => Some(start_load(pair[0])?),
        Timed::Settled | Timed::FromIdleAttach => None,
    };
    let started = start_memprobe(memprobe, &args);
    if let Some(busy) = &mut through_attach {
        let _ = busy.kill();
        let _ = busy.wait();
    }
    let (mut probe, stderr) = started?;
    // Timed from the attach: over its first minute at least.
    let until = (timed != Timed::Settled).then(|| Instant::now() + FIRST_MINUTE);
    if timed == Timed::Settled {
        // Both twins, so that the baseline does not come to its first timed
        // run from idling while the profiled twin comes from work.
        for _ in 0..WARMUP_RUNS {
            for server in pair {
                measure_run(server)?;
            }
        }
    }
    drop(stderr);
    let added = || {
        // /metrics is refreshed every second; redis is idle meanwhile.
        std::thread::sleep(Duration::from_millis(1500));
        scraped_added_seconds(pair[0].pid)
    };
    if report {
        let start = added();
        in_turn(pair, half, until)?;
        let end = added();
        half.reported = start.zip(end).map(|(start, end)| end - start);
    } else {
        in_turn(pair, half, until)?;
    }
    half.own = usage(probe.id());
    stop(&mut probe);
    Ok(())
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

/// One redis-benchmark run's requests per second and 99th percentile
/// latency in milliseconds, each the mean over its tests.
fn rate_and_p99(server: Server) -> Result<(f64, f64)> {
    let output = load(server, server.load.requests()).output()?;
    let text = String::from_utf8_lossy(&output.stdout);
    parse_csv(&text).with_context(|| format!("no rate in redis-benchmark output: {text}"))
}

/// `--csv` output: a header naming the columns, then a line per test.
fn parse_csv(text: &str) -> Option<(f64, f64)> {
    let mut lines = text.lines().map(|line| {
        line.split(',')
            .map(|field| field.trim().trim_matches('"'))
            .collect::<Vec<_>>()
    });
    let header = lines.next()?;
    let column = |name: &str| header.iter().position(|field| *field == name);
    let (rate, p99) = (column("rps")?, column("p99_latency_ms")?);
    let tests: Vec<(f64, f64)> = lines
        .filter_map(|fields| {
            Some((
                fields.get(rate)?.parse().ok()?,
                fields.get(p99)?.parse().ok()?,
            ))
        })
        .collect();
    if tests.is_empty() {
        return None;
    }
    let count = tests.len() as f64;
    Some((
        tests.iter().map(|t| t.0).sum::<f64>() / count,
        tests.iter().map(|t| t.1).sum::<f64>() / count,
    ))
}

/// The server's load started in the background, one second ago, with
/// requests enough to outlast memprobe's start.
fn start_load(server: Server) -> Result<Child> {
    let child = load(server, 20 * server.load.requests())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("starting redis-benchmark")?;
    std::thread::sleep(Duration::from_secs(1));
    Ok(child)
}

/// redis-benchmark sending the server `requests` of its load (of each
/// test), on the CPU redis-server does not run on.
fn load(server: Server, requests: u32) -> Command {
    let load = server.load;
    let mut command = Command::new("taskset");
    command
        .args(["-c", "1", "redis-benchmark", "-h", "127.0.0.1"])
        .args(["-p", server.port, "-t", load.tests])
        .args(["-n", &requests.to_string()])
        .args(["-d", &load.value_bytes.to_string()])
        .args(["-P", &load.pipeline.to_string()])
        // Random keys, as real clients' are.
        .args(["-r", "1000000", "-q", "--csv"]);
    command
}

/// The CPU the clients run on: the one redis-server leaves free.
const CLIENT_CPU: usize = 1;

/// Keeps the calling thread on [`CLIENT_CPU`], off redis-server's.
fn pin_to_client_cpu() {
    // SAFETY: a zeroed cpu_set_t is an empty set; the calls change this
    // thread's affinity alone.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(CLIENT_CPU, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
    }
}

/// The bench's own thread kept on [`CLIENT_CPU`] while the redis parts run,
/// and what it starts there too but the servers (`taskset -c 0`): its work
/// between runs (reading a run's latencies and window trace, starting
/// memprobe) held a woken redis-server for 0.19 s over a latency part.
/// Back on the CPUs it had when dropped.
pub(super) struct OnClientCpu(libc::cpu_set_t);

impl OnClientCpu {
    pub(super) fn enter() -> Self {
        // SAFETY: a zeroed cpu_set_t, filled in by the kernel.
        let mut before: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        // SAFETY: a whole cpu_set_t for the calling thread.
        unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut before) };
        pin_to_client_cpu();
        Self(before)
    }
}

impl Drop for OnClientCpu {
    fn drop(&mut self) {
        // SAFETY: a whole cpu_set_t for the calling thread.
        unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &self.0) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn csv_gives_the_mean_rate_and_p99_over_tests() {
        let text = "\"test\",\"rps\",\"avg_latency_ms\",\"min_latency_ms\",\"p50_latency_ms\",\"p95_latency_ms\",\"p99_latency_ms\",\"max_latency_ms\"\n\
                    \"SET\",\"50000.00\",\"0.629\",\"0.120\",\"0.615\",\"0.975\",\"1.159\",\"1.303\"\n\
                    \"GET\",\"40000.00\",\"0.664\",\"0.184\",\"0.623\",\"1.063\",\"2.441\",\"2.671\"\n";
        let (rate, p99) = parse_csv(text).unwrap();
        assert_eq!(rate, 45000.0);
        assert!((p99 - 1.8).abs() < 1e-9, "{p99}");
        assert_eq!(parse_csv("SET: 5000 requests per second\n"), None);
    }
}
