//! Stripped executables with jemalloc linked in statically (C with Debian's
//! libjemalloc_pic.a, Rust with tikv-jemallocator): their entry points are
//! found through their separate debug file, and without one the error says
//! how to give it. And jemalloc's own profiler in stripped builds, static
//! and shared (as Debian ships libjemalloc): its hooks and switches are
//! local symbols, named only by the debug file.
use std::path::{Path, PathBuf};

use tests::*;

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

/// What profiling a stripped program through its debug files gave.
struct Profiled {
    folded: String,
    heap: PathBuf,
    stderr: String,
}

/// Profiles `binary`, started with `env`, with `--debug-dir`.
fn profile_with_debug_dir(
    binary: &Path,
    debug_dir: &Path,
    out: &Path,
    env: &[(&str, &str)],
) -> Profiled {
    let mut fixture = Fixture::start(binary, env);
    let (heap, stderr) = profile_workload(
        &mut fixture,
        out,
        &[
            "--verbose",
            "--debug-dir",
            debug_dir.to_str().unwrap(),
            "--format",
            "heap,folded",
        ],
    );
    assert!(fixture.finish().success());
    let folded = std::fs::read_to_string(heap.with_extension("folded")).unwrap();
    Profiled {
        folded,
        heap,
        stderr,
    }
}

/// The C sites fixture's kept sites, within 10%.
fn assert_sites_kept(folded: &str) {
    let keep_4k = folded_bytes(folded, "keep_4k");
    assert_within("keep_4k", keep_4k, 2000.0 * 4096.0, 0.1);
    assert_within("keep_1m", folded_bytes(folded, "keep_1m"), 16.0 * MIB, 0.1);
}

/// memprobe took jemalloc's own samples: no allocation call trapped.
fn assert_own_samples_taken(profiled: &Profiled) {
    let note = malloc_sampling_note(&profiled.heap);
    let stderr = &profiled.stderr;
    assert!(note.contains("jemalloc's own samples"), "{note}\n{stderr}");
    assert_eq!(summary_count(stderr, " allocation calls"), 0, "{stderr}");
}

#[test]
fn stripped_static_jemalloc_is_probed_through_its_debug_file() {
    let _guard = shared();
    let out = output_dir("stripped_static_debug");
    let (binary, debug_dir) = strip_keeping_debug(&sites_static_fixture(), &out, "sites_stripped");
    // Found in --debug-dir by the binary's debuglink name (CRC checked).
    let profiled = profile_with_debug_dir(&binary, &debug_dir, &out, &[]);
    assert_sites_kept(&profiled.folded);
}

#[test]
fn stripped_rust_binary_on_tikv_jemallocator_is_probed_through_its_debug_file() {
    let _guard = shared();
    let out = output_dir("stripped_rust_debug");
    let (binary, debug_dir) = strip_keeping_debug(&rust_fixture(), &out, "rust_stripped");
    let profiled = profile_with_debug_dir(&binary, &debug_dir, &out, &[]);
    let kept = folded_bytes(&profiled.folded, "keep_vectors");
    assert_within("keep_vectors", kept, RUST_KEPT_BYTES, 0.1);
}

#[test]
fn jemallocs_own_samples_in_a_stripped_static_binary() {
    let _guard = shared();
    let out = output_dir("stripped_rust_own_samples");
    let (binary, debug_dir) = strip_keeping_debug(&rust_prof_fixture(), &out, "rust_prof");
    let env = [("_RJEM_MALLOC_CONF", "prof:true,lg_prof_sample:12")];
    let profiled = profile_with_debug_dir(&binary, &debug_dir, &out, &env);
    assert_own_samples_taken(&profiled);
    let kept = folded_bytes(&profiled.folded, "keep_vectors");
    assert_within("keep_vectors", kept, RUST_KEPT_BYTES, 0.1);
}

/// A jemalloc shared library stripped as distributions ship it, its
/// exported entry points in its dynamic symbol table and the rest in its
/// debug file, under the sites program (which finds it next to itself).
#[test]
fn jemallocs_own_samples_in_a_stripped_shared_library() {
    let _guard = shared();
    let out = output_dir("stripped_shared_own_samples");
    let program = out.join("sites");
    std::fs::copy(sites_on_shared_jemalloc_fixture(), &program).unwrap();
    let library = shared_jemalloc_fixture();
    let name = library.file_name().unwrap().to_str().unwrap();
    let (_, debug_dir) = strip_keeping_debug(&library, &out, name);
    // keep_4k's samples come in one burst that fills the ring buffer past
    // half: those go with a small stack copy, which still unwinds through
    // Debian's jemalloc (no frame pointers) to the site.
    let env = [("MALLOC_CONF", "prof:true,lg_prof_sample:12")];
    let profiled = profile_with_debug_dir(&program, &debug_dir, &out, &env);
    let hook = format!(
        "je_prof_malloc_sample_object at {}+",
        out.join(name).display()
    );
    assert!(profiled.stderr.contains(&hook), "{}", profiled.stderr);
    assert_own_samples_taken(&profiled);
    assert_sites_kept(&profiled.folded);
}
