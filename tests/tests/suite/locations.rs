//! jemalloc wherever it lives: linked statically, prefixed (Rust's
//! tikv-jemallocator), C++ operators, JVMs (preloaded, and inside a JNI
//! library), loaded after attach, launched, several processes, --all,
//! containers. Each test checks the profile's content against the truth.
use std::{
    process::{Command, Stdio},
    time::Duration,
};

use tests::*;

const KEEP_4K: f64 = 2000.0 * 4096.0;
const KEEP_1M: f64 = 16.0 * MIB;

#[test]
fn static_jemalloc_in_the_executable() {
    let _guard = shared();
    let binary = sites_static_fixture();
    let out = output_dir("static");
    let mut fixture = Fixture::start(&binary, &[]);
    let (heap, stderr) = profile_workload(&mut fixture, &out, &["--verbose"]);
    // The probes sit in the executable itself, not in a shared library
    // (where its slow path sends large requests: the executable's jemalloc
    // is 5.3's).
    assert!(
        stderr.contains(&format!("malloc's large requests at {}+", binary.display())),
        "{stderr}"
    );
    assert!(!stderr.contains("libjemalloc.so"), "{stderr}");
    assert_sites_kept(&binary, &heap, "");
}

/// A process met before its program is loaded (`./server & memprobe --pid
/// $!`), here one that maps no allocator for 300 ms and then execs the
/// static-jemalloc fixture: memprobe looks again while the process is
/// young, instead of saying it has no allocator, and profiles it.
#[test]
fn a_process_met_before_its_program_is_loaded() {
    let _guard = shared();
    let binary = sites_static_fixture();
    let out = output_dir("before_loaded");
    let mut command = Command::new(exec_later_fixture());
    command.arg(&binary);
    let mut memprobe = None;
    let mut fixture = Fixture::start_command_with(command, |pid| {
        let pid = pid.to_string();
        let args = [
            "--pid",
            &pid,
            "-o",
            out.to_str().unwrap(),
            "--sample-interval",
            "4096",
        ];
        memprobe = Some(Memprobe::start(&args));
    });
    let mut memprobe = memprobe.unwrap();
    memprobe.wait_attached();
    fixture.run_workload();
    let stderr = memprobe.stop();
    let heaps = heap_files(&out);
    assert_eq!(heaps.len(), 1, "{heaps:?}\n{stderr}");
    assert_sites_kept(&binary, &heaps[0], "");
}

#[test]
fn rust_program_on_tikv_jemallocator() {
    let _guard = shared();
    let binary = rust_fixture();
    let out = output_dir("rust_rjem");
    let mut fixture = Fixture::start(&binary, &[]);
    let (heap, stderr) = profile_workload(&mut fixture, &out, &["--verbose"]);
    // The prefix comes from the symbols; frees go through _rjem_sdallocx.
    for symbol in [
        "_rjem_malloc's large requests",
        "_rjem_mallocx",
        "_rjem_sdallocx",
        "_rjem_rallocx",
    ] {
        assert!(
            stderr.contains(&format!(": {symbol} at ")),
            "{symbol}: {stderr}"
        );
    }
    let inuse = assert_rust_kept_in_use(&binary, &heap);
    let churn = inuse.iter().find(|r| r.name.contains("churn_vectors"));
    assert!(churn.is_none_or(|r| r.cum < 0.1), "{churn:?}");
    assert_rust_churn_allocated(&binary, &heap);
}

