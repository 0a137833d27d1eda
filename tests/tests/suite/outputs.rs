//! Every output format of a snapshot, read by the tools people use, with
//! the profiled binary gone: pprof, a self-symbolized .heap for jeprof,
//! folded stacks, a flame graph.
use std::{io::Write, process::Command};

use tests::*;

#[test]
fn every_format_reads_without_the_binary() {
    let _guard = shared();
    let out = output_dir("formats");
    // A private copy of the fixture, deleted once profiled.
    let app = out.join("app");
    std::fs::copy(sites_fixture(), &app).unwrap();
    let mut memprobe = Command::new(memprobe_bin());
    memprobe
        .args([
            "--sample-interval",
            "4096",
            "-o",
            out.to_str().unwrap(),
            "--",
        ])
        .arg(&app)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped());
    let mut child = memprobe.spawn().unwrap();
    let mut stdin = child.stdin.take().unwrap();
    std::thread::sleep(std::time::Duration::from_millis(500));
    writeln!(stdin, "go").unwrap();
    drop(stdin);
    let output = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    std::fs::remove_file(&app).unwrap();

    let file = |ext: &str| {
        let found = std::fs::read_dir(&out)
            .unwrap()
            .flatten()
            .map(|e| e.path())
            .find(|p| p.to_string_lossy().ends_with(&format!(".0.{ext}")));
        found.unwrap_or_else(|| panic!("no .{ext} file: {stderr}"))
    };

    // go tool pprof: symbolized, no binary needed, sites in order.
    let pprof = Command::new("go")
        .args(["tool", "pprof", "-top", "-sample_index=inuse_space"])
        .arg(file("pb.gz"))
        .output()
        .expect("running go tool pprof");
    let top = String::from_utf8_lossy(&pprof.stdout);
    assert!(
        pprof.status.success(),
        "{}",
        String::from_utf8_lossy(&pprof.stderr)
    );
    let position = |name: &str| {
        top.find(name)
            .unwrap_or_else(|| panic!("{name} not in:\n{top}"))
    };
    assert!(position("keep_1m") < position("keep_4k"), "{top}");
    for sample_type in ["alloc_space", "alloc_objects", "inuse_objects"] {
        let other = Command::new("go")
            .args([
                "tool",
                "pprof",
                "-top",
                &format!("-sample_index={sample_type}"),
            ])
            .arg(file("pb.gz"))
            .output()
            .unwrap();
        assert!(other.status.success(), "{sample_type}");
    }

    // jeprof reads the self-symbolized .heap alone.
    let jeprof = Command::new("jeprof")
        .arg("--text")
        .arg(file("sym.heap"))
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&jeprof.stdout);
    let rows = parse_jeprof_text(&text);
    assert_within(
        "keep_1m (jeprof, no binary)",
        rows["keep_1m"] * MIB,
        16.0 * MIB,
        0.10,
    );
    assert_within(
        "keep_4k (jeprof, no binary)",
        rows["keep_4k"] * MIB,
        2000.0 * 4096.0,
        0.10,
    );

    // Folded stacks sum to the bytes in use, root first.
    let folded = std::fs::read_to_string(file("folded")).unwrap();
    let total: f64 = folded
        .lines()
        .map(|l| l.rsplit_once(' ').unwrap().1.parse::<f64>().unwrap())
        .sum();
    let heap = std::fs::read_to_string(file("heap")).unwrap();
    assert!(
        folded.lines().any(|l| l.contains("main;keep_1m ")),
        "{folded}"
    );
    // jeprof's total line: "Total: 23.9 MB".
    let jeprof_total: f64 = text
        .lines()
        .find_map(|l| {
            l.strip_prefix("Total: ")?
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        })
        .expect("jeprof total");
    assert_within(
        "folded total vs jeprof total",
        total,
        jeprof_total * MIB,
        0.01,
    );
    assert!(heap.starts_with("heap_v2/4096"));

    // The flame graph names the sites and counts bytes.
    let svg = std::fs::read_to_string(file("svg")).unwrap();
    assert!(svg.contains("keep_1m") && svg.contains("keep_4k") && svg.contains("bytes"));
}

#[test]
fn format_chooses_the_files() {
    let _guard = shared();
    let binary = sites_fixture();
    let out = output_dir("format_choice");
    let fixture = Fixture::start(&binary, &[]);
    let pid = fixture.pid.to_string();
    let (status, stderr) = run_memprobe(
        &[
            "--pid",
            &pid,
            "--duration",
            "1s",
            "--format",
            "pb.gz,svg",
            "-o",
            out.to_str().unwrap(),
        ],
        &[],
    );
    assert!(status.success(), "{stderr}");
    let mut names: Vec<String> = std::fs::read_dir(&out)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(
        names,
        [
            format!("memprobe.{pid}.0.pb.gz"),
            format!("memprobe.{pid}.0.svg")
        ]
    );
    let (status, stderr) = run_memprobe(&["--pid", &pid, "--format", "png"], &[]);
    assert_eq!(status.code(), Some(2));
    assert!(stderr.contains("unknown format 'png'"), "{stderr}");
}
