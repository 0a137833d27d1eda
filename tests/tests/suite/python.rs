//! Python lines above the native frames of a CPython process's
//! allocations, read from outside the interpreter: a fixture in a
//! virtualenv allocates known amounts at known lines through its C
//! extension (the GIL held and released, and from a thread that runs no
//! Python), through numpy, and through pyarrow and polars (each from the
//! jemalloc inside its own library).
use std::time::Duration;

use tests::*;

const MIB: f64 = 1048576.0;
/// Workload rounds, one snapshot apart: the leaks ranking needs growth.
const ROUNDS: usize = 3;

/// A site's Python frame as every output names it: "fixture.py:42 build_index".
fn frame(site: &str) -> String {
    format!("fixture.py:{} {site}", python_site_line(site))
}

/// Bytes under the folded stacks that hold `frame`, and those lines.
fn under<'a>(folded: &'a str, frame: &str) -> (f64, Vec<&'a str>) {
    let lines: Vec<&str> = folded
        .lines()
        .filter(|l| {
            l.split(';')
                .any(|f| f == frame || f.starts_with(&format!("{frame} ")))
        })
        .collect();
    let bytes = lines
        .iter()
        .map(|l| l.rsplit_once(' ').unwrap().1.parse::<f64>().unwrap())
        .sum();
    (bytes, lines)
}

/// Where `name` is among a folded line's frames (root first); a name
/// starting with a space is a Python function at any line.
fn position(line: &str, name: &str) -> usize {
    let stack = line.rsplit_once(' ').unwrap().0;
    stack
        .split(';')
        .position(|f| f == name || (name.starts_with(' ') && f.ends_with(name)))
        .unwrap_or_else(|| panic!("no {name} in {line}"))
}

struct PythonRun {
    heap: std::path::PathBuf,
    folded: String,
    out: std::path::PathBuf,
    stderr: String,
}

/// The fixture's workload, `ROUNDS` times a snapshot apart, profiled at a
/// 64 KiB interval (each 256 KiB block is sampled with chance 98%).
fn python_run(fixture: std::process::Command, test: &str) -> PythonRun {
    let out = output_dir(test);
    let mut fixture = Fixture::start_command(fixture);
    let memprobe = Memprobe::attach(
        &fixture,
        &out,
        &[
            "--sample-interval",
            "65536",
            "--interval",
            "1s",
            "--verbose",
            "--format",
            "heap,folded,pb.gz,svg",
        ],
    );
    for _ in 0..ROUNDS {
        fixture.run_workload();
        std::thread::sleep(Duration::from_millis(1200));
    }
    let stderr = memprobe.stop();
    let heap = heap_files(&out).pop().unwrap_or_else(|| panic!("{stderr}"));
    let folded = std::fs::read_to_string(heap.with_extension("folded")).unwrap();
    PythonRun {
        heap,
        folded,
        out,
        stderr,
    }
}

/// Each site's bytes in use, by its Python line (`blocks` of 256 KiB a
/// round), called from `workload` above it, the native frames it called
/// below it; and the native thread's blocks with no Python frame at all.
fn assert_sites(run: &PythonRun, sites: &[(&str, f64)]) {
    let folded = &run.folded;
    for &(site, blocks) in sites {
        let (bytes, lines) = under(folded, &frame(site));
        assert_within(site, bytes, ROUNDS as f64 * blocks * 0.25 * MIB, 0.10);
        for line in lines {
            assert!(
                position(line, " workload") < position(line, &frame(site)),
                "{line}"
            );
        }
    }
    // The extension's frames stand above the Python line that called them.
    let (_, lines) = under(folded, &frame("build_index"));
    for line in lines {
        assert!(
            position(line, &frame("build_index")) < position(line, "hold"),
            "{line}"
        );
    }
    let (pool, lines) = under(folded, "pool_worker");
    assert_within("pool_worker", pool, ROUNDS as f64 * 16.0 * 0.25 * MIB, 0.10);
    assert!(lines.iter().all(|l| !l.contains("fixture.py")), "{lines:?}");
}