#[test]
fn cxx_operator_new_and_delete() {
    let _guard = shared();
    let binary = new_delete_fixture();
    let out = output_dir("cxx");
    let mut fixture = Fixture::start(&binary, &[]);
    let (heap, _) = profile_workload(&mut fixture, &out, &[]);
    let inuse = jeprof_rows(&binary, &heap, "--inuse_space");
    assert_within(
        "keep_nodes (new)",
        row(&inuse, "keep_nodes").flat * MIB,
        KEEP_4K,
        0.10,
    );
    assert_within(
        "keep_arrays (new[])",
        row(&inuse, "keep_arrays").flat * MIB,
        KEEP_1M,
        0.10,
    );
    let churn = inuse.iter().find(|r| r.name.contains("churn_objects"));
    assert!(
        churn.is_none_or(|r| r.flat < 0.1),
        "sized delete missed: {churn:?}"
    );
    let allocated = jeprof_rows(&binary, &heap, "--alloc_space");
    assert_within(
        "churn_objects allocated",
        row(&allocated, "churn_objects").flat * MIB,
        50_000.0 * 512.0,
        0.10,
    );
}

#[test]
fn jvm_with_jemalloc_preloaded_sees_direct_buffers() {
    let _guard = shared();
    let out = output_dir("jvm_preload");
    let mut command = java_command("DirectBuffers");
    command.env("LD_PRELOAD", "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2");
    let mut fixture = Fixture::start_command(command);
    let (heap, _) = profile_workload(&mut fixture, &out, &[]);
    assert_direct_buffers_in_use(&heap);
}

/// The sites fixture's kept sites, read by jeprof; `what` prefixes messages.
fn assert_sites_kept(binary: &std::path::Path, heap: &std::path::Path, what: &str) {
    let inuse = jeprof_text(binary, heap, "--inuse_space");
    let site = |name: &str| {
        inuse.get(name).copied().unwrap_or_else(|| {
            let heap_text = std::fs::read_to_string(heap).unwrap_or_default();
            panic!("{what}no {name} in jeprof's rows {inuse:?}\nfrom {heap:?}:\n{heap_text}")
        })
    };
    assert_within(
        &format!("{what}keep_1m"),
        site("keep_1m") * MIB,
        KEEP_1M,
        0.10,
    );
    assert_within(
        &format!("{what}keep_4k"),
        site("keep_4k") * MIB,
        KEEP_4K,
        0.10,
    );
}

/// The static-jemalloc library's `keep_blocks(2000, 4096)`, read by jeprof.
fn assert_library_keeps_blocks(library: &std::path::Path, heap: &std::path::Path) {
    let inuse = jeprof_rows(library, heap, "--inuse_space");
    assert_within(
        "keep_blocks in use",
        row(&inuse, "keep_blocks").flat * MIB,
        KEEP_4K,
        0.10,
    );
}

#[test]
fn jvm_with_a_jni_library_that_contains_jemalloc() {
    let _guard = shared();
    let library = static_jemalloc_library();
    let out = output_dir("jvm_jni");
    let mut command = java_command("JniAlloc");
    command
        .arg(&library)
        .env(STATIC_TLS_TUNABLE.0, STATIC_TLS_TUNABLE.1);
    let mut fixture = Fixture::start_command(command);
    let (heap, stderr) = profile_workload(&mut fixture, &out, &["--verbose"]);
    assert!(
        stderr.contains(&format!("mallocx at {}+", library.display())),
        "{stderr}"
    );
    assert_library_keeps_blocks(&library, &heap);
}

#[test]
fn library_loaded_after_attach_is_probed_within_a_second() {
    let _guard = shared();
    let library = static_jemalloc_library();
    let out = output_dir("dlopen");
    let (heap, _) =
        profile_library_loaded_after_attach(&library, &out, Duration::from_secs(3), &[]);
    assert_library_keeps_blocks(&library, &heap);
}

