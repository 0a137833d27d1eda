//! jemalloc found by its code in stripped files with no debug file to be
//! found: a static C executable, a Rust binary on tikv-jemallocator
//! launched by memprobe, a C++ library with jemalloc hidden inside loaded
//! by dlopen, and ruff from PyPI. The profiles are named afterwards,
//! offline, from the debug files. And what must not be probed: a stripped
//! binary without jemalloc, and a near miss.
use std::{
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use tests::*;

/// The profile's word on how jemalloc was found, which must be by its
/// code, with `malloc` and each of `entry_points` among what was found.
fn assert_found_by_code(heap: &Path, stderr: &str, entry_points: &[&str]) -> String {
    let notes = heap_notes(heap);
    let note = notes.get("allocator").cloned().unwrap_or_default();
    assert!(
        note.contains("entry points found by their code: ") && note.contains("malloc at 0x"),
        "{notes:?}\n{stderr}"
    );
    for entry_point in entry_points {
        assert!(note.contains(&format!(" {entry_point} at 0x")), "{note}");
    }
    // Entry points it could not find are said on stderr too.
    assert!(stderr.contains("are not seen"), "{stderr}");
    note
}

/// The Rust fixture built on `unstripped`'s jemalloc, stripped and launched
/// by memprobe: found by its code (`entry_points` among it), its kept
/// vectors within 10%. The profile's allocator note.
fn assert_rust_profiled_by_code(unstripped: &Path, test: &str, entry_points: &[&str]) -> String {
    let out = output_dir(test);
    let (binary, debug_dir) = strip_keeping_debug(unstripped, &out, "rust_bare");
    let (heap, stderr) = launch_workload(&binary, &out);
    let note = assert_found_by_code(&heap, &stderr, entry_points);
    let kept = reported_bytes(&heap, &debug_dir, "keep_vectors");
    assert_within("keep_vectors", kept, RUST_KEPT_BYTES, 0.1);
    note
}

/// Bytes in use under functions named like `site` (with their callees),
/// per `memprobe report` with the debug files in `debug_dir`.
fn reported_bytes(heap: &Path, debug_dir: &Path, site: &str) -> f64 {
    let (status, text) = memprobe_stdout(&[
        "report",
        heap.to_str().unwrap(),
        "--debug-dir",
        debug_dir.to_str().unwrap(),
        "--top",
        "100",
    ]);
    assert!(status.success(), "{text}");
    row(&parse_jeprof_rows(&text), site).cum * MIB
}

/// Runs `binary` under memprobe (launch mode) at a 4 KiB interval through
/// its workload; the profile asked for with SIGUSR1 once the workload is
/// done (the program frees all at its exit), and memprobe's stderr.
fn launch_workload(binary: &Path, out: &Path) -> (PathBuf, String) {
    let args = ["--sample-interval", "4096", "-o", out.to_str().unwrap()];
    let (memprobe, mut launched) = Memprobe::launch(&args, binary, &[]);
    assert!(launched.read_line().starts_with("ready "));
    assert_eq!(launched.send("go"), "done");
    memprobe.signal(libc::SIGUSR1);
    let asked = Instant::now();
    while heap_files(out).is_empty() && asked.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(20));
    }
    launched.close();
    let (status, stderr) = memprobe.wait();
    assert!(status.success(), "{stderr}");
    let asked_for = heap_files(out)
        .into_iter()
        .find(|heap| heap_notes(heap).get("reason").map(String::as_str) == Some("SIGUSR1"));
    (asked_for.expect("a snapshot after SIGUSR1"), stderr)
}

#[test]
fn a_stripped_static_executable_is_profiled_by_its_code() {
    let _guard = shared();
    let out = output_dir("by_code_static");
    let (binary, debug_dir) = strip_keeping_debug(&sites_static_fixture(), &out, "sites_bare");
    let mut fixture = Fixture::start(&binary, &[]);
    let (heap, stderr) = profile_workload(&mut fixture, &out, &[]);
    assert!(fixture.finish().success());
    assert_found_by_code(&heap, &stderr, &["free", "sdallocx", "calloc", "realloc"]);
    let keep_4k = reported_bytes(&heap, &debug_dir, "keep_4k");
    assert_within("keep_4k", keep_4k, 2000.0 * 4096.0, 0.1);
    let keep_1m = reported_bytes(&heap, &debug_dir, "keep_1m");
    assert_within("keep_1m", keep_1m, 16.0 * MIB, 0.1);
}

