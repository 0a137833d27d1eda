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
    let (heap, stderr) = profile_workload(&mut fixture, &out, &["--format", "heap,folded,pb.gz"]);
    let notes = heap_notes(&heap);
    let unwound: u64 = notes
        .get("stacks_unwound_by_dwarf")
        .unwrap_or_else(|| panic!("{notes:?}\n{stderr}"))
        .parse()
        .unwrap();
    // A few hundred samples here, at every call (the default's windows
    // stay open for a program this short).
    assert!(unwound > 100, "{notes:?}");
    // Frame pointers never matched here: every sample kept its copy.
    assert!(
        !notes.contains_key("stacks_by_trusted_frame_pointers"),
        "{notes:?}"
    );

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

    // pprof has the source line of the allocation (from the DWARF).
    let source = std::fs::read_to_string(fixture_source("unwind.c")).unwrap();
    let malloc_line = source
        .lines()
        .position(|l| l.contains("kept[i] = malloc(4096)"))
        .unwrap()
        + 1;
    let top = pprof_top(&heap.with_extension("pb.gz"), "inuse_space", &["-lines"]);
    assert!(
        top.contains("inner ") && top.contains(&format!("unwind.c:{malloc_line}")),
        "no unwind.c:{malloc_line} in:\n{top}"
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

fn objcopy(args: &[&str]) {
    let status = std::process::Command::new("objcopy")
        .args(args)
        .status()
        .expect("running objcopy");
    assert!(status.success(), "objcopy {args:?}");
}

/// Where the code keeps frame pointers (the sites fixture), their walks
/// match the DWARF unwinds; after enough matches most samples go without a
/// stack copy, and the stacks stay the same.
#[test]
fn frame_pointers_are_a_fast_path_where_the_code_keeps_them() {
    let _guard = shared();
    let binary = sites_fixture();
    let out = output_dir("frame_pointer_fast_path");
    let mut fixture = Fixture::start(&binary, &[]);
    let (heap, _) = profile_workload(&mut fixture, &out, &["--format", "heap,folded"]);
    let notes = heap_notes(&heap);
    let number = |key: &str| -> u64 { notes.get(key).map_or(0, |v| v.parse().unwrap()) };
    let (samples, fast) = (
        number("memprobe_samples"),
        number("stacks_by_trusted_frame_pointers"),
    );
    assert!(number("stacks_unwound_by_dwarf") > 0, "{notes:?}");
    assert!(
        fast * 2 > samples,
        "{fast} of {samples} by frame pointers: {notes:?}"
    );
    // One stack per site, whichever way each sample was walked.
    let folded = std::fs::read_to_string(heap.with_extension("folded")).unwrap();
    for site in ["keep_4k", "keep_1m"] {
        let lines: Vec<&str> = folded
            .lines()
            .filter(|l| l.split(' ').next().unwrap().ends_with(&format!(";{site}")))
            .collect();
        assert_eq!(lines.len(), 1, "{site}: {folded}");
        assert!(lines[0].starts_with("_start;"), "{site}: {folded}");
    }
    let inuse = jeprof_text(&binary, &heap, "--inuse_space");
    assert_within("keep_4k", inuse["keep_4k"] * MIB, 2000.0 * 4096.0, 0.10);
    assert_within("keep_1m", inuse["keep_1m"] * MIB, 16.0 * MIB, 0.10);

    // --unwind dwarf: every sample keeps its copy, but for those the
    // kernel sent without one while the ring buffer was three quarters
    // full (a loaded host reads it late), which the summary counts.
    let out = output_dir("frame_pointer_fast_path_off");
    let mut fixture = Fixture::start(&binary, &[]);
    let (heap, stderr) = profile_workload(&mut fixture, &out, &["--unwind", "dwarf"]);
    let notes = heap_notes(&heap);
    let unwound: u64 = notes
        .get("stacks_unwound_by_dwarf")
        .unwrap_or_else(|| panic!("no stacks_unwound_by_dwarf: {notes:?}"))
        .parse()
        .unwrap();
    let samples: u64 = notes["memprobe_samples"].parse().unwrap();
    let copies_skipped = kernel_drops(&stderr, "sent without a stack copy");
    assert!(
        (unwound + copies_skipped) * 10 >= samples * 9,
        "{unwound} unwound, {copies_skipped} sent without a copy: {notes:?}\n{stderr}"
    );
    assert!(
        !notes.contains_key("stacks_by_trusted_frame_pointers"),
        "{notes:?}"
    );
}

/// Bytes of the folded file under stacks naming `function`.
fn named_bytes(folded: &str, function: &str) -> u64 {
    folded_bytes(folded, function, function).0
}

/// A stripped copy of the DWARF fixture in `dir`, named `app`, with its
/// debug file `app.debug` next to it and a `.gnu_debuglink` to it.
fn stripped_with_debuglink(dir: &std::path::Path) -> std::path::PathBuf {
    let app = dir.join("app");
    std::fs::copy(unwind_fixture(), &app).unwrap();
    let (app_str, debug) = (app.to_str().unwrap(), dir.join("app.debug"));
    objcopy(&["--only-keep-debug", app_str, debug.to_str().unwrap()]);
    objcopy(&["--strip-all", app_str]);
    // The link holds the file's name; objcopy reads it to compute the CRC.
    let status = std::process::Command::new("objcopy")
        .current_dir(dir)
        .args(["--add-gnu-debuglink=app.debug", "app"])
        .status()
        .unwrap();
    assert!(status.success());
    let symbols = std::process::Command::new("nm").arg(&app).output().unwrap();
    assert!(
        !symbols.status.success() || symbols.stdout.is_empty(),
        "app not stripped"
    );
    app
}

/// Without its debug file a stripped binary's frames are `app+0xOFFSET`
/// (the file offset) in memprobe's outputs and a mapping and address in
/// pprof's; `report --debug-dir` names them afterwards.
#[test]
fn unknown_frames_are_placed_by_file_offset_and_named_later() {
    let _guard = shared();
    let out = output_dir("unknown_frames");
    let app = stripped_with_debuglink(&out);
    let debug_dir = out.join("debug");
    std::fs::create_dir_all(&debug_dir).unwrap();
    std::fs::rename(out.join("app.debug"), debug_dir.join("app.debug")).unwrap();
    let run = output_dir("unknown_frames_run");
    let mut fixture = Fixture::start(&app, &[]);
    let (heap, _) = profile_workload(&mut fixture, &run, &["--format", "heap,folded,pb.gz"]);
    let folded = std::fs::read_to_string(heap.with_extension("folded")).unwrap();
    assert!(folded.contains(";app+0x"), "{folded}");
    assert!(!folded.contains("inner"), "{folded}");
    // pprof keeps them as addresses in the app's mapping, which it shows
    // as the file until a debug file names them.
    let top = pprof_top(&heap.with_extension("pb.gz"), "inuse_space", &[]);
    assert_within("[app]", pprof_flat(&top, "[app]"), 2000.0 * 4096.0, 0.1);
    let heap_arg = heap.to_str().unwrap();
    let (status, unnamed) = memprobe_stdout(&["report", heap_arg]);
    assert!(status.success(), "{unnamed}");
    assert!(unnamed.contains(" app+0x"), "{unnamed}");
    let (status, named) = memprobe_stdout(&[
        "report",
        heap_arg,
        "--debug-dir",
        debug_dir.to_str().unwrap(),
    ]);
    assert!(status.success(), "{named}");
    let rows = parse_jeprof_rows(&named);
    assert_within(
        "inner",
        row(&rows, "inner").flat * MIB,
        2000.0 * 4096.0,
        0.1,
    );
    assert!(!named.contains("app+0x"), "{named}");
}

/// A stripped binary named from its separate debug file: live, by the
/// `.gnu_debuglink` next to it (its CRC checked); offline, by build ID
/// under `/usr/lib/debug/.build-id` inside `--lib-prefix`.
#[test]
fn names_come_from_separate_debug_files() {
    let _guard = shared();
    let out = output_dir("debug_files");
    let app = stripped_with_debuglink(&out);
    let debug = out.join("app.debug");

    let profile = |name: &str| {
        let dir = output_dir(name);
        let mut fixture = Fixture::start(&app, &[]);
        let (heap, _) = profile_workload(&mut fixture, &dir, &["--format", "heap,folded"]);
        let folded = std::fs::read_to_string(heap.with_extension("folded")).unwrap();
        (heap, folded)
    };
    let (heap, folded) = profile("debug_files_linked");
    for function in ["inner", "middle", "outer", "main"] {
        let bytes = named_bytes(&folded, function);
        assert!(bytes as f64 > 0.9 * 2000.0 * 4096.0, "{function}: {folded}");
    }

    // The same binary with a debug file that does not match (another
    // build's, same name): its CRC differs, so it is not used.
    std::fs::rename(&debug, out.join("app.debug.real")).unwrap();
    std::fs::copy(unwind_fixture(), out.join("other")).unwrap();
    objcopy(&[
        "--only-keep-debug",
        "--remove-section=.comment",
        out.join("other").to_str().unwrap(),
        debug.to_str().unwrap(),
    ]);
    let (_, unmatched) = profile("debug_files_wrong_crc");
    assert_eq!(named_bytes(&unmatched, "inner"), 0, "{unmatched}");
    std::fs::rename(out.join("app.debug.real"), &debug).unwrap();

    // Offline, by build ID: the binary without its debuglink under a
    // prefix, the debug file where distributions put it.
    let prefix = out.join("prefix");
    let binary_in_prefix = prefix.join(app.strip_prefix("/").unwrap());
    std::fs::create_dir_all(binary_in_prefix.parent().unwrap()).unwrap();
    std::fs::copy(&app, &binary_in_prefix).unwrap();
    objcopy(&[
        "--remove-section=.gnu_debuglink",
        binary_in_prefix.to_str().unwrap(),
    ]);
    let notes = std::process::Command::new("readelf")
        .arg("-n")
        .arg(&binary_in_prefix)
        .output()
        .unwrap();
    let notes = String::from_utf8_lossy(&notes.stdout);
    let build_id = notes
        .lines()
        .find_map(|l| l.trim().strip_prefix("Build ID: "))
        .unwrap_or_else(|| panic!("no build ID: {notes}"))
        .trim()
        .to_owned();
    let by_id = prefix.join(format!(
        "usr/lib/debug/.build-id/{}/{}.debug",
        &build_id[..2],
        &build_id[2..]
    ));
    std::fs::create_dir_all(by_id.parent().unwrap()).unwrap();
    std::fs::copy(&debug, &by_id).unwrap();
    // Moved away from the binary's folder: only the build ID finds it now.
    std::fs::remove_file(&debug).unwrap();
    let (status, report) = memprobe_stdout(&[
        "report",
        heap.to_str().unwrap(),
        "--lib-prefix",
        prefix.to_str().unwrap(),
    ]);
    assert!(status.success(), "{report}");
    let rows = parse_jeprof_rows(&report);
    let inner = rows
        .iter()
        .find(|r| r.name == "inner")
        .unwrap_or_else(|| panic!("{report}"));
    assert_within("inner flat", inner.flat * MIB, 2000.0 * 4096.0, 0.10);
}

/// A `.heap` with one stack per function of `binary` (at `function + 8`),
/// mapped as a PIE at 0x555555554000 would be.
fn heap_naming_every_function(binary: &std::path::Path) -> String {
    let nm = std::process::Command::new("nm")
        .arg(binary)
        .output()
        .unwrap();
    let functions: Vec<u64> = String::from_utf8_lossy(&nm.stdout)
        .lines()
        .filter_map(|l| {
            let mut fields = l.split_whitespace();
            let (address, kind, name) = (fields.next()?, fields.next()?, fields.next()?);
            (kind == "T" && name.starts_with('f')).then(|| u64::from_str_radix(address, 16).ok())?
        })
        .collect();
    assert_eq!(functions.len(), BIG_BINARY_FUNCTIONS);
    let base = 0x5555_5555_4000u64;
    let headers = std::process::Command::new("readelf")
        .arg("-lW")
        .arg(binary)
        .output()
        .unwrap();
    let mut maps = String::new();
    for line in String::from_utf8_lossy(&headers.stdout).lines() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        if fields.first() != Some(&"LOAD") {
            continue;
        }
        let hex = |s: &str| u64::from_str_radix(s.trim_start_matches("0x"), 16).unwrap();
        let (offset, address, size) = (hex(fields[1]), hex(fields[2]), hex(fields[4]));
        let perms = if line.contains(" E ") { "r-xp" } else { "r--p" };
        maps.push_str(&format!(
            "{:x}-{:x} {perms} {:08x} fe:00 1 {}\n",
            base + (address & !0xfff),
            base + ((address + size + 0xfff) & !0xfff),
            offset & !0xfff,
            binary.display()
        ));
    }
    let n = functions.len();
    let mut heap = format!(
        "heap_v2/524288\n  t*: {n}: {} [{n}: {}]\n",
        n * 4096,
        n * 4096
    );
    for f in &functions {
        heap.push_str(&format!("@ {:#x}\n  t*: 1: 4096 [1: 4096]\n", base + f + 8));
    }
    heap.push_str("\nMAPPED_LIBRARIES:\n");
    heap.push_str(&maps);
    heap
}

