//! `--sampling slow-path`: jemalloc's malloc and operator new sampled on
//! its slow path. Most calls no longer trap, and every fixture's sites are
//! still within 10% of the truth as the real jeprof reads them.
use std::path::{Path, PathBuf};

use tests::*;

/// Profiles `binary`'s workload sampled on the slow path at 4 KiB; the
/// profile, and the allocation calls that trapped per the summary.
fn on_slow_path(binary: &Path, test: &str, env: &[(&str, &str)]) -> (PathBuf, u64) {
    let out = output_dir(test);
    let mut fixture = Fixture::start(binary, env);
    let flags = ["--sampling", "slow-path", "--verbose"];
    let (heap, stderr) = profile_workload(&mut fixture, &out, &flags);
    assert!(fixture.finish().success());
    assert!(
        stderr.contains("malloc and operator new sampled on jemalloc's slow path"),
        "{stderr}"
    );
    (heap, summary_count(&stderr, " allocation calls"))
}

fn flat(rows: &[JeprofRow], name: &str) -> f64 {
    row(rows, name).flat * MIB
}

#[test]
fn sites_fixture_on_the_slow_path() {
    let _guard = shared();
    let binary = sites_fixture();
    let (heap, trapped) = on_slow_path(&binary, "slow_path_sites", &[]);
    // 52,016 mallocs; only the 16 large ones are counted at their call.
    assert!(trapped < 1000, "{trapped} allocation calls trapped");
    let inuse = jeprof_rows(&binary, &heap, "--inuse_space");
    assert_within("keep_1m", flat(&inuse, "keep_1m"), 16.0 * MIB, 0.10);
    assert_within("keep_4k", flat(&inuse, "keep_4k"), 2000.0 * 4096.0, 0.10);
    let allocated = jeprof_rows(&binary, &heap, "--alloc_space");
    assert_within(
        "churn_512",
        flat(&allocated, "churn_512"),
        50_000.0 * 512.0,
        0.10,
    );
}

#[test]
fn rust_on_tikv_jemallocator_on_the_slow_path() {
    let _guard = shared();
    let binary = rust_fixture();
    let (heap, _) = on_slow_path(&binary, "slow_path_rust", &[]);
    assert_rust_kept_in_use(&binary, &heap);
    assert_rust_churn_allocated(&binary, &heap);
}

/// jemalloc's C entry points on memprobe's own sampling (the Rust
/// fixture's `c_api.rs`): a realloc frees its old pointer unless it fails,
/// so `keep_failed_realloc`'s regions stay in use, and `allocate_small`'s,
/// moved by reallocs that succeeded, do not. With uprobe sessions and with
/// uretprobes (kernels before 6.13).
#[test]
fn a_failed_realloc_leaves_its_region_in_use() {
    let _guard = shared();
    let binary = rust_fixture();
    for return_probes in ["sessions", "uretprobes"] {
        let out = output_dir(&format!("slow_path_failed_realloc_{return_probes}"));
        let mut fixture = Fixture::start(&binary, &[("FIXTURE_C_SHAPES", "1")]);
        let flags = ["--return-probes", return_probes];
        let (heap, stderr) = profile_workload(&mut fixture, &out, &flags);
        assert!(fixture.finish().success());
        let inuse = jeprof_rows(&binary, &heap, "--inuse_space");
        let cum = |name: &str| row(&inuse, name).cum * MIB;
        let failed = cum("keep_failed_realloc");
        assert_within(return_probes, failed, 1000.0 * 4096.0, 0.10);
        let grown = cum("grow_by_realloc");
        assert_within(return_probes, grown, 1000.0 * 3072.0, 0.10);
        assert_moved_regions_freed(&inuse, &format!("{return_probes}\n{stderr}"));
    }
}

/// The default is the slow path; a jemalloc whose fast path is not 5.3's
/// (tikv-jemallocator 0.4, jemalloc 5.2.1) is sampled at entry instead,
/// said in the profile, and its sites are as accurate.
#[test]
fn a_build_not_recognised_is_sampled_at_entry() {
    let _guard = shared();
    let binary = rust_jemalloc_5_2_fixture();
    let out = output_dir("slow_path_unrecognised");
    let mut fixture = Fixture::start(&binary, &[]);
    let (heap, stderr) = profile_workload(&mut fixture, &out, &["--verbose"]);
    assert!(fixture.finish().success());
    let notes = heap_notes(&heap);
    let note = notes
        .get("malloc_sampling")
        .unwrap_or_else(|| panic!("no malloc_sampling note\n{stderr}"));
    assert!(
        note.ends_with(
            "at entry (its malloc fast path is not a jemalloc 5.3 build memprobe recognises)"
        ),
        "{note}"
    );
    assert!(stderr.contains(": _rjem_malloc at "), "{stderr}");
    assert_rust_kept_in_use(&binary, &heap);
}