/// As a stripped release build of a Rust service or tool ships, launched
/// by memprobe: before, memprobe attached to glibc alone, saw nothing of
/// jemalloc and said nothing.
#[test]
fn a_stripped_rust_binary_is_launched_and_profiled_by_its_code() {
    let _guard = shared();
    assert_rust_profiled_by_code(&rust_fixture(), "by_code_rust", &["sdallocx", "realloc"]);
}

/// The same program on tikv-jemallocator 0.4, whose jemalloc is 5.2.1:
/// another fast path, another thread block.
#[test]
fn a_stripped_binary_with_jemalloc_5_2_is_profiled_by_its_code() {
    let _guard = shared();
    let entry_points = ["sdallocx", "realloc", "calloc"];
    let note =
        assert_rust_profiled_by_code(&rust_jemalloc_5_2_fixture(), "by_code_5_2", &entry_points);
    assert!(note.contains("jemalloc 5.2.1, "), "{note}");
}

/// A vendor's engine library: C++, jemalloc linked in and hidden, stripped,
/// loaded by dlopen into a process that has its own (Debian's) jemalloc.
#[test]
fn a_stripped_library_with_hidden_jemalloc_is_found_by_its_code_when_loaded() {
    let _guard = shared();
    let out = output_dir("by_code_library");
    let library = hidden_jemalloc_cxx_library();
    let (library, debug_dir) = strip_keeping_debug(&library, &out, "libhiddenje.so");
    let (heap, stderr) =
        profile_library_loaded_after_attach(&library, &out, Duration::from_secs(3), &[]);
    // operator new[] and the vector's operator new: the same fast path.
    assert_found_by_code(&heap, &stderr, &["operator new"]);
    let kept = reported_bytes(&heap, &debug_dir, "keep_blocks");
    assert_within("keep_blocks", kept, 2000.0 * 4096.0 + 2000.0 * 8.0, 0.1);
}

/// Stripped without jemalloc: profiled as before, nothing found by code.
/// A near miss (jemalloc's strings and a malloc-shaped function, no free
/// of jemalloc's shape): refused in one line, attached or launched, and the
/// launched command never runs.
#[test]
fn what_is_not_jemalloc_is_never_probed_as_jemalloc() {
    let _guard = shared();
    let out = output_dir("by_code_refused");
    let (plain, _) = strip_keeping_debug(&allocators_fixture(), &out, "allocators_bare");
    let fixture = Fixture::start(&plain, &[]);
    let stderr = profile_for_a_second(fixture.pid, &out, &["--verbose"]);
    assert!(!stderr.contains("found by their code"), "{stderr}");
    assert!(stderr.contains("glibc in libc.so.6"), "{stderr}");
    drop(fixture);

    let (near_miss, _) = strip_keeping_debug(&near_miss_fixture(), &out, "near_miss_bare");
    let fixture = Fixture::start(&near_miss, &[]);
    let pid = fixture.pid.to_string();
    let (status, stderr) = run_memprobe(&["--pid", &pid, "--duration", "1s"], &[]);
    assert!(!status.success(), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.contains("no function has the shape of jemalloc's free"),
        "{stderr}"
    );
    drop(fixture);
    let launched = Command::new(memprobe_bin())
        .args(["--duration", "5s", "--"])
        .arg(&near_miss)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&launched.stderr);
    assert!(!launched.status.success(), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(stderr.contains("--debug-dir"), "{stderr}");
    let stdout = String::from_utf8_lossy(&launched.stdout);
    assert!(!stdout.contains("ready"), "the command ran: {stdout}");
}

/// A library loaded after attach whose jemalloc cannot be probed (the near
/// miss) is said on stderr and in the profile, not passed over.
#[test]
fn a_library_loaded_later_with_jemalloc_not_probed_is_said() {
    let _guard = shared();
    let out = output_dir("by_code_loaded_unprobed");
    let (library, _) = strip_keeping_debug(&near_miss_library(), &out, "libnearmiss_bare.so");
    let mut fixture = Fixture::start_command({
        let mut command = Command::new(dlopen_host_fixture());
        command.arg(&library);
        command
    });
    let memprobe = Memprobe::attach(&fixture, &out, &[]);
    fixture.send_and_expect("load", "loaded");
    let needle = format!(
        "{}: jemalloc not probed (no function has the shape of jemalloc's free)",
        library.display()
    );
    memprobe.wait_for_stderr(&needle, Duration::from_secs(3), "not said");
    memprobe.stop();
    let heap = &heap_files(&out)[0];
    let note = heap_notes(heap)
        .get("allocator")
        .cloned()
        .unwrap_or_default();
    assert!(note.contains(&needle), "{note}");
}

