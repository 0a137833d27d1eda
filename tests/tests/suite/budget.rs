//! `--max-overhead`: a process that stays above it is stepped down,
//! its windows narrowed, then its frees dropped, then its allocators'
//! probes detached, and followed to the end of `--duration` all the same,
//! its profile written and its `# tracking:` note said at each step.
use std::{
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use tests::*;

/// `memprobe_probe_hits_total` of `pid` in `/metrics`.
fn probe_hits(address: &str, pid: u32) -> u64 {
    let (status, metrics) = http_get(address, "/metrics");
    assert_eq!(status, 200, "{metrics}");
    let label = format!("pid=\"{pid}\"");
    metrics
        .lines()
        .filter(|l| l.starts_with("memprobe_probe_hits_total{") && l.contains(&label))
        .find_map(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap_or_else(|| panic!("no probe hits of {pid} in:\n{metrics}"))
}

/// The `# tracking:` note of a `.heap`, or "".
fn tracking_note(heap: &std::path::Path) -> String {
    heap_notes(heap)
        .get("tracking")
        .cloned()
        .unwrap_or_default()
}

/// `--max-overhead` steps down before it detaches: a loop whose every
/// malloc and free traps (`--sampling entry`) first loses its free probes
/// (a profile written then), and, its mallocs alone still over budget,
/// is written out and its allocators' probes detached; the other process
/// is still profiled.
#[test]
fn a_process_over_its_budget_loses_its_frees_then_its_allocators_probes() {
    let _guard = exclusive();
    let out = output_dir("over_budget");
    // About a million calls a second: far above 5% of a CPU.
    let mut busy = Command::new(malloc_loop_fixture())
        .args(["0", "90"])
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let busy_pid = busy.id();
    let mut idle = Fixture::start(&sites_fixture(), &[]);
    let (busy_arg, idle_arg) = (busy_pid.to_string(), idle.pid.to_string());
    let memprobe = Memprobe::start(&[
        "--pid",
        &busy_arg,
        "--pid",
        &idle_arg,
        "--sampling",
        "entry",
        "--max-overhead",
        "5",
        "--listen",
        "127.0.0.1:0",
        "-o",
        out.to_str().unwrap(),
    ]);
    let address = memprobe.listening_on();
    let started = Instant::now();
    let dropped = format!("pid {busy_pid}: frees no longer tracked, over budget");
    memprobe.wait_for_stderr(&dropped, Duration::from_secs(30), "frees not dropped");
    let first_step = started.elapsed();
    assert!(first_step >= Duration::from_secs(9), "{first_step:?}");
    let said = format!("pid {busy_pid}: allocators' probes detached, over budget");
    memprobe.wait_for_stderr(&said, Duration::from_secs(40), "not detached");
    // Not before another 10 s over budget at the new cost.
    assert!(
        started.elapsed() >= first_step + Duration::from_secs(9),
        "{first_step:?} then {:?}",
        started.elapsed()
    );
    // Its probes are gone: its hits stop while it goes on allocating
    // (read after a tick, so the endpoints have published the detach).
    std::thread::sleep(Duration::from_millis(1500));
    let before = probe_hits(&address, busy_pid);
    std::thread::sleep(Duration::from_millis(2500));
    assert_eq!(probe_hits(&address, busy_pid), before);
    // The other process is still profiled, all of it.
    idle.run_workload();
    let stderr = memprobe.stop();
    let _ = busy.kill();
    let _ = busy.wait();
    assert!(idle.finish().success());
    // The first step's profile: the last with its frees, so no note.
    let first = out.join(format!("memprobe.{busy_pid}.0.heap"));
    let reason = heap_notes(&first)
        .get("reason")
        .cloned()
        .unwrap_or_default();
    assert!(
        reason.starts_with("over budget: its probes cost"),
        "{reason}"
    );
    assert!(reason.contains("above --max-overhead 5%"), "{reason}");
    assert!(reason.contains("more allowed for the caches"), "{reason}");
    assert_eq!(tracking_note(&first), "", "{stderr}");
    // The second says since when it counts allocations only, and why.
    let second = out.join(format!("memprobe.{busy_pid}.1.heap"));
    let tracking = tracking_note(&second);
    assert!(
        tracking.starts_with("allocations only since 20"),
        "{tracking}"
    );
    assert!(tracking.contains("above --max-overhead 5%"), "{tracking}");
    assert!(!tracking.contains("no allocation calls"), "{tracking}");
    // The last, at the end of the run, since when no allocation call is
    // probed, and why.
    let last = out.join(format!("memprobe.{busy_pid}.2.heap"));
    let tracking = tracking_note(&last);
    let (_, detached) = tracking
        .split_once("; no allocation calls since 20")
        .unwrap_or_else(|| panic!("{tracking}"));
    assert!(detached.contains("above --max-overhead 5%"), "{tracking}");
    assert!(
        stderr.contains("probes detached over --max-overhead"),
        "{stderr}"
    );
    assert!(
        stderr.contains(&format!("pid {busy_pid}: tracking allocations only since")),
        "{stderr}"
    );
    let idle_heaps: Vec<_> = heap_files(&out)
        .into_iter()
        .filter(|h| h.to_string_lossy().contains(&format!(".{idle_arg}.")))
        .collect();
    assert_eq!(idle_heaps.len(), 1, "{stderr}");
    assert_eq!(tracking_note(&idle_heaps[0]), "", "{stderr}");
}

/// Runs `busy` (a malloc/free loop, `env` set) under memprobe at the
/// defaults for `duration` with `flags` added, writing to `out`: memprobe
/// must exit zero, no sooner than `duration`. Its stderr, and the loop's
/// pid.
fn run_to_the_end(
    busy: std::path::PathBuf,
    env: &[(&str, &str)],
    duration: &str,
    flags: &[&str],
    out: &std::path::Path,
) -> (String, String) {
    let mut busy = Command::new(busy)
        .args(["0", "60"])
        .envs(env.iter().copied())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let pid = busy.id().to_string();
    let started = Instant::now();
    let mut args = vec!["--pid", &pid, "--duration", duration, "--format", "heap"];
    args.extend_from_slice(flags);
    args.extend(["-o", out.to_str().unwrap()]);
    let mut memprobe = Memprobe::start(&args);
    memprobe.wait_attached();
    let (status, stderr) = memprobe.wait();
    let _ = busy.kill();
    let _ = busy.wait();
    assert!(status.success(), "{stderr}");
    let seconds: u64 = duration.trim_end_matches('s').parse().unwrap();
    assert!(
        started.elapsed() >= Duration::from_secs(seconds),
        "{stderr}"
    );
    (stderr, pid)
}

/// A busy jemalloc process at the defaults (malloc in windows, a 10%
/// budget) is profiled to the end of `--duration`: its frees, nearly all
/// of what its probes cost, are dropped, and its profile says so; its
/// copies are attached again without them. jemalloc's slow path traps on
/// no small call, before the drop or after. Shaped like a server: bursts of 1024 malloc+free
/// pairs, 2 ms apart (some 300,000 frees a second, a third of a CPU in
/// traps).
#[test]
fn a_busy_process_at_defaults_is_profiled_to_the_end_of_its_duration() {
    let _guard = exclusive();
    let out = output_dir("busy_to_the_end");
    let pause = [("FIXTURE_PAUSE_US", "2000")];
    let (stderr, _) = run_to_the_end(malloc_loop_fixture(), &pause, "45s", &["--verbose"], &out);
    assert!(
        stderr.contains("frees no longer tracked, over budget"),
        "{stderr}"
    );
    assert!(!stderr.contains("detached, over budget"), "{stderr}");
    // No free is probed after the drop: the rates of the first whole 10 s
    // after it (the drop comes some 20 s in) name none. The slow path is
    // never probed at its entry, where the loop's thread-cache refills and
    // threshold crossings would trap, but where it sends the requests no
    // cache holds.
    let (_, after) = stderr
        .split_once("frees no longer tracked")
        .expect("frees dropped");
    let rates: Vec<&str> = after
        .lines()
        .filter(|l| l.starts_with("memprobe: probe hits: "))
        .collect();
    let [_, whole, ..] = rates[..] else {
        panic!("no whole 10 s of rates after the drop: {stderr}");
    };
    assert!(!stderr.contains("malloc's slow path"), "{stderr}");
    assert!(stderr.contains("malloc's large requests at"), "{stderr}");
    assert!(!whole.contains("free "), "{whole}\n{stderr}");
    // Each probe index keeps its entry point through the re-attach: the
    // frees' hits are not named after a call the loop never makes.
    let cost = stderr
        .lines()
        .find(|l| l.starts_with("memprobe: cost: "))
        .expect("a cost line");
    assert!(cost.contains(" free "), "{cost}");
    assert!(!cost.contains("posix_memalign"), "{cost}");
    let heaps = heap_files(&out);
    let last = heaps.last().expect("a profile");
    assert_eq!(heaps.len(), 2, "the first step's and the last: {stderr}");
    let notes = heap_notes(last);
    assert_eq!(notes.get("reason").map(String::as_str), Some("end of run"));
    let tracking = tracking_note(last);
    assert!(tracking.starts_with("allocations only since"), "{tracking}");
    assert!(tracking.contains("above --max-overhead 10%"), "{tracking}");
}

/// A busy glibc process at the defaults (glibc has no windows: its every
/// malloc and free traps) is followed to the end of `--duration`: over the
/// 10% budget it loses its frees, then its allocators' probes, each step
/// said in its profiles, and its memory account goes on in every snapshot
/// to the last. `memprobe leaks` ranks its sites over the snapshots taken
/// while its frees were followed alone: in the later ones all that was
/// allocated counts as in use, which would read as leaks everywhere.
#[test]
fn a_busy_glibc_process_at_defaults_is_followed_to_the_end_of_its_duration() {
    let _guard = exclusive();
    let out = output_dir("glibc_to_the_end");
    let flags = ["--interval", "5s"];
    let (stderr, pid) = run_to_the_end(glibc_loop_fixture(), &[], "35s", &flags, &out);
    let (_, after_frees) = stderr
        .split_once(&format!("pid {pid}: frees no longer tracked, over budget"))
        .unwrap_or_else(|| panic!("frees not dropped: {stderr}"));
    assert!(
        after_frees.contains(&format!(
            "pid {pid}: allocators' probes detached, over budget"
        )),
        "{stderr}"
    );
    let heaps = heap_files(&out);
    let last = heaps.last().expect("a profile");
    let notes = heap_notes(last);
    assert_eq!(notes.get("reason").map(String::as_str), Some("end of run"));
    let tracking = tracking_note(last);
    assert!(
        tracking.starts_with("allocations only since 20"),
        "{tracking}"
    );
    assert!(
        tracking.contains("; no allocation calls since 20"),
        "{tracking}"
    );
    // Its memory is still read at the end.
    let text = std::fs::read_to_string(last).unwrap();
    assert!(text.contains("# memory: resident: "), "{text}");
    let (status, report) = memprobe_stdout(&["leaks", out.to_str().unwrap()]);
    assert!(status.success(), "{report}");
    assert!(
        report.contains("snapshots (their `# tracking:` note): sites ranked over the first"),
        "{report}"
    );
    assert!(!report.contains("likely leak"), "{report}");
}

/// A busy glibc process profiled for its allocations alone (`--track
/// allocations`: no free probed, so nothing to drop) has its allocators'
/// probes detached at the budget's first step, and is followed to the end;
/// its summary gives what it allocated, never bytes "in use", which no
/// free followed could tell.
#[test]
fn a_process_tracked_for_allocations_alone_is_summed_up_by_what_it_allocated() {
    let _guard = exclusive();
    let out = output_dir("allocations_alone_to_the_end");
    let flags = ["--track", "allocations"];
    let (stderr, pid) = run_to_the_end(glibc_loop_fixture(), &[], "20s", &flags, &out);
    assert!(
        stderr.contains(&format!(
            "pid {pid}: allocators' probes detached, over budget"
        )),
        "{stderr}"
    );
    assert!(!stderr.contains("frees no longer tracked"), "{stderr}");
    let summed = stderr
        .lines()
        .find(|l| l.starts_with(&format!("memprobe: pid {pid} (")))
        .unwrap_or_else(|| panic!("no summary line: {stderr}"));
    assert!(
        summed.contains("probes detached over --max-overhead"),
        "{summed}"
    );
    assert!(summed.contains(" allocated, "), "{summed}");
    assert!(!summed.contains(" in use"), "{summed}");
    let tracking = format!("memprobe: pid {pid}: tracking no allocation calls since 20");
    assert!(stderr.contains(&tracking), "{stderr}");
}

/// The budget's first step: a busy program with no free probed (`--track
/// allocations`) whose windows (fixed here at half the time) cost it more
/// than a 20% budget has them narrowed, which is enough: it is not
/// detached, and that is said on stderr and in its profile. (What is left
/// is `malloc` in windows 0.5% of the time: jemalloc's slow path traps on
/// the requests no thread cache holds alone.)
#[test]
fn windows_are_narrowed_before_anything_else() {
    let _guard = exclusive();
    let out = output_dir("budget_narrows_windows");
    let env = [("FIXTURE_SECONDS", "28")];
    let mut fixture = Fixture::start(&aliasing_fixture(), &env);
    let flags = [
        "--track",
        "allocations",
        "--windows",
        "500ms/1s",
        "--max-overhead",
        "20",
        "-v",
    ];
    let memprobe = Memprobe::attach(&fixture, &out, &flags);
    fixture.run_workload();
    let stderr = memprobe.stop();
    assert!(fixture.finish().success());
    assert!(
        stderr.contains("malloc windows narrowed to 0.5% of the time, over budget"),
        "{stderr}"
    );
    assert!(!stderr.contains("detached, over budget"), "{stderr}");
    let heaps = heap_files(&out);
    assert_eq!(heaps.len(), 1, "{stderr}");
    let note = malloc_sampling_note(&heaps[0]);
    assert!(note.contains("narrowed to 0.5% since"), "{note}");
    assert!(note.contains("above --max-overhead 20%"), "{note}");
}

/// A busy program's windows cost what they were set to: open a share of
/// the time that keeps their cost at what they may cost (here 20% of the
/// CPU time the loop uses itself, for windows some 1 s apart). A window's
/// probes come out as its links close, and a link's close then waits for a
/// grace period (some 50 ms here): closed one after another, a window's
/// three links kept the last of them trapping 100 ms past its end, and the
/// windows cost 2.5 times what they were set to. The links close side by
/// side now, a window is priced over the time its probes were in, and the
/// gaps follow that time.
#[test]
fn windows_cost_what_they_were_set_to() {
    let _guard = exclusive();
    let out = output_dir("windows_cost_what_they_were_set_to");
    let mut busy = Command::new(malloc_loop_fixture())
        .args(["0", "40"])
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let pid = busy.id().to_string();
    let mut memprobe = Memprobe::start(&[
        "--pid",
        &pid,
        "--duration",
        "32s",
        "--track",
        "allocations",
        "--windows",
        "20%",
        "--max-overhead",
        "none",
        "--format",
        "heap",
        "-v",
        "-o",
        out.to_str().unwrap(),
    ]);
    memprobe.wait_attached();
    let started = (Instant::now(), cpu_seconds(busy.id()));
    let (status, stderr) = memprobe.wait();
    let used = (cpu_seconds(busy.id()) - started.1) / started.0.elapsed().as_secs_f64();
    let _ = busy.kill();
    let _ = busy.wait();
    assert!(status.success(), "{stderr}");
    let emulated_us = number_after(&stderr, "per hit, measured on this host: ");
    let (_, narrowed) = stderr
        .split_once("malloc in windows ")
        .unwrap_or_else(|| panic!("windows never narrowed: {stderr}"));
    // The rates of whole 10 s spans in windows (the first line after the
    // narrowing holds some seconds at every call): their traps alone, at
    // the host's emulated cost, a share of a CPU. Their samples' own time
    // is priced too, so the traps come to less than the windows' cost.
    let rates: Vec<f64> = narrowed
        .lines()
        .filter(|l| l.starts_with("memprobe: probe hits: "))
        .skip(1)
        .map(|l| per_second(l, " malloc "))
        .collect();
    assert!(!rates.is_empty(), "no whole span in windows: {stderr}");
    let traps = rates.iter().sum::<f64>() / rates.len() as f64 * emulated_us * 1e-6;
    // What they may cost: 20% of what the loop uses itself (its CPU less
    // the traps', which are in its CPU time, as a share of a CPU). Before
    // the links closed side by side: 1.41 times that; 0.74 to 0.88 since.
    let allowed = 0.2 * (used - traps);
    assert!(
        (0.4 * allowed..1.2 * allowed).contains(&traps),
        "windows' traps cost {traps:.4} of a CPU, allowed {allowed:.4} (the loop used \
         {used:.3}): {stderr}"
    );
}

/// The same switches count against `--max-overhead`: played as on 6.1 (no
/// uprobe_multi links; uretprobes, as without sessions), a ping-pong above
/// 5% of a CPU from them alone is written out and stepped down.
#[test]
fn context_switches_count_against_the_budget() {
    let _guard = exclusive();
    let out = output_dir("switch_budget");
    let mut ping_pong = Command::new(ping_pong_fixture())
        .arg("30")
        .env("FIXTURE_CPU", "0")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let pid = ping_pong.id().to_string();
    let mut command = Command::new(memprobe_bin());
    command
        .env("MEMPROBE_KERNEL_LACKS", "uprobe-multi")
        .args(["--return-probes", "uretprobes"])
        // Verbose: the switches' price and rate, should it fail (it did
        // once in a whole suite's run, not since).
        .arg("--verbose")
        .args([
            "--pid",
            &pid,
            "--max-overhead",
            "5",
            "--format",
            "heap",
            "-o",
        ])
        .arg(&out)
        .stdin(Stdio::null())
        .stdout(Stdio::null());
    let memprobe = Memprobe::start_command(command);
    let said = format!("pid {pid}: frees no longer tracked, over budget");
    memprobe.wait_for_stderr(&said, Duration::from_secs(30), "not over budget");
    let _ = ping_pong.kill();
    let _ = ping_pong.wait();
    memprobe.stop();
    let heap = out.join(format!("memprobe.{pid}.0.heap"));
    let reason = heap_notes(&heap).get("reason").cloned().unwrap_or_default();
    assert!(reason.contains("above --max-overhead 5%"), "{reason}");
}

/// `--all` (windows: each process probed on its own) keeps the budget:
/// the same busy server-shaped loop, met by the agent's scan, loses its
/// frees over the 10% default and stays profiled to the end.
#[test]
fn every_process_keeps_its_budget_with_all() {
    let _guard = exclusive();
    let out = output_dir("budget_with_all");
    let mut memprobe = Memprobe::start(&[
        "--all",
        "--allocator",
        "jemalloc",
        "--duration",
        "25s",
        "--format",
        "heap",
        "-o",
        out.to_str().unwrap(),
    ]);
    memprobe.wait_attached();
    let mut busy = Command::new(malloc_loop_fixture())
        .args(["0", "40"])
        .env("FIXTURE_PAUSE_US", "2000")
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let pid = busy.id();
    let (status, stderr) = memprobe.wait();
    let _ = busy.kill();
    let _ = busy.wait();
    assert!(status.success(), "{stderr}");
    let dropped = format!("pid {pid}: frees no longer tracked, over budget");
    assert!(stderr.contains(&dropped), "{stderr}");
    assert!(!stderr.contains("detached, over budget"), "{stderr}");
    let last = out.join(format!("memprobe.{pid}.1.heap"));
    let notes = heap_notes(&last);
    assert_eq!(notes.get("reason").map(String::as_str), Some("end of run"));
    let tracking = tracking_note(&last);
    assert!(tracking.starts_with("allocations only since"), "{tracking}");
}

/// The CPU seconds process `pid` has used so far.
fn cpu_seconds(pid: u32) -> f64 {
    let fields = stat_fields(pid).expect("its stat");
    // utime and stime, the 14th and 15th fields.
    let ticks: f64 = fields[11].parse::<f64>().unwrap() + fields[12].parse::<f64>().unwrap();
    ticks / unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64
}

/// The rate after `marker` in a line of rates: "malloc 5.5k/s".
fn per_second(line: &str, marker: &str) -> f64 {
    let rate = line
        .split_once(marker)
        .and_then(|(_, rest)| rest.split_once("/s"))
        .map(|(rate, _)| rate)
        .unwrap_or_else(|| panic!("no rate after {marker:?} in {line}"));
    let (digits, scale) = match rate.strip_suffix('k') {
        Some(digits) => (digits, 1e3),
        None => match rate.strip_suffix('M') {
            Some(digits) => (digits, 1e6),
            None => (rate, 1.0),
        },
    };
    digits.parse::<f64>().expect("a rate") * scale
}