/// The kernel tells memprobe of the library's code as it is mapped (the
/// `mmap` syscall's tracepoints): probed before the library's first
/// allocation, 50 ms after its `dlopen`, not at the next rescan. Alone:
/// reading the library and attaching its probes took 16 ms on an idle
/// host, over 50 with both cores busy compiling.
#[test]
fn a_library_allocating_50_ms_after_its_dlopen_is_all_seen() {
    let _guard = exclusive();
    let library = static_jemalloc_library();
    let out = output_dir("dlopen_50ms");
    let env = [("FIXTURE_ALLOCATE_AFTER_MS", "50")];
    let (heap, stderr) =
        profile_library_loaded_after_attach(&library, &out, Duration::from_secs(3), &env);
    let latency_ms: u64 = stderr
        .split(" ms after it was mapped")
        .next()
        .and_then(|before| before.rsplit(' ').next()?.parse().ok())
        .unwrap_or_else(|| panic!("not told by the kernel:\n{stderr}"));
    eprintln!("probed {latency_ms} ms after the library's code was mapped");
    assert!(latency_ms < 50, "{stderr}");
    assert_library_keeps_blocks(&library, &heap);
}

#[test]
fn launch_mode_profiles_from_the_start_and_passes_the_exit_code() {
    let _guard = shared();
    let binary = sites_fixture();
    let out = output_dir("launch");
    let args = ["--sample-interval", "4096", "-o", out.to_str().unwrap()];
    let env = [("FIXTURE_EXIT_CODE", "7")];
    let (memprobe, mut launched) = Memprobe::launch(&args, &binary, &env);
    assert!(launched.read_line().starts_with("ready "));
    assert_eq!(launched.send("go"), "done");
    launched.close();
    let (status, stderr) = memprobe.wait();
    assert_eq!(status.code(), Some(7), "{stderr}");
    let heaps = heap_files(&out);
    assert_eq!(heaps.len(), 1, "{stderr}");
    assert_sites_kept(&binary, &heaps[0], "");
}

#[test]
fn two_pids_in_one_run() {
    let _guard = shared();
    let binary = sites_fixture();
    let out = output_dir("two_pids");
    let mut first = Fixture::start(&binary, &[]);
    let mut second = Fixture::start(&binary, &[]);
    let (a, b) = (first.pid.to_string(), second.pid.to_string());
    let mut memprobe = Memprobe::start(&[
        "--pid",
        &a,
        "--pid",
        &b,
        "--sample-interval",
        "4096",
        "-o",
        out.to_str().unwrap(),
    ]);
    memprobe.wait_attached();
    first.run_workload();
    second.run_workload();
    memprobe.signal(libc::SIGINT);
    let (status, stderr) = memprobe.wait();
    assert!(status.success(), "{stderr}");
    for pid in [&a, &b] {
        let heap = out.join(format!("memprobe.{pid}.0.heap"));
        assert_sites_kept(&binary, &heap, &format!("pid {pid} "));
    }
}

/// `--all` reads a process's maps again only once its virtual size (or
/// start time) changed since its last look, and watches no `mmap`: a
/// library it loads later is still probed at the next look, a second on.
#[test]
fn all_picks_up_a_library_loaded_by_a_process_it_follows() {
    let _guard = exclusive();
    let library = static_jemalloc_library();
    let out = output_dir("all_dlopen");
    let mut command = Command::new(dlopen_host_fixture());
    command
        .arg(&library)
        .env(STATIC_TLS_TUNABLE.0, STATIC_TLS_TUNABLE.1);
    let mut fixture = Fixture::start_command(command);
    let pid = fixture.pid;
    let mut memprobe = Memprobe::start(&[
        "--all",
        "--verbose",
        "--sample-interval",
        "4096",
        "-o",
        out.to_str().unwrap(),
    ]);
    memprobe.wait_attached();
    // Looked at by several scans first, its maps unchanged.
    std::thread::sleep(Duration::from_millis(2500));
    fixture.send_and_expect("load", "loaded");
    let needle = format!("pid {pid}: mallocx at {}+", library.display());
    memprobe.wait_for_stderr(&needle, Duration::from_secs(3), "not probed in time");
    fixture.run_workload();
    memprobe.signal(libc::SIGINT);
    let (status, stderr) = memprobe.wait();
    assert!(status.success(), "{stderr}");
    assert!(fixture.finish().success());
    let heap = out.join(format!("memprobe.{pid}.0.heap"));
    assert!(heap.exists(), "no profile for pid {pid}: {stderr}");
    assert_library_keeps_blocks(&library, &heap);
}