/// ruff from PyPI, one of the tools a user found profiled silently wrong:
/// launched by memprobe over a tree of Python files, its jemalloc is found
/// by its code and its allocations are seen.
#[test]
fn ruff_from_pypi_is_profiled_by_its_code() {
    let _guard = shared();
    let ruff = ruff_from_pypi();
    let out = output_dir("by_code_ruff");
    let tree = out.join("tree");
    std::fs::create_dir_all(&tree).unwrap();
    for i in 0..100 {
        let functions: String = (0..40)
            .map(|f| {
                format!("def f{f}(x, y):\n    z = [x] * {f}\n    return {{'a': z, 'b': y}}\n\n")
            })
            .collect();
        std::fs::write(
            tree.join(format!("m{i}.py")),
            format!("import os\n{functions}"),
        )
        .unwrap();
    }
    let output = Command::new(memprobe_bin())
        .args(["--sample-interval", "4096", "--max-overhead", "none"])
        .args(["-o", out.to_str().unwrap(), "--"])
        .arg(&ruff)
        .args([
            "check",
            "--isolated",
            "--no-cache",
            "--exit-zero",
            "--select",
            "ALL",
        ])
        .arg(&tree)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert!(output.status.success(), "{stderr}");
    let heaps = heap_files(&out);
    assert_eq!(heaps.len(), 1, "{stderr}");
    assert_found_by_code(&heaps[0], &stderr, &["sdallocx", "realloc", "calloc"]);
    let calls = heap_notes(&heaps[0])["allocators"].clone();
    let jemalloc_calls: u64 = calls
        .split("jemalloc in ruff: ")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next()?.parse().ok())
        .unwrap_or(0);
    assert!(jemalloc_calls > 10_000, "{calls}\n{stderr}");
}

/// A 500 MB stripped file (the static sites program with 500 MB more in a
/// section no code reads, as a data engine's library is that large): memprobe
/// pages in what it reads (headers, read-only data, the code at function
/// starts), never the whole file. The figures go to docs/getting-started.md.
#[test]
fn a_500_mb_stripped_file_costs_memprobe_little_memory_and_time() {
    let _guard = shared();
    let out = output_dir("by_code_500mb");
    let (small, _) = strip_keeping_debug(&sites_static_fixture(), &out, "sites_small");
    let filler = out.join("filler");
    let mut state: u64 = 0x9e37_79b9_7f4a_7c15;
    let words: Vec<u8> = (0..500 * 1024 * 1024 / 8)
        .flat_map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state.to_le_bytes()
        })
        .collect();
    std::fs::write(&filler, words).unwrap();
    let big = out.join("sites_500mb");
    let section = format!(".filler={}", filler.display());
    let status = Command::new("objcopy")
        .args(["--add-section", &section])
        .arg(&small)
        .arg(&big)
        .status()
        .unwrap();
    assert!(status.success());
    std::fs::remove_file(&filler).unwrap();
    assert!(std::fs::metadata(&big).unwrap().len() > 500 * 1024 * 1024);

    let args = ["--sample-interval", "4096", "-o", out.to_str().unwrap()];
    let started = Instant::now();
    let (memprobe, mut launched) = Memprobe::launch(&args, &big, &[]);
    let ready = launched.read_line();
    let start_up = started.elapsed();
    assert!(ready.starts_with("ready "), "{ready}");
    assert_eq!(launched.send("go"), "done");
    let peak_kib = peak_rss_kib(memprobe.pid());
    launched.close();
    let (status, stderr) = memprobe.wait();
    assert!(status.success(), "{stderr}");
    eprintln!(
        "500 MB stripped file: started in {:.2} s, memprobe's peak RSS {} MiB",
        start_up.as_secs_f64(),
        peak_kib / 1024
    );
    assert!(stderr.contains("found by their code"), "{stderr}");
    assert!(peak_kib < 150 * 1024, "peak RSS {peak_kib} KiB\n{stderr}");
    assert!(start_up < Duration::from_secs(20), "{start_up:?}\n{stderr}");
}