/// Naming a big binary (20,000 functions with their debug info) stays
/// within the stated bound: 64 MiB plus the binary's size, since binaries
/// are memory-mapped and each distinct address is named once.
#[test]
fn naming_a_big_binary_stays_within_its_memory_bound() {
    let _guard = shared();
    let out = output_dir("big_binary");
    // Without its symbol table: every name comes from the DWARF.
    let binary = out.join("big");
    std::fs::copy(big_binary(), &binary).unwrap();
    let heap = out.join("every_function.heap");
    std::fs::write(&heap, heap_naming_every_function(&binary)).unwrap();
    objcopy(&[
        "--remove-section=.symtab",
        "--remove-section=.strtab",
        binary.to_str().unwrap(),
    ]);
    let mut command = std::process::Command::new(memprobe_bin());
    command.args(["report", heap.to_str().unwrap(), "--top", "100000"]);
    let (status, report, peak_kib) = run_measuring_memory(&mut command);
    assert!(status.success(), "{report}");
    let named = parse_jeprof_rows(&report)
        .iter()
        .filter(|r| r.name.starts_with('f') && r.name[1..].parse::<u32>().is_ok())
        .count();
    assert_eq!(named, BIG_BINARY_FUNCTIONS, "{report}");
    let size_kib = std::fs::metadata(&binary).unwrap().len() / 1024;
    let bound_kib = 64 * 1024 + size_kib;
    eprintln!("peak RSS {peak_kib} KiB naming {named} functions of a {size_kib} KiB binary");
    assert!(
        peak_kib <= bound_kib,
        "peak {peak_kib} KiB > bound {bound_kib} KiB"
    );
}

