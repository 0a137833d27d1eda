//! Every output format of a snapshot, read by the tools people use, with
//! the profiled binary gone: pprof, a self-symbolized .heap for jeprof,
//! folded stacks, a flame graph.
use std::{io::Write, process::Command};

use tests::*;

#[test]
fn every_format_reads_without_the_binary() {
    let _guard = shared();
    let (out, stderr) = profile_a_deleted_binary();
    let file = |ext: &str| {
        let found = std::fs::read_dir(&out)
            .unwrap()
            .flatten()
            .map(|e| e.path())
            .find(|p| p.to_string_lossy().ends_with(&format!(".0.{ext}")));
        found.unwrap_or_else(|| panic!("no .{ext} file: {stderr}"))
    };
    assert_pprof_sites(&file("pb.gz"));
    assert_jeprof_and_folded(&file("sym.heap"), &file("folded"), &file("heap"));
    // The flame graph names the sites and counts bytes.
    let svg = std::fs::read_to_string(file("svg")).unwrap();
    assert!(svg.contains("keep_1m") && svg.contains("keep_4k") && svg.contains("bytes"));
}

/// The sites fixture launched from a private copy, profiled to its end,
/// the copy deleted: the output folder and memprobe's stderr.
fn profile_a_deleted_binary() -> (std::path::PathBuf, String) {
    let out = output_dir("formats");
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
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert!(output.status.success(), "{stderr}");
    std::fs::remove_file(&app).unwrap();
    (out, stderr)
}

/// go tool pprof: symbolized, no binary needed, sites in order, each
/// sample type's values against what the fixture did.
fn assert_pprof_sites(pb: &std::path::Path) {
    let top = pprof_top(pb, "inuse_space", &[]);
    let position = |name: &str| {
        top.find(name)
            .unwrap_or_else(|| panic!("{name} not in:\n{top}"))
    };
    assert!(position("keep_1m") < position("keep_4k"), "{top}");
    for (sample_type, site, truth) in [
        ("inuse_space", "keep_1m", 16.0 * 1048576.0),
        ("inuse_space", "keep_4k", 2000.0 * 4096.0),
        ("inuse_objects", "keep_4k", 2000.0),
        ("inuse_objects", "keep_1m", 16.0),
        ("alloc_space", "churn_512", 50000.0 * 512.0),
        ("alloc_objects", "churn_512", 50000.0),
    ] {
        let top = pprof_top(pb, sample_type, &[]);
        assert_within(
            &format!("pprof {sample_type} {site}"),
            pprof_flat(&top, site),
            truth,
            0.1,
        );
    }
}

/// jeprof reads the self-symbolized .heap alone; folded stacks sum to the
/// bytes in use, root first.
fn assert_jeprof_and_folded(
    sym_heap: &std::path::Path,
    folded: &std::path::Path,
    heap: &std::path::Path,
) {
    let jeprof = Command::new("jeprof")
        .arg("--text")
        .arg(sym_heap)
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
    let folded = std::fs::read_to_string(folded).unwrap();
    let total: f64 = folded
        .lines()
        .map(|l| l.rsplit_once(' ').unwrap().1.parse::<f64>().unwrap())
        .sum();
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
    let heap = std::fs::read_to_string(heap).unwrap();
    assert!(heap.starts_with("heap_v2/4096"));
}