#[test]
fn cxx_new_on_the_slow_path() {
    let _guard = shared();
    let binary = new_delete_fixture();
    let (heap, _) = on_slow_path(&binary, "slow_path_cxx", &[]);
    let inuse = jeprof_rows(&binary, &heap, "--inuse_space");
    assert_within(
        "keep_nodes (new)",
        flat(&inuse, "keep_nodes"),
        2000.0 * 4096.0,
        0.10,
    );
    assert_within(
        "keep_arrays (new[])",
        flat(&inuse, "keep_arrays"),
        16.0 * MIB,
        0.10,
    );
    let allocated = jeprof_rows(&binary, &heap, "--alloc_space");
    let churn = flat(&allocated, "churn_objects");
    assert_within("churn_objects allocated", churn, 50_000.0 * 512.0, 0.10);
}

/// Every entry-point shape with jemalloc preloaded: calloc, realloc(NULL)
/// and posix_memalign keep their entry probes, malloc goes to the slow
/// path, and their bytes are not counted twice.
#[test]
fn each_shape_on_the_slow_path() {
    let _guard = shared();
    let binary = allocators_fixture();
    let preload = [("LD_PRELOAD", "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2")];
    let (heap, _) = on_slow_path(&binary, "slow_path_shapes", &preload);
    let inuse = jeprof_rows(&binary, &heap, "--inuse_space");
    for (site, truth) in [
        ("keep_1m", 16.0 * MIB),
        ("keep_4k", 2000.0 * 4096.0),
        ("keep_realloc", 768.0 * 8192.0),
        ("keep_aligned", 2000.0 * 2048.0),
        ("keep_calloc", 4096.0 * 1024.0),
    ] {
        assert_within(site, flat(&inuse, site), truth, 0.10);
    }
}

/// Runs the aliasing fixture (14 s unless `env` says) under `--sampling slow-path` at a
/// 1 KiB interval (and `extra`); stderr and the profile.
fn trial(test: &str, env: &[(&str, &str)], extra: &[&str]) -> (String, PathBuf) {
    let out = output_dir(test);
    let mut fixture = Fixture::start(&aliasing_fixture(), env);
    let mut flags = vec![
        "--sampling",
        "slow-path",
        // 1 KiB: cycle_16's 1.6 MB then takes ~1,500 samples, so 10%
        // is four standard errors (at 4 KiB it was two).
        "--sample-interval",
        "1024",
        "--max-overhead",
        "none",
        "-v",
    ];
    flags.extend_from_slice(extra);
    let memprobe = Memprobe::attach(&fixture, &out, &flags);
    fixture.run_workload();
    let stderr = memprobe.stop();
    assert!(fixture.finish().success());
    let heaps = heap_files(&out);
    assert_eq!(heaps.len(), 1, "{stderr}");
    (stderr, heaps[0].clone())
}

/// 48 bytes then 16, again and again: the thread threshold (every 64 KiB)
/// always falls on the same call, which would take every byte. The trial
/// against entry sampling catches it, goes back to entry sampling and says
/// so; the sites in use are then right.
#[test]
fn an_allocation_cycle_that_aliases_falls_back_to_entry_sampling() {
    let _guard = shared();
    // 28 s: after the trial (10 to 16 s: slices of one to three ticks),
    // time enough for entry sampling to see every kept object replaced,
    // even on a loaded machine.
    let (stderr, heap) = trial("slow_path_aliasing", &[("FIXTURE_SECONDS", "28")], &[]);
    assert!(stderr.contains("back to entry sampling"), "{stderr}");
    let note = malloc_sampling_note(&heap);
    assert!(
        note.contains("at entry (jemalloc's slow path disagreed"),
        "{note}"
    );
    assert_cycle_sites(&heap, &stderr);
}