#[test]
fn all_picks_up_a_process_started_during_the_run() {
    let _guard = exclusive();
    let binary = sites_fixture();
    let out = output_dir("all");
    let mut memprobe = Memprobe::start(&[
        "--all",
        "--sample-interval",
        "4096",
        "-o",
        out.to_str().unwrap(),
    ]);
    memprobe.wait_attached();
    let mut late = Fixture::start(&binary, &[]);
    let pid = late.pid;
    // Within a scan interval the new process is known; its library may be
    // probed system-wide already, if another process mapped it first.
    std::thread::sleep(std::time::Duration::from_millis(1500));
    late.run_workload();
    memprobe.signal(libc::SIGINT);
    let (status, stderr) = memprobe.wait();
    assert!(status.success(), "{stderr}");
    assert!(late.finish().success());
    let heap = out.join(format!("memprobe.{pid}.0.heap"));
    assert!(heap.exists(), "no profile for pid {pid}: {stderr}");
    assert_sites_kept(&binary, &heap, "");
    // memprobe's own allocations trap too, but are never sampled: each of
    // its samples made it allocate, and sample itself, again (170,444
    // samples in all, 7,260 of them in profiled processes, in one run).
    let profiled: u64 = stderr
        .lines()
        .filter_map(|l| {
            l.split(" samples, ")
                .next()?
                .rsplit(' ')
                .next()?
                .parse::<u64>()
                .ok()
        })
        .sum();
    let sampled = summary_count(&stderr, " sampled");
    assert!(
        sampled <= profiled + profiled / 10 + 100,
        "{sampled} sampled, {profiled} in profiled processes\n{stderr}"
    );
}

/// Nanoseconds per malloc+free pair of a fresh malloc_loop run (best of 3).
fn loop_cost(pairs: &str) -> f64 {
    (0..3)
        .map(|_| {
            let out = Command::new(malloc_loop_fixture())
                .arg(pairs)
                .output()
                .unwrap();
            String::from_utf8_lossy(&out.stdout)
                .trim()
                .parse::<f64>()
                .unwrap()
        })
        .fold(f64::INFINITY, f64::min)
}

#[test]
fn processes_not_asked_for_are_not_slowed() {
    let _guard = exclusive();
    let binary = sites_fixture();
    let out = output_dir("untargeted");
    let baseline = loop_cost("2000000");
    // Profile another process that maps the same libjemalloc.so.2.
    let target = Fixture::start(&binary, &[]);
    let pid = target.pid.to_string();
    let mut memprobe = Memprobe::start(&["--pid", &pid, "-o", out.to_str().unwrap()]);
    memprobe.wait_attached();
    let beside = loop_cost("2000000");
    memprobe.signal(libc::SIGINT);
    let (status, stderr) = memprobe.wait();
    assert!(status.success(), "{stderr}");
    eprintln!("malloc+free: {baseline:.1} ns alone, {beside:.1} ns while another pid is profiled");
    assert!(
        beside < baseline * 1.5 + 2.0,
        "untargeted process slowed: {baseline:.1} ns -> {beside:.1} ns"
    );
    // The measure does see probes when they are there: profile the loop itself.
    let mut probed = Command::new(memprobe_bin());
    probed
        .args(["-o", out.to_str().unwrap(), "--"])
        .arg(malloc_loop_fixture())
        .arg("20000")
        .stderr(Stdio::null());
    let probed = probed.output().unwrap();
    let probed_cost: f64 = String::from_utf8_lossy(&probed.stdout)
        .trim()
        .parse()
        .unwrap();
    assert!(
        probed_cost > 10.0 * baseline,
        "probed loop {probed_cost:.1} ns vs {baseline:.1} ns"
    );
}