/// Debian 12's 3.11 in a virtualenv: every site in every output.
#[test]
fn python_lines_stand_above_the_native_frames_they_called() {
    let _guard = shared();
    let run = python_run(python_fixture(), "python_3_11");
    let stderr = &run.stderr;
    assert!(
        stderr.contains("runs Python 3.11")
            && stderr.contains("its stacks show their Python lines"),
        "{stderr}"
    );
    let note = &heap_notes(&run.heap)["python"];
    assert!(
        note.starts_with("3.11.") && note.ends_with("frames read"),
        "{note}"
    );
    // The GIL held, released, numpy's, pyarrow's, polars', and Python's
    // own bytearrays.
    let sites = [
        ("build_index", 64.0),
        ("load_columns", 32.0),
        ("numpy_buffers", 48.0),
        ("arrow_buffers", 24.0),
        ("polars_columns", 24.0),
        ("read_blocks", 16.0),
    ];
    assert_sites(&run, &sites);
    // pyarrow's buffers come from the jemalloc inside its libarrow
    // (prefixed, its symbols local), through arrow's own allocator; polars'
    // columns from the one inside its runtime (`_rjem_`), with polars' own
    // Python lines between (its first call also sets up a runtime and
    // imports lazily, under the same line).
    for (site, through) in [
        (
            "arrow_buffers",
            ";arrow::memory_pool::internal::JemallocAllocator::",
        ),
        ("polars_columns", "polars_core::chunked_array::"),
    ] {
        let (_, lines) = under(&run.folded, &frame(site));
        let bytes: f64 = (lines.iter())
            .filter(|l| l.contains(through))
            .map(|l| l.rsplit_once(' ').unwrap().1.parse::<f64>().unwrap())
            .sum();
        assert_within(site, bytes, ROUNDS as f64 * 24.0 * 0.25 * MIB, 0.10);
    }
    let allocators = &heap_notes(&run.heap)["allocators"];
    let calls = |copy: &str| -> u64 {
        allocators
            .split(", ")
            .find_map(|a| a.strip_prefix(&format!("jemalloc in {copy}: ")))
            .and_then(|calls| calls.strip_suffix(" calls")?.parse().ok())
            .unwrap_or_else(|| panic!("no jemalloc in {copy}: {allocators}"))
    };
    assert!(
        calls("libarrow.so.1700") >= ROUNDS as u64 * 24,
        "{allocators}"
    );
    assert!(
        calls("_polars_runtime.abi3.so") >= ROUNDS as u64 * 24,
        "{allocators}"
    );
    // Both copies reach their threads' counters through `__tls_get_addr`,
    // followed through each thread's dtv: sampled in windows.
    let sampling = &heap_notes(&run.heap)["malloc_sampling"];
    for copy in ["libarrow.so.1700", "_polars_runtime.abi3.so"] {
        let windowed = format!("{copy}: malloc and operator new at every call while");
        assert!(sampling.contains(&windowed), "{sampling}");
    }
    assert!(!sampling.contains("at entry"), "{sampling}");

    // pprof: functions with their file and line.
    let top = pprof_top(
        &run.heap.with_extension("pb.gz"),
        "inuse_space",
        &["-lines", "-cum"],
    );
    let fixture_file = fixture_source("python/fixture.py");
    let located = format!(
        "build_index {}:{}",
        fixture_file.display(),
        python_site_line("build_index")
    );
    assert!(top.contains(&located), "{located} not in:\n{top}");
    // The flame graph names the lines.
    let svg = std::fs::read_to_string(run.heap.with_extension("svg")).unwrap();
    assert!(
        svg.contains(&frame("load_columns")),
        "no load_columns line in the svg"
    );
    // So does the report, from the .heap alone: each line's cumulative
    // MiB, within 10%.
    let (status, report) = memprobe_stdout(&["report", run.heap.to_str().unwrap(), "--top", "200"]);
    assert!(status.success(), "{report}");
    for &(site, blocks) in &sites {
        let row = report
            .lines()
            .find(|l| l.ends_with(&frame(site)))
            .unwrap_or_else(|| panic!("no {site} row in:\n{report}"));
        let cumulative: f64 = row.split_whitespace().nth(3).unwrap().parse().unwrap();
        assert_within(
            site,
            cumulative * MIB,
            ROUNDS as f64 * blocks * 0.25 * MIB,
            0.10,
        );
    }
    // The leaks ranking names the Python function that keeps growing.
    let (status, leaks) = memprobe_stdout(&["leaks", run.out.to_str().unwrap()]);
    assert!(status.success(), "{leaks}");
    let named = leaks
        .lines()
        .filter(|l| l.contains("likely leak"))
        .any(|l| l.contains(&frame("build_index")));
    assert!(named, "{leaks}");
}

/// Debian 13's 3.13, forky's 3.14 and sid's 3.15, whose layouts their
/// `_Py_DebugOffsets` give (each version's table laid out otherwise, and
/// from 3.14 on frames' code references tagged).
#[test]
fn python_3_13_to_3_15_lines_come_from_their_debug_offsets() {
    let _guard = shared();
    for version in ["3.13", "3.14", "3.15"] {
        let test = format!("python_{}", version.replace('.', "_"));
        let run = python_run(other_python_fixture(version, true), &test);
        let said = format!("runs Python {version}");
        assert!(run.stderr.contains(&said), "{}", run.stderr);
        let note = &heap_notes(&run.heap)["python"];
        assert!(note.ends_with("frames read"), "{version}: {note}");
        let sites = [
            ("build_index", 64.0),
            ("load_columns", 32.0),
            ("read_blocks", 16.0),
        ];
        assert_sites(&run, &sites);
    }
}