/// In a container (its own mount and pid namespace), the stripped binary and
/// its debug file exist only inside, on a private tmpfs: memprobe reads the
/// debug file through the process's root.
#[test]
fn debug_files_inside_a_container_are_read_in_its_root() {
    let _guard = shared();
    let staging = output_dir("container_debug_staging");
    stripped_with_debuglink(&staging);
    let (mut fixture, _) = start_in_container(
        &[&staging.join("app"), &staging.join("app.debug")],
        &output_dir("container_debug_mount"),
    );
    let out = output_dir("container_debug");
    let (heap, _) = profile_workload(&mut fixture, &out, &["--format", "heap,folded"]);
    let folded = std::fs::read_to_string(heap.with_extension("folded")).unwrap();
    for function in ["inner", "middle", "outer"] {
        let bytes = named_bytes(&folded, function);
        assert!(bytes as f64 > 0.9 * 2000.0 * 4096.0, "{function}: {folded}");
    }
}

/// A burst that fills the ring buffer past three quarters while memprobe
/// is held up (stopped here; a rescan reading a big library did it in
/// CI) leaves later samples without a stack copy. The slow path's 1 MiB
/// requests still get a small copy: walked by frame pointers from inside
/// jemalloc, built without them, they had no caller (keep_1m's 16 MiB
/// landed under `je_malloc_default` alone).
#[test]
fn big_requests_keep_their_callers_when_a_burst_fills_the_ring() {
    let _guard = shared();
    let binary = sites_static_fixture();
    let out = output_dir("ring_burst");
    let mut fixture = Fixture::start(&binary, &[]);
    // ~200 samples of keep_4k: 29 full copies fill half of 1 MiB, 82 small
    // ones the next quarter, the rest (100 KiB) go without; keep_1m's 16
    // small copies take 51 KiB of the 150 left.
    let args = ["--sample-interval", "40960", "--ring-buffer", "1MiB"];
    let args = [&args[..], &["--format", "heap,folded"]].concat();
    let memprobe = Memprobe::attach(&fixture, &out, &args);
    memprobe.signal(libc::SIGSTOP);
    fixture.run_workload();
    memprobe.signal(libc::SIGCONT);
    let stderr = memprobe.stop();
    let heap = heap_files(&out).swap_remove(0);
    assert!(
        kernel_drops(&stderr, "sent without a stack copy") > 0,
        "the ring never passed three quarters: {stderr}"
    );
    let folded = std::fs::read_to_string(heap.with_extension("folded")).unwrap();
    let (at_site, with_caller) = folded_bytes(&folded, "keep_1m", "main;keep_1m");
    assert_within("keep_1m", at_site as f64, 16.0 * MIB, 0.10);
    assert_eq!(at_site, with_caller, "{folded}");
}
