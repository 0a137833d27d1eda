//! Stripped executables with jemalloc linked in statically (C with Debian's
//! libjemalloc_pic.a, Rust with tikv-jemallocator): their entry points are
//! found through their separate debug file, and without one the error says
//! how to give it.
use std::{
    path::{Path, PathBuf},
    process::Command,
};

use tests::*;

/// A stripped copy of `unstripped` in `dir`, its debug file in `dir/debug`
/// linked by name. Returns (binary, debug folder).
fn strip_keeping_debug(unstripped: &Path, dir: &Path, name: &str) -> (PathBuf, PathBuf) {
    let debug_dir = dir.join("debug");
    std::fs::create_dir_all(&debug_dir).unwrap();
    let binary = dir.join(name);
    std::fs::copy(unstripped, &binary).unwrap();
    let debug = debug_dir.join(format!("{name}.debug"));
    let link = format!("--add-gnu-debuglink={name}.debug");
    let (binary_arg, debug_arg) = (binary.to_str().unwrap(), debug.to_str().unwrap());
    for args in [
        vec!["--only-keep-debug", binary_arg, debug_arg],
        vec!["--strip-all", binary_arg],
        // Run in the debug folder: objcopy reads the file to sign the link.
        vec![link.as_str(), binary_arg],
    ] {
        let status = Command::new("objcopy")
            .args(&args)
            .current_dir(&debug_dir)
            .status()
            .unwrap();
        assert!(status.success(), "objcopy {args:?}");
    }
    (binary, debug_dir)
}

/// Bytes in use under stacks naming `site`, from folded stacks.
fn folded_bytes(folded: &str, site: &str) -> f64 {
    folded
        .lines()
        .filter(|l| {
            l.rsplit_once(' ')
                .is_some_and(|(stack, _)| stack.contains(site))
        })
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum()
}

/// Profiles `binary` with `--debug-dir`; its folded stacks.
fn profile_with_debug_dir(binary: &Path, debug_dir: &Path, out: &Path) -> String {
    let mut fixture = Fixture::start(binary, &[]);
    let (heap, _) = profile_workload(
        &mut fixture,
        out,
        &[
            "--debug-dir",
            debug_dir.to_str().unwrap(),
            "--format",
            "heap,folded",
        ],
    );
    std::fs::read_to_string(heap.with_extension("folded")).unwrap()
}

#[test]
fn stripped_static_jemalloc_is_probed_through_its_debug_file() {
    let _guard = shared();
    let out = output_dir("stripped_static_debug");
    let (binary, debug_dir) = strip_keeping_debug(&sites_static_fixture(), &out, "sites_stripped");
    // Found in --debug-dir by the binary's debuglink name (CRC checked).
    let folded = profile_with_debug_dir(&binary, &debug_dir, &out);
    assert_within(
        "keep_4k",
        folded_bytes(&folded, "keep_4k"),
        2000.0 * 4096.0,
        0.1,
    );
    assert_within("keep_1m", folded_bytes(&folded, "keep_1m"), 16.0 * MIB, 0.1);
}

#[test]
fn stripped_rust_binary_on_tikv_jemallocator_is_probed_through_its_debug_file() {
    let _guard = shared();
    let out = output_dir("stripped_rust_debug");
    let (binary, debug_dir) = strip_keeping_debug(&rust_fixture(), &out, "rust_stripped");
    // Without it: one line that says how to give it.
    let fixture = Fixture::start(&binary, &[]);
    let pid = fixture.pid.to_string();
    let (status, stderr) = run_memprobe(&["--pid", &pid, "--duration", "1s"], &[]);
    assert!(!status.success(), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.contains("no debug file") && stderr.contains("--debug-dir"),
        "{stderr}"
    );
    drop(fixture);
    let folded = profile_with_debug_dir(&binary, &debug_dir, &out);
    assert_within(
        "keep_vectors",
        folded_bytes(&folded, "keep_vectors"),
        RUST_KEPT_BYTES,
        0.1,
    );
}
