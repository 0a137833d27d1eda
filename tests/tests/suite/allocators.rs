//! Beyond jemalloc: glibc's malloc, mimalloc and tcmalloc in real processes,
//! each site's estimate within 10% of the truth as the real jeprof reads it.
use std::{process::Command, time::Duration};

use tests::*;

const LIBMIMALLOC: &str = "/usr/lib/x86_64-linux-gnu/libmimalloc.so.2";
const LIBTCMALLOC: &str = "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4";

/// Truth of tests/fixtures/allocators.c: (function, bytes kept).
const SITES: [(&str, f64); 5] = [
    ("keep_1m", 16.0 * MIB),
    ("keep_4k", 2000.0 * 4096.0),
    ("keep_realloc", 768.0 * 8192.0),
    ("keep_aligned", 2000.0 * 2048.0),
    ("keep_calloc", 4096.0 * 1024.0),
];

/// Profiles the allocators fixture under `env`; checks every site, that the
/// first line and the snapshot name `allocator`, and that it was called.
fn sites_within_10_percent(test: &str, env: &[(&str, &str)], allocator: &str) {
    let _guard = shared();
    let binary = allocators_fixture();
    let out = output_dir(test);
    let mut fixture = Fixture::start(&binary, env);
    let (heap, stderr) = profile_workload(&mut fixture, &out, &[]);
    assert!(fixture.finish().success());
    let first = stderr.lines().next().unwrap_or_default();
    assert!(first.contains(&format!("{allocator} in ")), "{stderr}");
    let notes = heap_notes(&heap);
    let probed = notes.get("allocators").expect("an allocators note");
    let calls: u64 = probed
        .split(", ")
        .find(|part| part.starts_with(&format!("{allocator} in ")))
        .and_then(|part| {
            part.rsplit(": ")
                .next()?
                .strip_suffix(" calls")?
                .parse()
                .ok()
        })
        .unwrap_or_else(|| panic!("no call count for {allocator} in {probed}"));
    assert!(calls >= 56_000, "{allocator}: {calls} calls in {probed}");

    let inuse = jeprof_text(&binary, &heap, "--inuse_space");
    for (site, truth) in SITES {
        let estimate = inuse.get(site).copied().unwrap_or(0.0) * MIB;
        assert_within(
            &format!("{allocator}: {site} in use"),
            estimate,
            truth,
            0.10,
        );
    }
    let churn = inuse.get("churn_512").copied().unwrap_or(0.0) * MIB;
    assert!(churn <= 0.1 * MIB, "{allocator}: churn_512 in use: {churn}");
    // Allocator frames are cut off: no allocator function carries bytes.
    for name in [
        "malloc",
        "mi_malloc",
        "tc_malloc",
        "__libc_malloc",
        "_mid_memalign",
    ] {
        assert!(
            !inuse.contains_key(name),
            "{allocator}: {name} in {inuse:?}"
        );
    }
}

/// realloc(NULL) and posix_memalign pass their call on to malloc inside
/// glibc: each site would read twice its bytes if the inner call counted.
#[test]
fn glibc_malloc_sites_are_within_10_percent() {
    sites_within_10_percent("glibc_sites", &[], "glibc");
}

#[test]
fn mimalloc_preloaded_sites_are_within_10_percent() {
    sites_within_10_percent("mimalloc_sites", &[("LD_PRELOAD", LIBMIMALLOC)], "mimalloc");
}

#[test]
fn tcmalloc_preloaded_sites_are_within_10_percent() {
    sites_within_10_percent("tcmalloc_sites", &[("LD_PRELOAD", LIBTCMALLOC)], "tcmalloc");
}

/// A library with mimalloc linked in (its `mi_*` are local symbols, as in
/// pyarrow's libarrow), loaded after memprobe attached.
#[test]
fn static_mimalloc_in_a_loaded_library() {
    let _guard = shared();
    let host = dlopen_host_fixture();
    let library = mimalloc_library();
    let out = output_dir("static_mimalloc");
    let mut command = Command::new(&host);
    command.arg(&library);
    let mut fixture = Fixture::start_command(command);
    let pid = fixture.pid;
    let memprobe = Memprobe::attach(&fixture, &out, &["--sample-interval", "4096"]);
    fixture.send_and_expect("load", "loaded");
    let needle = format!("pid {pid} loaded mimalloc in {}", library.display());
    memprobe.wait_for_stderr(&needle, Duration::from_secs(3), "not probed in time");
    fixture.run_workload();
    memprobe.stop();
    let heap = &heap_files(&out)[0];
    let inuse = jeprof_rows(&library, heap, "--inuse_space");
    assert_within(
        "keep_blocks in use",
        row(&inuse, "keep_blocks").flat * MIB,
        2000.0 * 4096.0,
        0.10,
    );
}

/// A JVM as Spark runs it, without LD_PRELOAD: its direct ByteBuffers come
/// from glibc's malloc, named under Unsafe_AllocateMemory0.
#[test]
fn jvm_without_preload_sees_direct_buffers_through_glibc() {
    let _guard = shared();
    let out = output_dir("jvm_glibc");
    let mut fixture = Fixture::start_command(java_command("DirectBuffers"));
    let (heap, stderr) = profile_workload(&mut fixture, &out, &["--allocator", "glibc"]);
    assert!(stderr.contains("glibc in "), "{stderr}");
    assert_direct_buffers_in_use(&heap);
}

/// A process whose allocators are never called (pyarrow's jemalloc copy
/// while its pool is mimalloc): said on stderr after 10 s and in the
/// summary, naming them, instead of a silent empty profile.
#[test]
fn allocators_that_are_never_called_are_named() {
    let _guard = shared();
    let out = output_dir("never_called");
    let mut sleeper = Command::new("sleep").arg("60").spawn().unwrap();
    // Met as it starts: memprobe waits for its loader to map libc.
    let pid = sleeper.id();
    let out_arg = out.to_str().unwrap();
    let pid_arg = pid.to_string();
    let args = ["--pid", &pid_arg, "--duration", "12s", "-o", out_arg];
    let (status, stderr) = run_memprobe(&args, &[]);
    let _ = sleeper.kill();
    let _ = sleeper.wait();
    assert!(status.success(), "{stderr}");
    let status_line = format!("pid {pid} (sleep): no allocation call in 10s");
    assert!(stderr.contains(&status_line), "{stderr}");
    let summary = format!(
        "pid {pid}: no allocation call seen through the allocators found (glibc in libc.so.6)"
    );
    assert!(stderr.contains(&summary), "{stderr}");
}
