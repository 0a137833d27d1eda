//! Reading what memprobe wrote, with the real jeprof and go tool pprof,
//! and checking estimates against the truth.
use std::{
    collections::HashMap,
    path::{Path, PathBuf},
    process::Command,
};

use crate::*;

/// A JVM's 64 direct buffers of 1 MiB (the DirectBuffers fixture), in use
/// under Unsafe_AllocateMemory0 -> os::malloc per jeprof, within 10%.
pub fn assert_direct_buffers_in_use(heap: &Path) {
    let java = format!("{JAVA_HOME}/bin/java");
    let inuse = jeprof_rows(Path::new(&java), heap, "--inuse_space");
    assert_within(
        "Unsafe_AllocateMemory0 in use",
        row(&inuse, "Unsafe_AllocateMemory0").cum * MIB,
        64.0 * MIB,
        0.10,
    );
}

/// The Rust fixture's kept vectors: 1000 of 16 KiB.
pub const RUST_KEPT_BYTES: f64 = 1000.0 * 16384.0;

/// The bytes the Rust fixture's churn allocates: 50000 vectors of 512..518
/// bytes, in jemalloc's size classes 512 and 640.
pub fn rust_churned_bytes() -> f64 {
    (0..50_000u32)
        .map(|i| if 512 + i % 7 <= 512 { 512.0 } else { 640.0 })
        .sum()
}

/// Asserts the Rust fixture's `keep_vectors` in use within 10% per
/// jeprof; returns jeprof's in-use rows.
pub fn assert_rust_kept_in_use(binary: &Path, heap: &Path) -> Vec<JeprofRow> {
    let inuse = jeprof_rows(binary, heap, "--inuse_space");
    let kept = row(&inuse, "keep_vectors").cum * MIB;
    assert_within("keep_vectors", kept, RUST_KEPT_BYTES, 0.10);
    inuse
}

/// Asserts that the C shapes of the Rust fixture (`c_api.rs`) left no
/// `allocate_small` region in use: reallocs moved and freed them all.
pub fn assert_moved_regions_freed(inuse: &[JeprofRow], context: &str) {
    let moved = site_bytes(inuse, "allocate_small");
    assert!(
        moved < 0.05 * 1000.0 * 1024.0,
        "{moved} B of moved regions in use\n{context}"
    );
}

/// Asserts the Rust fixture's `churn_vectors` allocated within 10%.
pub fn assert_rust_churn_allocated(binary: &Path, heap: &Path) {
    let allocated = jeprof_rows(binary, heap, "--alloc_space");
    let churn = row(&allocated, "churn_vectors").cum * MIB;
    assert_within("churn_vectors allocated", churn, rust_churned_bytes(), 0.10);
}

/// The number just before `what` in memprobe's summary line (`memprobe:
/// detached ...; 0 allocation calls (0/s), 8013 sampled, 13671 free calls`).
pub fn summary_count(stderr: &str, what: &str) -> u64 {
    let line = stderr
        .lines()
        .find(|l| l.starts_with("memprobe: detached "))
        .unwrap_or_else(|| panic!("no summary line:\n{stderr}"));
    let head = &line[..line
        .find(what)
        .unwrap_or_else(|| panic!("no '{what}' in: {line}"))];
    head.split([' ', ';', ','])
        .rfind(|w| !w.is_empty())
        .and_then(|w| w.parse().ok())
        .unwrap_or_else(|| panic!("no number before '{what}' in: {line}"))
}

/// The summary's count of records the kernel lost for `why` (such as
/// "ring buffer full"); 0 where it lost none.
pub fn kernel_drops(stderr: &str, why: &str) -> u64 {
    let Some(line) = stderr
        .lines()
        .find_map(|l| l.strip_prefix("memprobe: kernel drops: "))
    else {
        return 0;
    };
    line.split(", ")
        .filter_map(|part| part.split_once(' '))
        .find(|(_, what)| what.starts_with(why))
        .map_or(0, |(count, _)| count.parse().unwrap_or(0))
}

/// The profile's `# malloc_sampling:` note, empty if it has none.
pub fn malloc_sampling_note(heap: &Path) -> String {
    heap_notes(heap)
        .remove("malloc_sampling")
        .unwrap_or_default()
}

/// The `# key: value` notes of a `.heap` file.
pub fn heap_notes(heap: &Path) -> HashMap<String, String> {
    std::fs::read_to_string(heap)
        .unwrap()
        .lines()
        .take_while(|l| !l.starts_with('@'))
        .filter_map(|l| l.strip_prefix("# ")?.split_once(": "))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
}