#[test]
fn format_chooses_the_files() {
    let _guard = shared();
    let binary = sites_fixture();
    let out = output_dir("format_choice");
    let fixture = Fixture::start(&binary, &[]);
    let pid = fixture.pid.to_string();
    profile_for_a_second(fixture.pid, &out, &["--format", "pb.gz,svg"]);
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

/// `memprobe report` against `jeprof --text` on the same files: memprobe's
/// own profile and jemalloc's own dump of the same fixture.
#[test]
fn report_gives_jeprofs_numbers() {
    let _guard = shared();
    let binary = sites_fixture();
    let out = output_dir("report");
    let mut fixture = Fixture::start(&binary, &[]);
    let (ours, _) = profile_workload(&mut fixture, &out, &["--format", "heap"]);
    let dump = out.join("jemalloc.dump");
    let mut own = Fixture::start(
        &binary,
        &[
            ("MALLOC_CONF", "prof:true,lg_prof_sample:12,prof_accum:true"),
            ("FIXTURE_PROF_DUMP", dump.to_str().unwrap()),
        ],
    );
    own.run_workload();
    assert!(own.finish().success());
    for heap in [&ours, &dump] {
        for (measure, flag) in [
            ("inuse-space", "--inuse_space"),
            ("alloc-space", "--alloc_space"),
        ] {
            let (status, text) =
                memprobe_stdout(&["report", heap.to_str().unwrap(), "--measure", measure]);
            assert!(status.success(), "{text}");
            let mine = parse_jeprof_rows(&text);
            let theirs = jeprof_rows(&binary, heap, flag);
            // churn_512 frees all it allocates: in use it may fall below
            // jeprof's display threshold; allocated, it never does.
            let churn_required = measure == "alloc-space";
            for site in ["keep_1m", "keep_4k", "churn_512", "main"] {
                let (Some(a), Some(b)) = (
                    mine.iter().find(|r| r.name == site),
                    theirs.iter().find(|r| r.name == site),
                ) else {
                    assert!(
                        site == "churn_512" && !churn_required,
                        "{} {measure}: {site} missing:\nmemprobe {mine:?}\njeprof {theirs:?}",
                        heap.display()
                    );
                    continue;
                };
                assert!(
                    (a.flat - b.flat).abs() <= 0.1 && (a.cum - b.cum).abs() <= 0.1,
                    "{} {measure} {site}: memprobe {a:?} vs jeprof {b:?}",
                    heap.display()
                );
            }
            let total = |t: &str| {
                t.lines()
                    .find_map(|l| l.strip_prefix("Total: ").map(str::to_owned))
            };
            let jeprof_text = Command::new("jeprof")
                .args(["--text", flag])
                .arg(&binary)
                .arg(heap)
                .output()
                .unwrap();
            assert_eq!(
                total(&text),
                total(&String::from_utf8_lossy(&jeprof_text.stdout)),
                "{measure}"
            );
        }
    }
}

#[test]
fn convert_to_pprof_and_folded() {
    let _guard = shared();
    let binary = sites_fixture();
    let out = output_dir("convert");
    let mut fixture = Fixture::start(&binary, &[]);
    let (heap, _) = profile_workload(&mut fixture, &out, &["--format", "heap"]);
    let pb = out.join("converted.pb.gz");
    let folded = out.join("converted.folded");
    for (to, path) in [("pprof", &pb), ("folded", &folded)] {
        let (status, text) = memprobe_stdout(&[
            "convert",
            heap.to_str().unwrap(),
            "--to",
            to,
            "-o",
            path.to_str().unwrap(),
        ]);
        assert!(status.success(), "{text}");
    }
    let top = pprof_top(&pb, "inuse_space", &[]);
    assert!(
        top.find("keep_1m").unwrap() < top.find("keep_4k").unwrap(),
        "{top}"
    );
    let folded = std::fs::read_to_string(&folded).unwrap();
    assert!(
        folded
            .lines()
            .any(|l| l.contains("__libc_start_call_main;main;keep_1m ")),
        "{folded}"
    );
}

/// An inlined function is a frame of its own, in memprobe's report and in
/// the self-symbolized profile jeprof reads; Rust names are demangled.
#[test]
fn inlined_functions_are_frames_and_rust_names_are_demangled() {
    let _guard = shared();
    let binary = inlined_fixture();
    let out = output_dir("inlined");
    let mut fixture = Fixture::start(&binary, &[]);
    let (heap, _) = profile_workload(&mut fixture, &out, &["--format", "heap,sym.heap"]);
    let (status, text) = memprobe_stdout(&["report", heap.to_str().unwrap()]);
    assert!(status.success(), "{text}");
    let rows = parse_jeprof_rows(&text);
    let leaf = rows
        .iter()
        .find(|r| r.name == "inlined_alloc")
        .unwrap_or_else(|| panic!("{text}"));
    let outer = rows
        .iter()
        .find(|r| r.name == "outer_keeps")
        .unwrap_or_else(|| panic!("{text}"));
    assert_within("inlined_alloc flat", leaf.flat * MIB, 1000.0 * 8192.0, 0.10);
    assert!(outer.flat < 0.1 && outer.cum >= leaf.flat, "{text}");
    // jeprof shows the inlined function from the symbol section alone.
    let sym = heap.with_extension("sym.heap");
    let jeprof = Command::new("jeprof")
        .arg("--text")
        .arg(&sym)
        .output()
        .unwrap();
    let jeprof = String::from_utf8_lossy(&jeprof.stdout);
    // jeprof marks inlined frames: "inlined_alloc (inline)".
    assert!(
        parse_jeprof_text(&jeprof).contains_key("inlined_alloc (inline)"),
        "{jeprof}"
    );

    // Rust: the tikv-jemallocator fixture's sites by their demangled paths.
    let rust = rust_fixture();
    let out = output_dir("rust_names");
    let mut fixture = Fixture::start(&rust, &[]);
    let (heap, _) = profile_workload(&mut fixture, &out, &["--format", "heap"]);
    let (status, text) = memprobe_stdout(&["report", heap.to_str().unwrap(), "--top", "50"]);
    assert!(status.success(), "{text}");
    assert!(
        text.contains("rust_jemalloc_fixture::keep_vectors"),
        "{text}"
    );
    assert!(
        !text.contains("_ZN") && !text.contains("17h"),
        "mangled names: {text}"
    );
}
