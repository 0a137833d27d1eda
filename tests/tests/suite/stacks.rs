//! Stacks that are right without frame pointers (DWARF unwinding of the
//! stack the kernel copies), and named from separate debug files.
use tests::*;

/// (bytes under stacks through `site`, bytes under the full `chain` ending
/// at `site`) from a folded file (root first, "a;b;c BYTES" lines).
fn folded_bytes(folded: &str, site: &str, chain: &str) -> (u64, u64) {
    let (mut at_site, mut full) = (0, 0);
    for line in folded.lines() {
        let Some((stack, bytes)) = line.rsplit_once(' ') else {
            continue;
        };
        let bytes: u64 = bytes.parse().unwrap();
        let frames: Vec<&str> = stack.split(';').collect();
        if !frames.contains(&site) {
            continue;
        }
        at_site += bytes;
        if stack.contains(chain) {
            full += bytes;
        }
    }
    (at_site, full)
}

/// -O2 without frame pointers: main -> outer -> middle -> inner -> malloc.
/// At least 95% of the site's sampled bytes carry the whole chain, in
/// memprobe's folded stacks and in jeprof's own reading of the .heap.
#[test]
fn stacks_without_frame_pointers_carry_the_full_call_chain() {
    let _guard = shared();
    let binary = unwind_fixture();
    let out = output_dir("dwarf_unwind");
    let mut fixture = Fixture::start(&binary, &[]);
    let (heap, stderr) = profile_workload(&mut fixture, &out, &["--format", "heap,folded"]);
    let notes = heap_notes(&heap);
    let unwound: u64 = notes
        .get("stacks_unwound_by_dwarf")
        .unwrap_or_else(|| panic!("{notes:?}\n{stderr}"))
        .parse()
        .unwrap();
    assert!(unwound > 1000, "{notes:?}");

    let folded = std::fs::read_to_string(heap.with_extension("folded")).unwrap();
    let (at_site, full) = folded_bytes(&folded, "inner", "main;outer;middle;inner");
    assert_within("inner in use", at_site as f64, 2000.0 * 4096.0, 0.10);
    let share = full as f64 / at_site as f64;
    eprintln!(
        "full chain: {full} of {at_site} bytes ({:.1}%)",
        100.0 * share
    );
    assert!(
        share >= 0.95,
        "{:.1}% full chains:\n{folded}",
        100.0 * share
    );

    // The frame-pointer walk alone loses the chain in this code: what the
    // test measures is the DWARF unwinding.
    let out_fp = output_dir("dwarf_unwind_fp");
    let mut fixture_fp = Fixture::start(&binary, &[]);
    let (heap_fp, _) = profile_workload(
        &mut fixture_fp,
        &out_fp,
        &["--format", "heap,folded", "--unwind", "fp"],
    );
    let folded_fp = std::fs::read_to_string(heap_fp.with_extension("folded")).unwrap();
    let (at_site_fp, full_fp) = folded_bytes(&folded_fp, "inner", "main;outer;middle;inner");
    assert!(at_site_fp > 0, "{folded_fp}");
    assert!(
        (full_fp as f64) < 0.5 * at_site_fp as f64,
        "frame pointers alone found the chain; the fixture keeps frame pointers?\n{folded_fp}"
    );

    // jeprof, symbolizing the addresses itself, sees the same chain.
    let rows = jeprof_rows(&binary, &heap, "--inuse_space");
    let inner = row(&rows, "inner").flat;
    for caller in ["middle", "outer", "main"] {
        let cum = row(&rows, caller).cum;
        assert!(cum >= 0.95 * inner, "{caller}: cum {cum} < 95% of {inner}");
    }
}