/// cycle_48's and cycle_16's bytes in use within 10%; the profile's notes,
/// both sites' estimates and memprobe's output if not.
fn assert_cycle_sites(heap: &Path, stderr: &str) {
    let inuse = jeprof_rows(&aliasing_fixture(), heap, "--inuse_space");
    let (b48, b16) = (flat(&inuse, "cycle_48"), flat(&inuse, "cycle_16"));
    let ok = |bytes: f64, truth: f64| (bytes - truth).abs() <= 0.10 * truth;
    assert!(
        ok(b48, 100_000.0 * 48.0) && ok(b16, 100_000.0 * 16.0),
        "cycle_48 {b48:.0} B (truth 4800000), cycle_16 {b16:.0} B (truth 1600000); {:?}\n{stderr}",
        heap_notes(heap)
    );
}

/// The same two sites with irregular sizes: the slow path agrees with
/// entry sampling and is kept.
#[test]
fn irregular_sizes_keep_the_slow_path() {
    let _guard = shared();
    let (stderr, heap) = trial(
        "slow_path_irregular",
        &[("FIXTURE_IRREGULAR", "1"), ("FIXTURE_SECONDS", "24")],
        &[],
    );
    assert!(!stderr.contains("back to entry sampling"), "{stderr}");
    let note = malloc_sampling_note(&heap);
    assert!(
        note.contains("on jemalloc's slow path (its sites' shares agreed"),
        "{note}"
    );
}

/// A program that changes its ways: irregular sizes through the first
/// trial, which keeps the slow path, then the aliasing cycle (from 24 s).
/// A re-check (every 2 s here, an hour by default) catches it and goes
/// back to entry sampling. (Re-checks go on, half of each on the aliased
/// slow path: the sites' accuracy after a fallback is the aliasing test's.)
#[test]
fn a_recheck_catches_a_cycle_that_began_later() {
    let _guard = shared();
    let env = [("FIXTURE_IRREGULAR", "1"), ("FIXTURE_CYCLE_AFTER_S", "24")];
    let said = ("stays on jemalloc's slow path", "back to entry sampling");
    let stderr = recheck(
        "slow_path_recheck",
        &env,
        said,
        "at entry (jemalloc's slow path disagreed",
    );
    // Every swap of the re-checks put each part back into its own probe
    // slots: the run used those first attached and the served entry
    // points' (malloc and operator new's, at most four), not ~25 a trial.
    let first = number_in(&stderr, "attached ", " probes to pid");
    let slots = number_in(&stderr, "memprobe: ", " probe counter slots used");
    assert!(
        first > 0 && slots <= first + 4,
        "{first} then {slots}: {stderr}"
    );
}

/// The other way round: the aliasing cycle through the first trial, which
/// goes back to entry sampling, then irregular sizes (from 24 s). A
/// re-check finds the slow path agreeing again and returns to it.
#[test]
fn a_recheck_returns_to_the_slow_path_once_the_cycle_ended() {
    let _guard = shared();
    let env = [("FIXTURE_IRREGULAR_AFTER_S", "24")];
    let said = ("back to entry sampling", "on jemalloc's slow path again");
    let kept = "on jemalloc's slow path (its sites' shares agreed";
    recheck("slow_path_return", &env, said, kept);
}

/// The fixture for 60 s with `env`, re-checked every 2 s: memprobe says
/// `said.0`, later `said.1`, and the profile's last note has `note`.
/// Returns memprobe's output.
fn recheck(test: &str, env: &[(&str, &str)], said: (&str, &str), note: &str) -> String {
    let env = [env, &[("FIXTURE_SECONDS", "60")]].concat();
    let (stderr, heap) = trial(test, &env, &["--recheck-every", "2s"]);
    let first = stderr.find(said.0);
    let then = stderr.find(said.1);
    assert!(
        first.zip(then).is_some_and(|(first, then)| first < then),
        "{stderr}"
    );
    let last = malloc_sampling_note(&heap);
    assert!(last.contains(note), "{last}");
    stderr
}

/// The number between `before` and `after` on the first line that has both.
fn number_in(text: &str, before: &str, after: &str) -> usize {
    text.lines()
        .find_map(|line| {
            let (head, _) = line.split_once(after)?;
            head.rsplit_once(before)?.1.trim().parse().ok()
        })
        .unwrap_or(0)
}
