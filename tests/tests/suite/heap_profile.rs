//! Attach to a running C fixture with known sites; check the written profile
//! with the real jeprof, against the truth and against jemalloc's own profiler.
use tests::*;

/// Truth of the fixture (tests/fixtures/sites.c), in bytes.
const KEEP_4K_BYTES: f64 = 2000.0 * 4096.0;
const KEEP_1M_BYTES: f64 = 16.0 * MIB;
const CHURN_ALLOCATED_BYTES: f64 = 50_000.0 * 512.0;

/// Profiles the fixture from attach until its workload is done, then stops
/// memprobe with `signal`. Returns the written profile.
fn profile_sites(test: &str, env: &[(&str, &str)]) -> (std::path::PathBuf, std::path::PathBuf) {
    let binary = sites_fixture();
    let out = output_dir(test);
    let mut fixture = Fixture::start(&binary, env);
    let pid = fixture.pid;
    let (heap, _) = profile_workload(&mut fixture, &out, &[]);
    assert!(fixture.finish().success());
    assert_eq!(
        heap.file_name().unwrap().to_str().unwrap(),
        format!("memprobe.{pid}.0.heap")
    );
    (binary, heap)
}

#[test]
fn jeprof_ranks_sites_and_estimates_are_within_10_percent() {
    let _guard = shared();
    let (binary, heap) = profile_sites("jeprof_ranks_sites", &[]);
    let text = std::fs::read_to_string(&heap).unwrap();
    assert!(text.starts_with("heap_v2/4096\n"), "{}", &text[..40]);
    assert!(text.contains("\nMAPPED_LIBRARIES:\n"));
    assert!(text.contains("libjemalloc.so.2"));

    let inuse = jeprof_text(&binary, &heap, "--inuse_space");
    let keep_1m = inuse.get("keep_1m").copied().unwrap_or(0.0) * MIB;
    let keep_4k = inuse.get("keep_4k").copied().unwrap_or(0.0) * MIB;
    let churn = inuse.get("churn_512").copied().unwrap_or(0.0) * MIB;
    assert!(keep_1m > keep_4k && keep_4k > churn, "{inuse:?}");
    assert_within("keep_1m in use", keep_1m, KEEP_1M_BYTES, 0.10);
    assert_within("keep_4k in use", keep_4k, KEEP_4K_BYTES, 0.10);
    // Near zero: a few live samples at most at the moment of the stop.
    assert!(churn <= 0.1 * MIB, "churn_512 in use: {churn}");
    // Allocator frames are cut off: no jemalloc function carries bytes.
    for name in ["malloc", "je_malloc_default", "imalloc"] {
        assert!(!inuse.contains_key(name), "{name} in {inuse:?}");
    }

    let allocated = jeprof_text(&binary, &heap, "--alloc_space");
    let churn_allocated = allocated.get("churn_512").copied().unwrap_or(0.0) * MIB;
    assert_within(
        "churn_512 allocated",
        churn_allocated,
        CHURN_ALLOCATED_BYTES,
        0.10,
    );
    let keep_4k_allocated = allocated.get("keep_4k").copied().unwrap_or(0.0) * MIB;
    assert_within("keep_4k allocated", keep_4k_allocated, KEEP_4K_BYTES, 0.10);
}