#[test]
fn process_in_another_mount_and_pid_namespace() {
    let _guard = shared();
    let binary = sites_fixture();
    let out = output_dir("container");
    let (mut fixture, inside) = start_in_container(&[&binary], &output_dir("container_mount"));
    let host_pid = fixture.pid;
    let (heap, stderr) = profile_workload(&mut fixture, &out, &[]);
    assert!(
        stderr.contains(&format!("pid {host_pid} (sites, pid 1 in its container")),
        "{stderr}"
    );
    assert_eq!(
        heap.file_name().unwrap().to_str().unwrap(),
        format!("memprobe.{host_pid}.0.heap")
    );
    let text = std::fs::read_to_string(&heap).unwrap();
    assert!(text.contains("# container_pid: 1"));
    // The maps name the file as the container sees it; give jeprof a copy there.
    assert!(text.contains(&inside.display().to_string()));
    std::fs::copy(&binary, &inside).unwrap();
    assert_sites_kept(&inside, &heap, "");
}

/// JIT-compiled Java frames are named from HotSpot's perf map, which
/// memprobe asks for (jcmd Compiler.perfmap) before writing.
#[test]
fn jit_compiled_java_frames_are_named() {
    let _guard = shared();
    let out = output_dir("jvm_jit");
    let mut command = java_command_with(
        "HotAlloc",
        &[
            "-XX:+PreserveFramePointer",
            "-XX:CompileCommand=quiet",
            "-XX:CompileCommand=dontinline,HotAlloc::allocate",
        ],
    );
    command.env("LD_PRELOAD", "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2");
    let mut fixture = Fixture::start_command(command);
    let (heap, stderr) = profile_workload(&mut fixture, &out, &["--format", "heap,folded"]);
    let folded = std::fs::read_to_string(heap.with_extension("folded")).unwrap();
    let java_frames: Vec<&str> = folded
        .lines()
        .flat_map(|l| l.rsplit_once(' ').unwrap().0.split(';'))
        .filter(|f| f.contains("HotAlloc"))
        .collect();
    assert!(
        java_frames.iter().any(|f| f.contains("allocate")),
        "no named Java frame of HotAlloc.allocate:\n{folded}\n{stderr}"
    );
    assert!(folded.contains("Unsafe_AllocateMemory0"), "{folded}");
    // The names travel in the .heap: its plain report names the Java frames
    // with the perf map gone.
    let (status, report) = memprobe_stdout(&["report", heap.to_str().unwrap(), "--top", "200"]);
    assert!(status.success(), "{report}");
    assert!(report.contains("HotAlloc.allocate"), "{report}");
    // The perf map memprobe asked for is gone from the host.
    let perf_map = std::path::PathBuf::from(format!("/tmp/perf-{}.map", fixture.pid));
    assert!(!perf_map.exists(), "{} left behind", perf_map.display());
}

/// A perf map that was there before memprobe asked for one is the JVM's
/// own: it stays.
#[test]
fn a_jvms_own_perf_map_is_left_alone() {
    let _guard = shared();
    let out = output_dir("jvm_own_perfmap");
    let mut command = java_command("HotAlloc");
    command.env("LD_PRELOAD", "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2");
    let mut fixture = Fixture::start_command(command);
    let perf_map = std::path::PathBuf::from(format!("/tmp/perf-{}.map", fixture.pid));
    let jcmd = Command::new(format!("{JAVA_HOME}/bin/jcmd"))
        .arg(fixture.pid.to_string())
        .arg("Compiler.perfmap")
        .output()
        .unwrap();
    assert!(jcmd.status.success() && perf_map.exists());
    profile_workload(&mut fixture, &out, &["--format", "heap,folded"]);
    assert!(perf_map.exists(), "the JVM's own perf map was removed");
    std::fs::remove_file(&perf_map).unwrap();
}