/// `go tool pprof -top -sample_index=SAMPLE_TYPE OPTIONS FILE`, which must
/// succeed: its table.
pub fn pprof_top(file: &Path, sample_type: &str, options: &[&str]) -> String {
    let out = Command::new("go")
        .args(["tool", "pprof", "-top"])
        .arg(format!("-sample_index={sample_type}"))
        .args(options)
        .arg(file)
        .output()
        .expect("running go tool pprof");
    assert!(
        out.status.success(),
        "go tool pprof {sample_type}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The flat value of `name` in `go tool pprof -top` output, in bytes or
/// objects ("16MB" is 16 MiB, as pprof counts).
pub fn pprof_flat(top: &str, name: &str) -> f64 {
    let row = top
        .lines()
        .find(|l| l.split_whitespace().nth(5) == Some(name))
        .unwrap_or_else(|| panic!("{name} not in:\n{top}"));
    let flat = row.split_whitespace().next().unwrap();
    let split = flat
        .find(|c: char| c.is_ascii_alphabetic())
        .unwrap_or(flat.len());
    let (number, unit) = flat.split_at(split);
    let scale = match unit {
        "" | "B" => 1.0,
        "kB" => 1024.0,
        "MB" => 1048576.0,
        "GB" => 1073741824.0,
        other => panic!("unit {other:?} in {row}"),
    };
    number.parse::<f64>().unwrap() * scale
}

/// `jeprof --text <flag>`: flat megabytes per function.
pub fn jeprof_text(binary: &Path, heap: &Path, flag: &str) -> HashMap<String, f64> {
    jeprof_rows(binary, heap, flag)
        .into_iter()
        .map(|r| (r.name, r.flat))
        .collect()
}

/// One row of `jeprof --text`, in megabytes.
#[derive(Clone, Debug)]
pub struct JeprofRow {
    pub name: String,
    pub flat: f64,
    pub cum: f64,
}

/// `jeprof --text <flag>` rows, with the cumulative column: read in bytes
/// (`--show_bytes`), given in megabytes, so that a site's estimate is not
/// rounded to jeprof's 0.1 MB (2.5% of a 4 MB site) before it is checked.
pub fn jeprof_rows(binary: &Path, heap: &Path, flag: &str) -> Vec<JeprofRow> {
    let out = Command::new("jeprof")
        .args(["--text", "--show_bytes", flag])
        .arg(binary)
        .arg(heap)
        .output()
        .expect("running jeprof");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "jeprof failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    parse_jeprof_rows(&text)
        .into_iter()
        .map(|r| JeprofRow {
            flat: r.flat / MIB,
            cum: r.cum / MIB,
            ..r
        })
        .collect()
}

/// Rows of `jeprof --text` output.
pub fn parse_jeprof_rows(text: &str) -> Vec<JeprofRow> {
    text.lines()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            if fields.len() < 6 || !fields[1].ends_with('%') {
                return None;
            }
            Some(JeprofRow {
                name: fields[5..].join(" "),
                flat: fields[0].parse().ok()?,
                cum: fields[3].parse().ok()?,
            })
        })
        .collect()
}

/// Flat megabytes by function name, from `jeprof --text` output.
pub fn parse_jeprof_text(text: &str) -> HashMap<String, f64> {
    parse_jeprof_rows(text)
        .into_iter()
        .map(|r| (r.name, r.flat))
        .collect()
}

/// The bytes of `needle`'s largest row (cumulative), 0 where jeprof lists
/// none: for sites that should be gone.
pub fn site_bytes(rows: &[JeprofRow], needle: &str) -> f64 {
    rows.iter()
        .filter(|r| r.name.contains(needle))
        .map(|r| r.cum * MIB)
        .fold(0.0, f64::max)
}

/// The row whose function name contains `needle`, with the largest cum.
pub fn row<'a>(rows: &'a [JeprofRow], needle: &str) -> &'a JeprofRow {
    rows.iter()
        .filter(|r| r.name.contains(needle))
        .max_by(|a, b| a.cum.total_cmp(&b.cum))
        .unwrap_or_else(|| panic!("no {needle} in jeprof's output: {rows:#?}"))
}

/// The `heap_v2` files in `dir` (not the self-symbolized `.sym.heap`), sorted.
pub fn heap_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "heap"))
        .filter(|p| !p.to_string_lossy().ends_with(".sym.heap"))
        .collect();
    files.sort();
    files
}

pub const MIB: f64 = 1024.0 * 1024.0;

/// Asserts `actual` is within `fraction` of `expected`.
pub fn assert_within(what: &str, actual: f64, expected: f64, fraction: f64) {
    let error = (actual - expected).abs() / expected;
    assert!(
        error <= fraction,
        "{what}: {actual:.3} vs expected {expected:.3} ({:.1}% off, bound {:.0}%)",
        error * 100.0,
        fraction * 100.0
    );
}

/// The number that follows `marker` in `text`.
pub fn number_after(text: &str, marker: &str) -> f64 {
    text.split_once(marker)
        .and_then(|(_, rest)| rest.split_whitespace().next()?.parse().ok())
        .unwrap_or_else(|| panic!("no number after {marker:?} in {text}"))
}