/// A Python memprobe cannot read (3.9, Debian 11's, as old as RHEL 9's:
/// its frames are laid out otherwise than 3.11's and later) keeps its
/// native stacks, with one line that says so: never a wrong frame.
#[test]
fn an_unknown_python_keeps_its_native_stacks() {
    let _guard = shared();
    let run = python_run(other_python_fixture("3.9", false), "python_3_9");
    let said: Vec<&str> = run
        .stderr
        .lines()
        .filter(|l| l.contains("runs Python"))
        .collect();
    assert_eq!(said.len(), 1, "{}", run.stderr);
    assert!(
        said[0].contains("runs Python before 3.11") && said[0].contains("stay native"),
        "{said:?}"
    );
    // So does the profile.
    let note = &heap_notes(&run.heap)["python"];
    assert!(
        note.starts_with("before 3.11 (") && note.contains("frames not read"),
        "{note}"
    );
    // bytearray's blocks are all there, under native frames alone.
    let bytes: f64 = run
        .folded
        .lines()
        .map(|l| l.rsplit_once(' ').unwrap().1.parse::<f64>().unwrap())
        .sum();
    assert!(
        bytes >= ROUNDS as f64 * 16.0 * 0.25 * MIB * 0.9,
        "{}",
        run.folded
    );
    assert!(!run.folded.contains("fixture.py"), "{}", run.folded);
}

/// The offsets memprobe reads CPython 3.11 with are the installed headers'.
#[test]
fn python_3_11_offsets_are_its_headers() {
    use profiler_common::python::{PYTHON_3_11 as O, PYTHON_3_11_CODE as C};
    let binary = build_once("python_offsets", |out| {
        let mut command = std::process::Command::new("cc");
        command
            .args(["-I/usr/include/python3.11", "-o"])
            .arg(out)
            .arg(fixture_source("python/offsets.c"));
        command
    });
    let output = std::process::Command::new(&binary).output().unwrap();
    let text = String::from_utf8_lossy(&output.stdout);
    let headers: std::collections::HashMap<&str, &str> =
        text.lines().filter_map(|l| l.split_once(' ')).collect();
    assert!(headers["version"].starts_with("3.11."), "{text}");
    let ours = [
        ("interpreters_head", O.interpreters_head),
        ("threads_head", O.threads_head),
        ("thread_next", O.thread_next),
        ("native_thread_id", O.native_thread_id),
        ("cframe", O.cframe),
        ("current_frame", O.current_frame),
        ("frame_code", O.frame_code),
        ("frame_previous", O.frame_previous),
        ("frame_instr", O.frame_instr),
        ("frame_marker", O.frame_marker),
        ("code_first_line", O.code_first_line),
        ("filename", C.filename),
        ("qualname", C.qualname),
        ("linetable", C.linetable),
        ("first_instr", C.first_instr),
        ("bytes_size", C.bytes_size),
        ("bytes_data", C.bytes_data),
        ("string_length", C.string_length),
        ("string_state", C.string_state),
        ("ascii_data", C.ascii_data),
        ("compact_data", C.compact_data),
    ];
    for (name, offset) in ours {
        assert_eq!(headers[name], offset.to_string(), "{name}\n{text}");
    }
}

/// Launched, the interpreter is found at the first look at the child's
/// maps after its `exec` (memprobe tracks it from before): within a
/// second, its samples carry their lines.
#[test]
fn a_launched_python_gets_its_lines_too() {
    let _guard = shared();
    let out = output_dir("python_launched");
    let args = [
        "--sample-interval",
        "65536",
        "--format",
        "heap,folded",
        "-o",
        out.to_str().unwrap(),
    ];
    let (memprobe, mut launched) = Memprobe::launch_command(&args, &python_fixture());
    assert!(launched.read_line().starts_with("ready "));
    // The maps are looked at again each second.
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(launched.send("go"), "done");
    launched.close();
    let (status, stderr) = memprobe.wait();
    assert!(status.success(), "{stderr}");
    let heap = heap_files(&out).pop().unwrap_or_else(|| panic!("{stderr}"));
    let folded = std::fs::read_to_string(heap.with_extension("folded")).unwrap();
    let (bytes, _) = under(&folded, &frame("build_index"));
    assert_within("build_index", bytes, 64.0 * 0.25 * MIB, 0.10);
}