/// jemalloc's own profiler (Debian's jemalloc is built with it) on the same
/// workload dumps its heap profile once the workload is done: memprobe's
/// estimates must agree with jemalloc's within 10% per site (each has about
/// 2% sampling noise at this interval). Separate runs: while memprobe's
/// return probe is armed, the return address on the stack is the kernel's
/// uretprobe trampoline, where jemalloc's in-process unwinder stops.
#[test]
fn estimates_agree_with_jemallocs_own_profiler() {
    let _guard = shared();
    let (binary, heap) = profile_sites("agree_with_jemalloc", &[]);

    let out = output_dir("jemalloc_own_dump");
    let dump = out.join("jemalloc-own.heap");
    let dump_path = dump.to_str().unwrap().to_owned();
    let mut fixture = Fixture::start(
        &binary,
        &[
            ("MALLOC_CONF", "prof:true,lg_prof_sample:12,prof_accum:true"),
            ("FIXTURE_PROF_DUMP", &dump_path),
        ],
    );
    fixture.run_workload();
    assert!(fixture.finish().success());

    let ours = jeprof_text(&binary, &heap, "--inuse_space");
    let theirs = jeprof_text(&binary, &dump, "--inuse_space");
    for site in ["keep_4k", "keep_1m"] {
        let (a, b) = (ours[site], theirs[site]);
        assert_within(&format!("{site}: memprobe vs jemalloc"), a, b, 0.10);
    }
    // Same ranking in both.
    assert!(ours["keep_1m"] > ours["keep_4k"]);
    assert!(theirs["keep_1m"] > theirs["keep_4k"]);
    let ours_allocated = jeprof_text(&binary, &heap, "--alloc_space");
    let theirs_allocated = jeprof_text(&binary, &dump, "--alloc_space");
    assert_within(
        "churn_512 allocated: memprobe vs jemalloc",
        ours_allocated["churn_512"],
        theirs_allocated["churn_512"],
        0.10,
    );
}

#[test]
fn writes_final_profile_when_the_process_exits() {
    let _guard = shared();
    let binary = sites_fixture();
    let out = output_dir("process_exits");
    let mut fixture = Fixture::start(&binary, &[]);
    let pid = fixture.pid.to_string();
    let memprobe = Memprobe::attach(&fixture, &out, &["--sample-interval", "4096"]);
    fixture.run_workload();
    assert!(fixture.finish().success());
    // No signal, no duration: memprobe stops because the process is gone.
    let (status, stderr) = memprobe.wait();
    assert!(status.success(), "{stderr}");
    assert!(
        stderr.contains(&format!("process {pid} exited")),
        "{stderr}"
    );
    let heaps = heap_files(&out);
    assert_eq!(heaps.len(), 1);
    let inuse = jeprof_text(&binary, &heaps[0], "--inuse_space");
    assert_within("keep_1m", inuse["keep_1m"] * MIB, KEEP_1M_BYTES, 0.10);
}

#[test]
fn sigterm_and_duration_both_write_a_profile_and_exit_zero() {
    let _guard = shared();
    let binary = sites_fixture();
    for (case, args) in [("sigterm", vec![]), ("duration", vec!["--duration", "3s"])] {
        let out = output_dir(&format!("stop_{case}"));
        let mut fixture = Fixture::start(&binary, &[]);
        let pid = fixture.pid.to_string();
        let mut all = vec!["--pid", &pid, "--sample-interval", "4096", "-o"];
        all.push(out.to_str().unwrap());
        all.extend(args);
        let mut memprobe = Memprobe::start(&all);
        memprobe.wait_attached();
        fixture.run_workload();
        if case == "sigterm" {
            memprobe.signal(libc::SIGTERM);
        }
        let (status, stderr) = memprobe.wait();
        assert!(status.success(), "{case}: {stderr}");
        assert!(stderr.contains("detached"), "{case}: {stderr}");
        let heaps = heap_files(&out);
        assert_eq!(heaps.len(), 1, "{case}");
        let inuse = jeprof_text(&binary, &heaps[0], "--inuse_space");
        assert_within(case, inuse["keep_1m"] * MIB, KEEP_1M_BYTES, 0.10);
        // The target goes on unharmed after memprobe detached.
        assert!(fixture.finish().success(), "{case}");
    }
}

