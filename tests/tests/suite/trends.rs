//! One run of the trends fixture (a leak, a working set, a burst) with a
//! snapshot every second, read four ways: the snapshots themselves, the
//! leak ranking, flame graphs, and `report --base` against jeprof's.
use std::{path::PathBuf, sync::OnceLock};

use tests::*;

const MIB_F: f64 = MIB;

/// In-use MiB of each trend site in one snapshot.
pub(super) fn sites(binary: &std::path::Path, heap: &std::path::Path) -> (f64, f64, f64) {
    let inuse = jeprof_text(binary, heap, "--inuse_space");
    let get = |name: &str| inuse.get(name).copied().unwrap_or(0.0);
    (get("leak_steadily"), get("working_set"), get("burst"))
}

/// What the run left: its folder, snapshots, stderr, and per snapshot the
/// (leak, working set, burst) MiB in use.
struct TrendRun {
    binary: PathBuf,
    out: PathBuf,
    pid: u32,
    heaps: Vec<PathBuf>,
    stderr: String,
    series: Vec<(f64, f64, f64)>,
}

/// The run, made once for the tests of this file.
fn trend_run() -> &'static TrendRun {
    static RUN: OnceLock<TrendRun> = OnceLock::new();
    RUN.get_or_init(|| {
        let _guard = shared();
        let binary = trends_fixture();
        let out = output_dir("interval");
        let mut fixture = Fixture::start(&binary, &[]);
        let memprobe = Memprobe::attach(
            &fixture,
            &out,
            // At 64 KiB the churned working set's estimate moves by about its
            // sampling noise between snapshots; the classifier must allow for
            // it (a fixed allowance once called it a leak).
            &["--interval", "1s", "--sample-interval", "64KiB"],
        );
        fixture.run_workload();
        let stderr = memprobe.stop();
        let heaps = heap_files(&out);
        let series = heaps.iter().map(|h| sites(&binary, h)).collect();
        TrendRun {
            pid: fixture.pid,
            binary,
            out,
            heaps,
            stderr,
            series,
        }
    })
}

#[test]
fn interval_snapshots_show_each_trend() {
    let run = trend_run();
    let (heaps, series, stderr) = (&run.heaps, &run.series, &run.stderr);
    assert!(heaps.len() >= 6, "{} snapshots: {stderr}", heaps.len());
    // Numbered in order, each complete, each saying why it was taken.
    for (seq, heap) in heaps.iter().enumerate() {
        let notes = heap_notes(heap);
        assert_eq!(notes["snapshot"], seq.to_string());
        let expected = if seq + 1 == heaps.len() {
            "end of run"
        } else {
            "interval"
        };
        assert_eq!(notes["reason"], expected, "{}", heap.display());
    }
    // The summary names the folder and counts the files by format.
    let n = heaps.len();
    // Then the mappings' profiles, of the snapshots that saw mappings made.
    let written = format!(
        "wrote {n} snapshots to {} ({n} heap, {n} pb.gz, {n} folded, {n} svg, {n} sym.heap",
        run.out.display()
    );
    assert!(stderr.contains(&written), "{written}\n{stderr}");
    eprintln!("(leak, working set, burst) MiB per snapshot: {series:?}");
    let last = series.last().unwrap();
    // The leak grows from snapshot to snapshot and ends near 15 MiB.
    for pair in series.windows(2) {
        assert!(pair[1].0 >= pair[0].0 - 0.5, "leak shrank: {series:?}");
    }
    assert_within("leak at the end", last.0 * MIB_F, 15.0 * MIB_F, 0.15);
    // The working set stays near 8 MiB, each snapshot a fresh draw of its
    // 128 objects' samples (each sampled with p = 1 - 1/e at 64 KiB): four
    // standard errors, 27% (at 20%, three, one run in 60 would fail by
    // chance).
    let p = 1.0 - (-1.0f64).exp();
    let bound = 4.0 * ((1.0 - p) / (128.0 * p)).sqrt();
    for s in &series[1..] {
        assert_within("working set", s.1 * MIB_F, 8.0 * MIB_F, bound);
    }
    // The burst rose to ~16 MiB and went back to nothing.
    let peak = series.iter().map(|s| s.2).fold(0.0, f64::max);
    assert_within("burst at its peak", peak * MIB_F, 16.0 * MIB_F, 0.15);
    assert!(last.2 < 0.5, "burst still in use at the end: {series:?}");
}

