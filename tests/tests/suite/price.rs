//! The price of profiling: the time memprobe reports adding, from per-hit
//! costs it measures on this host at start and again during the run,
//! agrees with what a target actually gains.
use std::{
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use tests::*;

/// Nanoseconds per malloc+free pair the loop prints last.
fn ns_per_pair(output: &std::process::Output) -> f64 {
    let text = String::from_utf8_lossy(&output.stdout);
    text.lines()
        .filter_map(|l| l.trim().parse().ok())
        .next_back()
        .unwrap_or_else(|| panic!("no timing in {text:?}"))
}

/// The loop's nanoseconds per pair for `pairs` pairs, unprofiled: the best
/// of three.
fn unprofiled_ns_per_pair(pairs: &str) -> f64 {
    (0..3)
        .map(|_| {
            ns_per_pair(
                &Command::new(malloc_loop_fixture())
                    .arg(pairs)
                    .output()
                    .unwrap(),
            )
        })
        .fold(f64::INFINITY, f64::min)
}

/// The seconds the summary's cost line estimates memprobe added.
fn reported_seconds(stderr: &str) -> f64 {
    number_after(stderr, "estimated time added to the profiled processes: ")
}

/// Profiled runs a price test takes: its verdict is their median ratio of
/// reported to gained time. On this VM one measurement of the costs is a
/// snapshot of a host whose speed changes from second to second (plain
/// code at 1.3, 2.9 or 3.5 ns a call, traps slowing with it): a run priced
/// at its first measurement alone read 0.56 to 1.45 of what the loop
/// gained, and a fresh-clone CI run failed two tests on median ratios of
/// 1.40 and 1.44 (2026-11-28). Hits are now priced at the mean of
/// measurements taken 1 s, 2 s, 4 s... apart, and the loops run long
/// enough for several: the four tests' twelve runs then read 0.86 to
/// 1.12, one 1.42.
const PRICE_RUNS: usize = 3;

/// The median of reported-over-gained ratios.
fn median_ratio(mut ratios: Vec<f64>) -> f64 {
    ratios.sort_by(f64::total_cmp);
    ratios[ratios.len() / 2]
}

/// The summary's "estimated time added" against what the loop gained, as
/// the loop itself times it: within 30%.
#[test]
fn reported_cost_agrees_with_the_time_a_loop_gains() {
    let _guard = exclusive();
    let ratio = reported_over_gained("reported_cost", &[]);
    assert_within("reported over gained", ratio, 1.0, 0.30);
}

/// The same where samples make much of the cost: a trap at every
/// allocation and a sample every 4 KiB (some 45 calls, as densely as a
/// window samples), each sample some microseconds of stack copy and
/// record. Priced as the kernel timed them, within 25%: 83% to 105% of the
/// time gained in eight runs here. The hits alone came to 73% to 81%; with
/// every sample waking memprobe (a self-interrupt, not priced), 78% to 86%.
#[test]
fn densely_sampled_calls_are_priced_as_the_kernel_timed_them() {
    let _guard = exclusive();
    let args = [
        "--sampling",
        "entry",
        "--track",
        "allocations",
        "--sample-interval",
        "4096",
    ];
    let ratio = reported_over_gained("dense_samples", &args);
    assert_within("reported over gained", ratio, 1.0, 0.25);
}

/// Launches the malloc loop under memprobe with `args` (no budget),
/// [`PRICE_RUNS`] times: the median ratio of the seconds its summary says
/// it added to the seconds the loop gained over its unprofiled runs.
fn reported_over_gained(name: &str, args: &[&str]) -> f64 {
    let out = output_dir(name);
    // Some 6 s profiled: a run long enough for the costs to be measured
    // again a few times, as a run of minutes has them.
    const PAIRS: f64 = 4_000_000.0;
    let pairs = format!("{PAIRS}");
    let ratios = (0..PRICE_RUNS)
        .map(|_| {
            let plain = unprofiled_ns_per_pair(&pairs);
            let profiled = Command::new(memprobe_bin())
                .args(["--max-overhead", "none", "--format", "heap", "-o"])
                .arg(&out)
                .args(args)
                .arg("--")
                .arg(malloc_loop_fixture())
                .arg(&pairs)
                .output()
                .unwrap();
            let stderr = String::from_utf8_lossy(&profiled.stderr);
            assert!(profiled.status.success(), "{stderr}");
            assert!(
                stderr.contains("per hit, measured on this host"),
                "{stderr}"
            );
            let gained = (ns_per_pair(&profiled) - plain) * PAIRS / 1e9;
            let reported = reported_seconds(&stderr);
            eprintln!("{name}: reported {reported:.3} s, gained {gained:.3} s");
            reported / gained
        })
        .collect();
    median_ratio(ratios)
}

/// Two processes of one binary, profiled together: the kernel runs both
/// processes' uprobe sessions on the shared libjemalloc, and each one's
/// session, filtered out in the other, asks for the return half of every
/// call there. memprobe says so, and counts those returns in its report,
/// which stays within 30% of what the working loop gained (102% to 104% of
/// it in three runs here, the forced returns priced as calibrated; 96% to
/// 120% priced as return halves; not counted, 61% to 79%, failing 3 runs
/// in 5).
#[test]
fn returns_forced_by_another_profiled_process_are_said_and_counted() {
    forced_returns_are_said_and_counted("forced_returns", Profilers::One);
}

/// The same with each process profiled by a memprobe of its own: the
/// working one's memprobe finds the other's sessions among the kernel's
/// links.
#[test]
fn returns_forced_by_another_memprobe_are_said_and_counted() {
    forced_returns_are_said_and_counted("forced_by_another", Profilers::Two);
}

/// Whether one memprobe profiles both processes, or one each.
#[derive(PartialEq)]
enum Profilers {
    One,
    Two,
}

fn forced_returns_are_said_and_counted(test: &str, profilers: Profilers) {
    let _guard = exclusive();
    let ratios = (0..PRICE_RUNS)
        .map(|_| forced_returns_reported_over_gained(test, &profilers))
        .collect();
    assert_within("reported over gained", median_ratio(ratios), 1.0, 0.30);
}

/// One run of [`forced_returns_are_said_and_counted`]: its ratio of
/// reported to gained time, once memprobe said the returns were forced.
fn forced_returns_reported_over_gained(test: &str, profilers: &Profilers) -> f64 {
    let out = output_dir(test);
    const PAIRS: f64 = 1_000_000.0;
    const DELAY_MS: u64 = 6000;
    let pairs = format!("{PAIRS}");
    let plain = unprofiled_ns_per_pair(&pairs);
    // The idle one sleeps through the run; the working one waits for
    // memprobe to attach, then runs its pairs.
    let mut idle = Command::new(malloc_loop_fixture())
        .arg("1")
        .env("FIXTURE_DELAY_MS", "120000")
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let idle_arg = idle.id().to_string();
    // Its own memprobe attaches at once: not before it loaded jemalloc.
    wait_until_mapped(idle.id(), "libjemalloc");
    let options = ["--sampling", "entry", "--max-overhead", "none"];
    let other_out = out.join("other");
    let other = (*profilers == Profilers::Two).then(|| {
        let dir = ["--format", "heap", "-o", other_out.to_str().unwrap()];
        let mut other = Memprobe::start(&[&["--pid", &idle_arg][..], &options, &dir].concat());
        other.wait_attached();
        other
    });
    let started = Instant::now();
    let working = Command::new(malloc_loop_fixture())
        .arg(&pairs)
        .env("FIXTURE_DELAY_MS", DELAY_MS.to_string())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let working_arg = working.id().to_string();
    wait_until_mapped(working.id(), "libjemalloc");
    let mut pids = vec!["--pid", &working_arg];
    if other.is_none() {
        pids.extend(["--pid", &idle_arg]);
    }
    let dir = ["--format", "heap", "-o", out.to_str().unwrap()];
    let mut memprobe = Memprobe::start(&[&pids[..], &options, &dir].concat());
    memprobe.wait_attached();
    let attached_after = started.elapsed();
    let timed = working.wait_with_output().unwrap();
    let stderr = memprobe.stop();
    if let Some(other) = other {
        other.stop();
    }
    let _ = idle.kill();
    let _ = idle.wait();
    assert!(
        attached_after < Duration::from_millis(DELAY_MS - 1000),
        "attached {attached_after:?} after the loop started: its first pairs went unprobed"
    );
    let said = format!(
        "pid {working_arg} maps /usr/lib/x86_64-linux-gnu/libjemalloc.so.2 as another profiled process does: each call of its malloc"
    );
    assert!(stderr.contains(&said), "{stderr}");
    let gained = (ns_per_pair(&timed) - plain) * PAIRS / 1e9;
    let reported = reported_seconds(&stderr);
    eprintln!("reported {reported:.3} s, gained {gained:.3} s\n{stderr}");
    reported / gained
}

/// The costs in a line that prints them: "per hit, measured on this host:
/// ... µs a forced return".
fn costs_in(line: &str) -> &str {
    const LAST: &str = "a forced return";
    let start = line.find("per hit, measured on this host");
    let end = line.find(LAST).map(|end| end + LAST.len());
    match (start, end) {
        (Some(start), Some(end)) if start < end => &line[start..end],
        _ => panic!("no costs in {line:?}"),
    }
}

/// The emulated probe's cost in µs, in costs as [`costs_in`] gives them.
fn emulated_micros(costs: &str) -> f64 {
    number_after(costs, ": ")
}

/// `--recalibrate-every`: the per-hit costs are measured again while the
/// run goes on (in the background: the loop keeps running), each time
/// near the first measurement; hits are priced at the mean of the
/// measurements, which the summary gives; and no calibration copy
/// outlives memprobe. A measurement takes seconds on a
/// host the loop and memprobe keep busy (the next is due 2 s after it
/// ends): the loop runs 14 s, where 7 s once left room for one only.
#[test]
fn costs_are_measured_again_during_the_run() {
    let _guard = exclusive();
    let out = output_dir("recalibrated");
    let looping = malloc_loop_fixture();
    let args = [
        "--recalibrate-every",
        "2s",
        "--max-overhead",
        "none",
        "-v",
        "--format",
        "heap",
        "-o",
        out.to_str().unwrap(),
        "--",
        looping.to_str().unwrap(),
        "0",
        "14",
    ];
    let (status, stderr) = run_memprobe(&args, &[]);
    assert!(status.success(), "{stderr}");
    let first = stderr
        .lines()
        .find(|l| l.starts_with("memprobe: probe costs: "))
        .map(costs_in)
        .unwrap_or_else(|| panic!("no first measurement in {stderr}"));
    let again: Vec<&str> = stderr
        .lines()
        .filter(|l| l.starts_with("memprobe: probe costs measured again: "))
        .map(costs_in)
        .collect();
    assert!(again.len() >= 2, "{stderr}");
    for costs in &again {
        let ratio = emulated_micros(costs) / emulated_micros(first);
        assert!((0.5..2.0).contains(&ratio), "{first} then {costs}");
    }
    // Hits are priced at the mean of the measurements (eight at most, more
    // than this run takes), which the last line gives after its own, as
    // does the summary.
    let mean = stderr
        .lines()
        .rfind(|l| l.starts_with("memprobe: probe costs measured again: "))
        .and_then(|l| l.split_once("; hits priced from now on at the mean of the last "))
        .map(|(_, mean)| costs_in(mean))
        .unwrap_or_else(|| panic!("no mean in {stderr}"));
    let summary = stderr
        .lines()
        .find(|l| l.starts_with("memprobe: cost per hit"))
        .map(costs_in)
        .unwrap_or_else(|| panic!("no cost line in {stderr}"));
    assert_eq!(summary, mean, "{stderr}");
    let measured: Vec<f64> = [first]
        .iter()
        .chain(&again)
        .map(|c| emulated_micros(c))
        .collect();
    let average = measured.iter().sum::<f64>() / measured.len() as f64;
    assert!(
        (emulated_micros(mean) - average).abs() <= 0.01,
        "{mean} is not the mean of {measured:?}"
    );
    let copies = processes_running(&memprobe_bin());
    assert!(copies.is_empty(), "calibration copies left: {copies:?}");
}

/// The copies timed again while a run goes on yield the CPU to every
/// other task (`SCHED_IDLE`): their loops, some 0.15 s of a CPU each,
/// held a server's requests up for up to 4 ms at a time (overhead.md's
/// latency table). Each copy's last reading counts: its policy is set as
/// it starts, before it is asked to time anything.
#[test]
fn costs_measured_again_yield_the_cpu_to_the_host() {
    let _guard = shared();
    let out = output_dir("recalibration_idle");
    let fixture = Fixture::start(&sites_fixture(), &[]);
    let memprobe = Memprobe::attach(&fixture, &out, &[]);
    // Measured again 1 s after the start, then 2 s after that one ended.
    let mut last_policy = std::collections::HashMap::new();
    let until = Instant::now() + Duration::from_secs(5);
    while Instant::now() < until {
        for (pid, policy) in children_policy(memprobe.pid()) {
            last_policy.insert(pid, policy);
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let stderr = memprobe.stop();
    assert!(!last_policy.is_empty(), "no copy seen: {stderr}");
    assert!(
        last_policy.values().all(|&p| p == libc::SCHED_IDLE as i64),
        "{last_policy:?}"
    );
}

/// The scheduling policy of each child of `parent`.
fn children_policy(parent: u32) -> Vec<(u32, i64)> {
    all_pids()
        .into_iter()
        .filter_map(|pid| {
            let fields = stat_fields(pid)?;
            // ppid and policy, the 4th and 41st fields.
            let ppid: u32 = fields.get(1)?.parse().ok()?;
            let policy: i64 = fields.get(38)?.parse().ok()?;
            (ppid == parent).then_some((pid, policy))
        })
        .collect()
}

/// Before 6.10 (played here with `MEMPROBE_KERNEL_LACKS=uprobe-multi`)
/// probes are perf events bound to the profiled process's main thread,
/// which the kernel switches with it at each context switch, hit or not:
/// a pipe ping-pong that never calls its allocator is priced by those
/// switches, within 30% of the CPU it gained (its two processes'), and the
/// cost line says so (0 s was reported before they were counted). Plain and
/// profiled runs take turns, three each, and the median of the three
/// ratios is judged. The estimate once came out 40% high: the calibration
/// timed the switches over too few round trips, in an order a drift of the
/// host's speed did not cancel. Later it and this test timed the switched
/// thread's CPU alone, which holds only what the kernel does switching it
/// in (switching it out is charged to the task switched in): half the
/// price, at a share that varied from run to run (a fresh-clone run judged
/// 0.69). Both sides now count both tasks: medians of 0.90 and 0.91 here.
/// Then a fresh-clone run read 0.65, three causes found: the switches
/// were timed on whatever CPU the copy was on, at times the one the
/// ping-pong is kept to, where its tasks, switched in, took the price
/// (now the quietest CPU); the 8 mapping probes' perf events were not
/// counted, and a switch was priced per event alone, from seven, where it
/// costs some 0.9 µs for the thread and 0.2 µs an event (now timed with
/// one event and with seven); and the switches after the last reading, up
/// to a second's, were lost when the process ended (now counted at the
/// rate before). Six runs since: 0.87 to 1.07.
#[test]
fn context_switches_of_perf_event_probes_are_counted() {
    let _guard = exclusive();
    let out = output_dir("switch_cost");
    let ping_pong = ping_pong_fixture();
    // Long enough for the costs to be measured again a few times.
    const SECONDS: &str = "5";
    let run = |command: &mut Command| {
        let output = command.env("FIXTURE_CPU", "0").output().unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
        assert!(output.status.success(), "{stderr}");
        let text = String::from_utf8_lossy(&output.stdout);
        let ns: f64 = text.trim().parse().unwrap_or_else(|_| panic!("{text:?}"));
        (ns, number_after(&stderr, "round trips: "), stderr)
    };
    let mut ratios = Vec::new();
    for _ in 0..PRICE_RUNS {
        let plain = run(Command::new(&ping_pong).arg(SECONDS)).0;
        let (profiled, trips, stderr) = run(Command::new(memprobe_bin())
            .env("MEMPROBE_KERNEL_LACKS", "uprobe-multi")
            .args(["--return-probes", "uretprobes", "--max-overhead", "none"])
            .args(["--format", "heap", "-o"])
            .arg(&out)
            .arg("--")
            .arg(&ping_pong)
            .arg(SECONDS));
        assert!(
            stderr.contains("context switches of threads carrying perf-event probes"),
            "{stderr}"
        );
        let gained = (profiled - plain) * trips / 1e9;
        let reported = reported_seconds(&stderr);
        eprintln!("reported {reported:.3} s, gained {gained:.3} s over {trips} round trips");
        ratios.push(reported / gained);
    }
    assert_within("reported over gained", median_ratio(ratios), 1.0, 0.30);
}
