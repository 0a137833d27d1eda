//! Production runs: snapshots over time, growth-triggered dumps, SIGUSR1,
//! and bounded memory when the live table overflows.
use std::time::{Duration, Instant};

use tests::*;

use super::trends::sites;

const MIB_F: f64 = MIB;

#[test]
fn diff_works_on_jemallocs_own_dumps() {
    let _guard = shared();
    let binary = sites_fixture();
    let out = output_dir("diff_jemalloc");
    let (before, after) = (out.join("before.heap"), out.join("after.heap"));
    let mut fixture = Fixture::start(
        &binary,
        &[
            ("MALLOC_CONF", "prof:true,lg_prof_sample:12"),
            ("FIXTURE_PROF_DUMP_BEFORE", before.to_str().unwrap()),
            ("FIXTURE_PROF_DUMP", after.to_str().unwrap()),
        ],
    );
    fixture.run_workload();
    assert!(fixture.finish().success());
    let (status, report) =
        memprobe_stdout(&["diff", before.to_str().unwrap(), after.to_str().unwrap()]);
    assert!(status.success(), "{report}");
    let rows: Vec<&str> = report.lines().skip(2).collect();
    assert!(
        rows[0].contains("keep_1m") && rows[0].contains('+'),
        "{report}"
    );
    assert!(rows[1].contains("keep_4k"), "{report}");
    // The change of the biggest site is about 16 MiB.
    let change: f64 = rows[0]
        .split_whitespace()
        .next()
        .unwrap()
        .trim_start_matches('+')
        .parse()
        .unwrap();
    assert!((14.5..17.5).contains(&change), "{report}");
}

#[test]
fn growth_triggered_dumps_fire_at_the_threshold_and_keep_their_gap() {
    let _guard = shared();
    let binary = trends_fixture();
    let out = output_dir("growth");
    let mut fixture = Fixture::start(&binary, &[]);
    let memprobe = Memprobe::attach(
        &fixture,
        &out,
        &[
            "--dump-on-growth",
            "4MiB/10s",
            "--min-dump-gap",
            "2s",
            "--sample-interval",
            "64KiB",
        ],
    );
    fixture.run_workload();
    let stderr = memprobe.stop();
    let heaps = heap_files(&out);
    let growth: Vec<_> = heaps
        .iter()
        .map(|h| (heap_notes(h), h))
        .filter(|(notes, _)| notes["reason"].starts_with("growth: "))
        .collect();
    // 16 MiB burst plus a 2.5 MiB/s leak over 6 s: several triggers, but
    // never two within the gap.
    assert!(
        growth.len() >= 2,
        "{} growth dumps:\n{stderr}",
        growth.len()
    );
    let mut previous_time: Option<f64> = None;
    for (i, (notes, heap)) in growth.iter().enumerate() {
        let elapsed: f64 = notes["elapsed_s"].parse().unwrap();
        if let Some(previous) = previous_time {
            assert!(
                elapsed - previous >= 1.95,
                "dumps {previous} s and {elapsed} s apart"
            );
        }
        previous_time = Some(elapsed);
        // "growth: +4.3 MiB in 1s (...)": never below the trigger.
        let grown: f64 = notes["reason"]["growth: +".len()..]
            .split_whitespace()
            .next()
            .unwrap()
            .parse()
            .unwrap();
        assert!(grown >= 4.0, "{}", notes["reason"]);
        if i == 0 {
            // From nothing at attach: the first dump's own profile shows it.
            let (leak, working, burst) = sites(&binary, heap);
            assert!((leak + working + burst) >= 0.8 * 4.0, "{}", notes["reason"]);
        }
        assert!(
            stderr.contains(&format!("wrote {}", heap.display())),
            "{stderr}"
        );
    }
}