#[test]
fn verbose_lists_every_entry_point_it_attached() {
    let _guard = shared();
    let binary = sites_fixture();
    let out = output_dir("verbose");
    let fixture = Fixture::start(&binary, &[]);
    let pid = fixture.pid.to_string();
    // At entry: in windows (the default) malloc and operator new are
    // attached in each window, not at attach (see windows.rs).
    let flags = ["--verbose", "--sampling", "entry"];
    let stderr = profile_for_a_second(fixture.pid, &out, &flags);
    for symbol in [
        "malloc",
        "calloc",
        "realloc",
        "free",
        "posix_memalign",
        "aligned_alloc",
        "memalign",
        "valloc",
        "mallocx",
        "rallocx",
        "xallocx",
        "dallocx",
        "sdallocx",
        "_Znwm",
        "_ZdlPv",
    ] {
        // Attached, or named as passing every call to an entry point that is.
        let attached = format!("pid {pid}: {symbol} at ");
        let wrapper = format!(": {symbol} not probed: every call passes to ");
        assert!(
            stderr.contains(&attached) || stderr.contains(&wrapper),
            "{symbol} neither attached nor a wrapper:\n{stderr}"
        );
    }
    // Exactly one "attached" line, before the summary.
    assert_eq!(stderr.matches("memprobe: attached").count(), 1);
    drop(fixture);
}

/// Uprobe links (perf-event ones, and uprobe_multi ones of sessions), as
/// `bpftool link list` shows them.
fn uprobe_links() -> usize {
    let out = std::process::Command::new("bpftool")
        .args(["link", "list"])
        .output()
        .expect("running bpftool");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        // Older bpftools print uprobe_multi links as "type 12".
        .filter(|l| {
            l.contains("perf_event") || l.contains("uprobe_multi") || l.contains(": type 12 ")
        })
        .count()
}

fn wait_for_links(expected: usize) -> usize {
    for _ in 0..100 {
        if uprobe_links() == expected {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    uprobe_links()
}

/// No probe is left behind, whether memprobe exits, is stopped, or dies.
#[test]
fn no_probe_is_left_behind_after_exit_sigterm_or_sigkill() {
    let _guard = exclusive();
    let binary = sites_fixture();
    let baseline = uprobe_links();
    for signal in [None, Some(libc::SIGTERM), Some(libc::SIGKILL)] {
        let fixture = Fixture::start(&binary, &[]);
        let pid = fixture.pid.to_string();
        let out = output_dir("left_behind");
        let mut args = vec!["--pid", &pid, "-o", out.to_str().unwrap()];
        if signal.is_none() {
            args.extend(["--duration", "2s"]);
        }
        let mut memprobe = Memprobe::start(&args);
        memprobe.wait_attached();
        let attached = uprobe_links();
        assert!(
            attached >= baseline + 19,
            "{signal:?}: {attached} links, baseline {baseline}"
        );
        if let Some(signal) = signal {
            memprobe.signal(signal);
        }
        let _ = memprobe.wait();
        let after = wait_for_links(baseline);
        assert_eq!(after, baseline, "{signal:?}: links left behind");
        drop(fixture);
    }
}

/// `--track allocations`: no free probe and no return half, one trap per
/// allocating call; the profile counts what was allocated, in use included.
#[test]
fn track_allocations_probes_no_frees_and_counts_what_was_allocated() {
    let _guard = shared();
    let binary = sites_fixture();
    let out = output_dir("track_allocations");
    let mut fixture = Fixture::start(&binary, &[]);
    let (heap, stderr) =
        profile_workload(&mut fixture, &out, &["--track", "allocations", "--verbose"]);
    assert!(!stderr.contains(": free at "), "{stderr}");
    assert!(
        stderr.contains("(entry)") && !stderr.contains("(entry and return"),
        "{stderr}"
    );
    assert!(
        stderr.contains(" 0 free calls, 0 return probe runs"),
        "{stderr}"
    );
    assert!(heap_notes(&heap)["tracking"].starts_with("allocations only"));
    let truth = 50_000.0 * 512.0;
    let allocated = jeprof_text(&binary, &heap, "--alloc_space");
    assert_within(
        "churn_512 allocated",
        allocated["churn_512"] * MIB,
        truth,
        0.1,
    );
    let inuse = jeprof_text(&binary, &heap, "--inuse_space");
    assert_within(
        "churn_512 counted in use",
        inuse["churn_512"] * MIB,
        truth,
        0.1,
    );
    assert_within("keep_1m", inuse["keep_1m"] * MIB, 16.0 * MIB, 0.1);
}