#[test]
fn leaks_ranks_the_leak_first_and_tells_the_others_apart() {
    let run = trend_run();
    let (out, stderr) = (&run.out, &run.stderr);
    // The end of the run summarises the ranking...
    assert!(
        stderr.contains(&format!(
            "memprobe: pid {} over {} snapshots:",
            run.pid,
            run.heaps.len()
        )),
        "{stderr}"
    );
    // ...and `memprobe leaks` ranks the leak first and tells the others apart.
    let (status, report) = memprobe_stdout(&["leaks", out.to_str().unwrap()]);
    assert!(status.success(), "{report}");
    let rows: Vec<&str> = report.lines().filter(|l| l.contains(" < main")).collect();
    assert!(
        rows[0].contains("likely leak") && rows[0].contains("leak_steadily"),
        "{report}"
    );
    let row = |site: &str| {
        *rows
            .iter()
            .find(|r| r.contains(site))
            .unwrap_or_else(|| panic!("{report}"))
    };
    assert!(row("working_set").contains("working set"), "{report}");
    assert!(row("burst").contains("released after burst"), "{report}");
    // The leak's oldest allocation is as old as the run, about 6 s.
    assert!(rows[0].contains(" no "), "a leak never shrank: {report}");
    // --min-age keeps only sites with allocations older than the run.
    let (status, old_only) = memprobe_stdout(&["leaks", out.to_str().unwrap(), "--min-age", "1h"]);
    assert!(status.success());
    assert!(!old_only.contains("leak_steadily"), "{old_only}");
}

#[test]
fn flame_graphs_of_a_snapshot_and_of_its_growth() {
    let run = trend_run();
    let (out, heaps) = (&run.out, &run.heaps);
    // Flame graphs of the last snapshot, and of its growth since the first.
    let svg = out.join("inuse.svg");
    let diff_svg = out.join("growth.svg");
    let (first, last_heap) = (
        heaps[0].to_str().unwrap(),
        heaps.last().unwrap().to_str().unwrap(),
    );
    let (status, text) = memprobe_stdout(&["flamegraph", last_heap, "-o", svg.to_str().unwrap()]);
    assert!(status.success(), "{text}");
    let (status, text) = memprobe_stdout(&[
        "flamegraph",
        last_heap,
        "--base",
        first,
        "-o",
        diff_svg.to_str().unwrap(),
    ]);
    assert!(status.success(), "{text}");
    let plain = std::fs::read_to_string(&svg).unwrap();
    assert!(plain.contains("leak_steadily") && plain.contains("working_set"));
    let grown = std::fs::read_to_string(&diff_svg).unwrap();
    // The leak grew since the first snapshot: drawn red.
    let leak = grown
        .split("<g>")
        .find(|g| g.contains("<title>leak_steadily"))
        .expect("leak frame");
    assert!(leak.contains("rgb(255,"), "{leak}");
}

#[test]
fn report_base_gives_jeprofs_numbers_since_the_bursts_peak() {
    let run = trend_run();
    let (binary, heaps, series) = (&run.binary, &run.heaps, &run.series);
    // What changed since the burst's peak: memprobe report --base gives
    // jeprof --base's numbers. (The peak, not a fixed snapshot: under load the
    // second snapshot may come before the burst, leaving it no change.)
    let peak_snapshot = (0..series.len())
        .max_by(|&a, &b| series[a].2.total_cmp(&series[b].2))
        .unwrap();
    let (old, new) = (
        heaps[peak_snapshot].to_str().unwrap(),
        heaps.last().unwrap().to_str().unwrap(),
    );
    let (status, text) = memprobe_stdout(&["report", new, "--base", old]);
    assert!(status.success(), "{text}");
    let jeprof = std::process::Command::new("jeprof")
        .args(["--text", &format!("--base={old}")])
        .arg(binary)
        .arg(new)
        .output()
        .unwrap();
    let jeprof = String::from_utf8_lossy(&jeprof.stdout);
    let (mine, theirs) = (parse_jeprof_rows(&text), parse_jeprof_rows(&jeprof));
    // A site with no change at all (the working set may hold exactly as many
    // samples as before) is listed by neither: count it as 0 on both sides.
    let flat = |rows: &[JeprofRow], site: &str| {
        rows.iter().find(|r| r.name == site).map_or(0.0, |r| r.flat)
    };
    for site in ["leak_steadily", "working_set", "burst"] {
        let (a, b) = (flat(&mine, site), flat(&theirs, site));
        assert!(
            (a - b).abs() <= 0.1,
            "{site}: {a} vs jeprof {b}\n{text}\n{jeprof}"
        );
    }
    for changed in ["leak_steadily", "burst"] {
        assert!(
            mine.iter().any(|r| r.name == changed),
            "{changed} missing: {text}"
        );
    }
    let burst = mine.iter().find(|r| r.name == "burst").unwrap();
    assert!(burst.flat < -10.0, "the burst was released since: {text}");
    let total = |t: &str| {
        t.lines()
            .find_map(|l| l.strip_prefix("Total: ").map(str::to_owned))
    };
    assert_eq!(total(&text), total(&jeprof));
}