#[test]
fn sigusr1_writes_a_snapshot_at_once() {
    let _guard = shared();
    let binary = sites_fixture();
    let out = output_dir("sigusr1");
    let mut fixture = Fixture::start(&binary, &[]);
    let memprobe = Memprobe::attach(&fixture, &out, &["--sample-interval", "4096"]);
    fixture.run_workload();
    memprobe.signal(libc::SIGUSR1);
    let asked = Instant::now();
    while heap_files(&out).is_empty() {
        assert!(
            asked.elapsed() < Duration::from_secs(2),
            "no snapshot after SIGUSR1"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let snapshot = &heap_files(&out)[0];
    assert_eq!(heap_notes(snapshot)["reason"], "SIGUSR1");
    let inuse = jeprof_text(&binary, snapshot, "--inuse_space");
    assert_within("keep_1m", inuse["keep_1m"] * MIB_F, 16.0 * MIB_F, 0.10);
    memprobe.stop();
    assert_eq!(heap_files(&out).len(), 2);
}

#[test]
fn an_overflowing_live_table_is_reported_and_memory_stays_bounded() {
    let _guard = shared();
    let binary = sites_fixture();
    let out = output_dir("overflow");
    let mut fixture = Fixture::start(&binary, &[]);
    let pid = fixture.pid.to_string();
    let memprobe = Memprobe::attach(
        &fixture,
        &out,
        // At entry: windows would leave the in-use figures of a busy
        // program to chance.
        &[
            "--sample-interval",
            "4096",
            "--max-live-samples",
            "100",
            "--sampling",
            "entry",
        ],
    );
    fixture.run_workload();
    let peak = peak_rss_kib(memprobe.pid());
    let stderr = memprobe.stop();
    // ~1300 samples of the kept sites cannot all be live in a table of 100.
    let notes = heap_notes(&heap_files(&out)[0]);
    let dropped: u64 = notes["dropped_live_table_full"].parse().unwrap();
    assert!(dropped > 1000, "{notes:?}");
    let summary = stderr
        .lines()
        .find(|l| l.contains(&format!("pid {pid} (sites)")))
        .unwrap();
    assert!(summary.contains(&format!("{dropped} dropped")), "{summary}");
    // The stated cap for this configuration: 64 MiB.
    assert!(peak < 64 * 1024, "memprobe peaked at {peak} KiB");
}

#[test]
fn killed_while_writing_leaves_only_whole_files() {
    let _guard = shared();
    let binary = sites_fixture();
    let out = output_dir("killed");
    let mut fixture = Fixture::start(&binary, &[]);
    fixture.run_workload();
    let pid = fixture.pid.to_string();
    // Snapshots as fast as they come, killed at varying moments.
    for round in 0..5u64 {
        let mut memprobe = Memprobe::start(&[
            "--pid",
            &pid,
            "--interval",
            "20ms",
            "--sample-interval",
            "4096",
            "-o",
            out.to_str().unwrap(),
        ]);
        memprobe.wait_attached();
        std::thread::sleep(Duration::from_millis(150 + 37 * round));
        memprobe.signal(libc::SIGKILL);
        let _ = memprobe.wait();
    }
    let heaps = heap_files(&out);
    assert!(heaps.len() >= 5, "{heaps:?}");
    for heap in &heaps {
        let text = std::fs::read_to_string(heap).unwrap();
        assert!(text.starts_with("heap_v2/4096\n"), "{}", heap.display());
        assert!(
            text.contains("\nMAPPED_LIBRARIES:\n") && text.ends_with('\n'),
            "{} is partial",
            heap.display()
        );
    }
    // Every run started at the next free number: nothing was overwritten.
    let numbers: Vec<String> = heaps
        .iter()
        .map(|h| heap_notes(h)["snapshot"].clone())
        .collect();
    assert!(
        numbers.iter().filter(|n| *n == "0").count() == 5,
        "{numbers:?}"
    );
    // A later run removes the temporaries the killed ones left.
    profile_for_a_second(fixture.pid, &out, &[]);
    let leftovers: Vec<_> = std::fs::read_dir(&out)
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().ends_with(".tmp"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

#[test]
fn a_symlink_in_the_output_folder_is_not_followed() {
    let _guard = shared();
    let binary = sites_fixture();
    let out = output_dir("symlink");
    let victim = out.join("victim");
    std::fs::write(&victim, "precious").unwrap();
    let fixture = Fixture::start(&binary, &[]);
    let pid = fixture.pid;
    // The name memprobe would write first is a planted symlink.
    std::os::unix::fs::symlink(&victim, out.join(format!("memprobe.{pid}.0.heap"))).unwrap();
    let stderr = profile_for_a_second(pid, &out, &[]);
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious");
    assert!(
        out.join(format!("memprobe.{pid}.1.heap")).exists(),
        "{stderr}"
    );
}

/// On a terminal a status line is redrawn in place; through a pipe, none.
#[test]
fn status_line_on_a_terminal_only() {
    let _guard = shared();
    let binary = sites_fixture();
    let out = output_dir("status_line");
    let fixture = Fixture::start(&binary, &[]);
    let pid = fixture.pid.to_string();
    let memprobe = memprobe_bin();
    let command = format!(
        "{} --pid {pid} --duration 3s --interval 1s -o {}",
        memprobe.display(),
        out.display()
    );
    // `script` runs it on a pseudo-terminal.
    let tty = std::process::Command::new("script")
        .args(["-qefc", &command, "/dev/null"])
        .output()
        .expect("running script");
    let text = String::from_utf8_lossy(&tty.stdout);
    assert!(tty.status.success(), "{text}");
    let status = text
        .split(['\r', '\n'])
        .find(|l| l.contains(" elapsed, "))
        .unwrap_or_else(|| panic!("no status line:\n{text}"));
    for part in [
        "elapsed",
        "samples",
        "in use",
        "dropped",
        "snapshots written",
    ] {
        assert!(status.contains(part), "{part} missing from {status:?}");
    }
    let (status, stderr) = run_memprobe(
        &[
            "--pid",
            &pid,
            "--duration",
            "2s",
            "-o",
            out.to_str().unwrap(),
        ],
        &[],
    );
    assert!(status.success());
    assert!(
        !stderr.contains(" elapsed, ") && !stderr.contains('\r'),
        "{stderr}"
    );
}
