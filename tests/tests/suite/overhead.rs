//! Probe placement and cost: every chosen place checked by an independent
//! decoder (objdump), jemalloc's inlined fast path recognised, the same
//! profile whichever placement, and the cost report counting the calls
//! that really happened.
use std::{collections::HashSet, process::Command};

use tests::*;

/// Argument registers each entry point's program reads (without prefix).
fn reads(symbol: &str) -> &'static [&'static str] {
    let name = symbol
        .trim_start_matches("_rjem_")
        .trim_start_matches("je_");
    match name {
        "posix_memalign" | "rallocx" => &["di", "si", "dx"],
        "calloc" | "realloc" | "aligned_alloc" | "memalign" | "mallocx" => &["di", "si"],
        _ => &["di"],
    }
}

/// Whether an AT&T operand names one of `registers` in any width.
fn names_register(operand: &str, registers: &[&str]) -> bool {
    let operand = operand.trim().trim_start_matches('%');
    registers.iter().any(|r| {
        let low = match *r {
            "di" => "dil",
            "si" => "sil",
            _ => "dl",
        };
        [
            format!("r{r}"),
            format!("e{r}"),
            r.to_string(),
            low.to_string(),
        ]
        .contains(&operand.to_string())
    })
}

/// (address, mnemonic, operands) from objdump, for [start, end).
fn disassemble(path: &str, start: u64, end: u64) -> Vec<(u64, String, String)> {
    let out = Command::new("objdump")
        .args(["-d", "--no-show-raw-insn", "-M", "suffix"])
        .arg(format!("--start-address={start:#x}"))
        .arg(format!("--stop-address={end:#x}"))
        .arg(path)
        .output()
        .expect("running objdump");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|line| {
            let (address, rest) = line.trim().split_once(":\t")?;
            let address = u64::from_str_radix(address, 16).ok()?;
            let mut parts = rest.trim().splitn(2, char::is_whitespace);
            let mnemonic = parts.next()?.to_owned();
            let operands = parts.next().unwrap_or("").trim().to_owned();
            Some((address, mnemonic, operands))
        })
        .collect()
}

/// File offset -> virtual address, from the LOAD program headers.
fn offset_to_address(path: &str, offset: u64) -> u64 {
    let out = Command::new("readelf")
        .args(["-lW", path])
        .output()
        .unwrap();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        if fields.first() != Some(&"LOAD") {
            continue;
        }
        let hex = |s: &str| u64::from_str_radix(s.trim_start_matches("0x"), 16).unwrap();
        let (file_offset, address, size) = (hex(fields[1]), hex(fields[2]), hex(fields[4]));
        if offset >= file_offset && offset < file_offset + size {
            return offset - file_offset + address;
        }
    }
    panic!("{offset:#x} not in a LOAD segment of {path}");
}

/// Checks every "SYMBOL at PATH+0xF+0xO `...` (...)" line memprobe printed.
fn check_placements(stderr: &str) -> (usize, usize) {
    let (mut placed, mut fallbacks) = (0, 0);
    for line in stderr
        .lines()
        .filter(|l| l.contains(" at /") && l.contains(": "))
    {
        let rest = line.splitn(3, ": ").nth(2).unwrap();
        let (symbol, location) = rest.split_once(" at ").unwrap();
        if location.contains(" at the first instruction: ") {
            fallbacks += 1;
            continue;
        }
        let with_return = line.ends_with("(entry and return)");
        let (path, offsets) = location.split_once('+').unwrap();
        let mut numbers = offsets
            .split(['+', ' '])
            .take(2)
            .map(|n| u64::from_str_radix(n.trim_start_matches("0x"), 16).unwrap());
        let (function, offset) = (numbers.next().unwrap(), numbers.next().unwrap());
        let function = offset_to_address(path, function);
        let code = disassemble(path, function, function + offset + 16);
        let probed = code
            .iter()
            .find(|(a, ..)| *a == function + offset)
            .unwrap_or_else(|| {
                panic!("{symbol}+{offset:#x} is not an instruction boundary: {code:?}")
            });
        let m = probed.1.as_str();
        assert!(
            m.starts_with('j')
                || m.starts_with("call")
                || m.starts_with("push")
                || m.starts_with("nop"),
            "{symbol}+{offset:#x}: {m} is not emulated by the kernel"
        );
        for (address, mnemonic, operands) in code.iter().filter(|(a, ..)| *a < function + offset) {
            let at = address - function;
            assert!(
                !(mnemonic.starts_with('j')
                    || mnemonic.starts_with("call")
                    || mnemonic.starts_with("ret")),
                "{symbol}: branch at +{at:#x} before the probe at +{offset:#x}"
            );
            let destination = operands.rsplit(',').next().unwrap_or("");
            assert!(
                !names_register(destination, reads(symbol))
                    || mnemonic.starts_with("cmp")
                    || mnemonic.starts_with("test"),
                "{symbol}: {mnemonic} {operands} at +{at:#x} writes an argument before the probe"
            );
            if with_return {
                assert!(
                    !mnemonic.starts_with("push") && !destination.contains("%rsp"),
                    "{symbol}: rsp moves at +{at:#x} before a probe with a return half"
                );
            }
        }
        placed += 1;
    }
    (placed, fallbacks)
}

#[test]
fn placements_in_libjemalloc_and_tikv_jemallocator_obey_the_rules() {
    let _guard = shared();
    for (name, binary) in [
        ("libjemalloc.so.2", sites_fixture()),
        ("tikv-jemallocator", rust_fixture()),
    ] {
        let fixture = Fixture::start(&binary, &[]);
        let out = output_dir(&format!("placement_{}", name.replace('.', "_")));
        let stderr = profile_for_a_second(fixture.pid, &out, &["-v"]);
        let (placed, fallbacks) = check_placements(&stderr);
        eprintln!(
            "{name}: {placed} entry points placed on emulated instructions, {fallbacks} at the entry"
        );
        assert!(placed > 0, "{name}: nothing placed:\n{stderr}");
        if name == "libjemalloc.so.2" {
            for expected in ["malloc at ", "free at ", "sdallocx at "] {
                let line = stderr
                    .lines()
                    .find(|l| l.contains(&format!(": {expected}")))
                    .unwrap();
                assert!(!line.contains("first instruction"), "{line}");
            }
        }
    }
}

/// Both placements sample every call (`--sampling entry`): what is
/// compared is where the probes sit, not the windows' guess at a burst's
/// end. Single-stepped entry probes make the fixture dear enough for its
/// window to close mid-run, and the bytes after it are then counted in the
/// shape of its last 50 ms: on a loaded host those held keep_4k's end,
/// and churn_512 came out 29% low against the emulated run (CI).
#[test]
fn profiles_agree_between_entry_and_emulated_placement() {
    let _guard = shared();
    let binary = sites_fixture();
    let mut results = Vec::new();
    for placement in ["entry", "emulated"] {
        let out = output_dir(&format!("placement_profile_{placement}"));
        let mut fixture = Fixture::start(&binary, &[]);
        let args = ["--placement", placement, "--sampling", "entry"];
        let (heap, _) = profile_workload(&mut fixture, &out, &args);
        let inuse = jeprof_text(&binary, &heap, "--inuse_space");
        let allocated = jeprof_text(&binary, &heap, "--alloc_space");
        results.push((inuse["keep_4k"], inuse["keep_1m"], allocated["churn_512"]));
    }
    let (entry, emulated) = (results[0], results[1]);
    assert_within("keep_4k", emulated.0, entry.0, 0.10);
    assert_within("keep_1m", emulated.1, entry.1, 0.10);
    assert_within("churn_512 allocated", emulated.2, entry.2, 0.10);
}

#[test]
fn cost_report_counts_the_calls_made() {
    let _guard = shared();
    let out = output_dir("cost_report");
    let mut command = Command::new(memprobe_bin());
    command
        .args(["-o", out.to_str().unwrap(), "--"])
        .arg(malloc_loop_fixture())
        .arg("20480");
    let output = command.output().unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    let line = stderr
        .lines()
        .find(|l| l.starts_with("memprobe: cost: "))
        .expect(&stderr);
    let hits: u64 = line["memprobe: cost: ".len()..]
        .split_whitespace()
        .next()
        .unwrap()
        .parse()
        .unwrap();
    // 20480 mallocs and 20480 frees, plus the program's own few.
    assert!((40_960..41_200).contains(&hits), "{line}");
    assert!(line.contains("malloc ") && line.contains("free "), "{line}");
    assert!(
        line.contains("estimated time added to the profiled processes"),
        "{line}"
    );
}

/// Another tool's system-wide return probe at malloc's entry swaps the
/// return address for the kernel's trampoline before memprobe reads it: the
/// hidden callers are counted, and no trampoline address becomes a frame.
#[test]
fn callers_hidden_by_another_tools_uretprobe_are_counted_not_written() {
    let _guard = exclusive();
    let binary = sites_fixture();
    let out = output_dir("foreign_uretprobe");
    let mut bpftrace = Command::new("bpftrace")
        .args([
            "-e",
            "uretprobe:/usr/lib/x86_64-linux-gnu/libjemalloc.so.2:malloc { @n = count(); }",
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("running bpftrace");
    // bpftrace says "Attaching 1 probe..." once attached.
    let mut first = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(bpftrace.stdout.take().unwrap()),
        &mut first,
    )
    .unwrap();
    assert!(first.contains("Attaching"), "{first}");
    let mut fixture = Fixture::start(&binary, &[]);
    let (heap, _) = profile_workload(&mut fixture, &out, &[]);
    let _ = bpftrace.kill();
    let _ = bpftrace.wait();
    let notes = heap_notes(&heap);
    let count = |key: &str| -> u64 {
        let value = notes.get(key).unwrap_or_else(|| panic!("{notes:?}"));
        value.parse().unwrap()
    };
    // Every sampled malloc had bpftrace's trampoline as its return address
    // (on the slow path too: malloc jumps there).
    let (hidden, samples) = (
        count("callers_hidden_by_other_uretprobes"),
        count("memprobe_samples"),
    );
    assert!(samples > 100 && hidden * 10 >= samples * 9, "{notes:?}");
    // No frame in the [uprobes] area (0x7fffffffe000 on x86-64).
    let text = std::fs::read_to_string(&heap).unwrap();
    assert!(
        !text.contains("0x7fffffffe"),
        "trampoline written as a frame"
    );
    // The bytes are all still there, one frame up.
    let inuse = jeprof_rows(&binary, &heap, "--inuse_space");
    assert_within(
        "in use under main",
        row(&inuse, "main").cum * MIB,
        16.0 * MIB + 2000.0 * 4096.0,
        0.10,
    );
}

/// (allocation calls, sampled, return probe runs) from the summary line.
fn return_counts(stderr: &str) -> (u64, u64, u64) {
    let calls = summary_count(stderr, " allocation calls");
    let sampled = summary_count(stderr, " sampled");
    let returns = summary_count(stderr, " return probe runs");
    (calls, sampled, returns)
}

fn kernel_at_least(major: u32, minor: u32) -> bool {
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap();
    let mut numbers = release
        .split(['.', '-'])
        .map(|n| n.parse::<u32>().unwrap_or(0));
    (numbers.next().unwrap(), numbers.next().unwrap()) >= (major, minor)
}

fn kernel_has_uprobe_sessions() -> bool {
    kernel_at_least(6, 13)
}

/// With uprobe sessions only sampled calls run a return half; with plain
/// uretprobes every allocation call does. Counted by the eBPF programs.
#[test]
fn unsampled_calls_skip_the_return_half_with_sessions() {
    let _guard = shared();
    let pairs = 20_480;
    let mut counts = Vec::new();
    for mode in ["auto", "uretprobes"] {
        let out = output_dir(&format!("return_half_{mode}"));
        let output = Command::new(memprobe_bin())
            .args(["--return-probes", mode, "--sample-interval", "8192", "-v"])
            .args(["-o", out.to_str().unwrap(), "--"])
            .arg(malloc_loop_fixture())
            .arg(pairs.to_string())
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
        assert!(output.status.success(), "{stderr}");
        let malloc_line = stderr
            .lines()
            .find(|l| l.contains(": malloc at "))
            .unwrap_or_else(|| panic!("{stderr}"));
        counts.push((mode, return_counts(&stderr)));
        if mode == "uretprobes" {
            assert!(malloc_line.ends_with("(entry and return)"), "{malloc_line}");
        } else if kernel_has_uprobe_sessions() {
            assert!(malloc_line.ends_with("as a session)"), "{malloc_line}");
        } else {
            assert!(stderr.contains("uprobe sessions unavailable"), "{stderr}");
        }
    }
    eprintln!("(mode, (allocation calls, sampled, return probe runs)): {counts:?}");
    let (_, (calls, sampled, returns)) = counts[1];
    assert!(calls >= pairs, "{counts:?}");
    assert_eq!(
        returns, calls,
        "a uretprobe runs at every allocation's return"
    );
    assert!(sampled > 50, "{counts:?}");
    if kernel_has_uprobe_sessions() {
        let (_, (calls, sampled, returns)) = counts[0];
        assert!(calls >= pairs, "{counts:?}");
        assert!(sampled > 50 && sampled < calls / 10, "{counts:?}");
        assert_eq!(returns, sampled, "only sampled calls run their return half");
    }
}

/// How many of memprobe's BPF links are of `link_type` ("perf",
/// "uprobe_multi"), as the kernel's fdinfo names them: probes on the
/// target, not the `mmap` syscall's tracepoints (perf links too, on no
/// task).
fn links_of_type(pid: u32, link_type: &str) -> usize {
    let has = |info: &str, fields: [&str; 2]| {
        info.lines()
            .any(|line| line.split_whitespace().collect::<Vec<_>>() == fields)
    };
    std::fs::read_dir(format!("/proc/{pid}/fdinfo"))
        .unwrap()
        .filter_map(|entry| std::fs::read_to_string(entry.ok()?.path()).ok())
        .filter(|info| has(info, ["link_type:", link_type]))
        .filter(|info| !has(info, ["event_type:", "tracepoint"]))
        .count()
}

/// Where the kernel's uprobe_multi links filter by process (6.10+), plain
/// probes are such links: the target carries no per-task perf event,
/// which its main thread would pay for at every context switch. A kernel
/// without them (played with `MEMPROBE_KERNEL_LACKS=uprobe-multi`) gets
/// aya's perf-event uprobes.
#[test]
fn plain_probes_are_uprobe_multi_links_where_the_kernel_has_them() {
    let _guard = shared();
    for lacks in ["", "uprobe-multi"] {
        let out = output_dir(&format!("entry_links_{lacks}"));
        let mut command = Command::new(memprobe_bin());
        command
            .args(["--track", "allocations", "--return-probes", "uretprobes"])
            .args(["--format", "heap", "-o", out.to_str().unwrap(), "--"])
            .arg(malloc_loop_fixture())
            .args(["0", "3"])
            .env("MEMPROBE_KERNEL_LACKS", lacks)
            .stdout(std::process::Stdio::null());
        let mut memprobe = Memprobe::start_command(command);
        memprobe.wait_attached();
        let perf_events = links_of_type(memprobe.pid(), "perf");
        let links = links_of_type(memprobe.pid(), "uprobe_multi");
        let (status, stderr) = memprobe.wait();
        assert!(status.success(), "{stderr}");
        let cost_line = stderr
            .lines()
            .find(|l| l.starts_with("memprobe: cost per hit"))
            .unwrap_or_else(|| panic!("{stderr}"));
        eprintln!("lacks {lacks:?}: {perf_events} perf links, {links} uprobe_multi; {cost_line}");
        if lacks.is_empty() && kernel_at_least(6, 10) {
            assert_eq!(perf_events, 0, "{stderr}");
            assert!(links > 0, "{stderr}");
            assert!(cost_line.ends_with("entry probes: uprobe_multi links"));
        } else {
            assert!(perf_events > 0, "{stderr}");
            assert!(cost_line.ends_with("entry probes: perf-event uprobes"));
        }
    }
}

/// The ids of the BPF programs memprobe (process `pid`) holds loaded, and
/// of those its links run, as the kernel's fdinfo tells.
fn programs_and_linked(pid: u32) -> (HashSet<u64>, HashSet<u64>) {
    let field = |info: &str, name: &str| {
        info.lines()
            .find_map(|line| line.strip_prefix(name)?.trim().parse::<u64>().ok())
    };
    let infos: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/fdinfo"))
        .unwrap()
        .filter_map(|entry| std::fs::read_to_string(entry.ok()?.path()).ok())
        .collect();
    let programs = (infos.iter())
        .filter(|info| info.contains("prog_type:") && !info.contains("link_type:"))
        .filter_map(|info| field(info, "prog_id:"))
        .collect();
    let linked = (infos.iter())
        .filter(|info| info.contains("link_type:"))
        .filter_map(|info| field(info, "prog_id:"))
        .collect();
    (programs, linked)
}

/// Each program loaded costs memprobe the verifier's time (tens of
/// milliseconds of CPU each here): a run loads only the programs it links,
/// in the one form it links them (uprobe session, uprobe_multi entry link
/// or perf-event uprobe), not every program in every form (54 of them,
/// some 1.4 s of CPU before the attach).
#[test]
fn a_run_loads_only_the_programs_it_links() {
    let _guard = shared();
    let fixture = Fixture::start(&sites_fixture(), &[]);
    let out = output_dir("programs_loaded");
    let args = ["--sampling", "entry", "--recalibrate-every", "never"];
    let memprobe = Memprobe::attach(&fixture, &out, &args);
    let (programs, linked) = programs_and_linked(memprobe.pid());
    let stderr = memprobe.stop();
    drop(fixture);
    let unlinked: Vec<&u64> = programs.difference(&linked).collect();
    eprintln!(
        "{} programs loaded, {} of them linked; not linked: {unlinked:?}",
        programs.len(),
        programs.len() - unlinked.len()
    );
    assert!(!linked.is_empty(), "no link found:\n{stderr}");
    // Those the cost calibration linked before the attach (the allocation
    // program, a uretprobe's, a free's, a session) and the thread iterator.
    assert!(
        unlinked.len() <= 5,
        "{} programs loaded and never linked: {unlinked:?}\n{stderr}",
        unlinked.len()
    );
}

/// jemalloc 5.3's inlined fast path is recognised by decoding (what
/// sampling on its slow path needs): in Debian's shared library (TLS
/// offset in a GOT slot) and in a static tikv-jemallocator build (TLS
/// offset an immediate), said in `--verbose`.
#[test]
fn jemallocs_fast_path_is_recognised_in_shared_and_static_builds() {
    let _guard = shared();
    for (binary, tls) in [
        (
            sites_fixture(),
            "the TLS offset in the GOT slot at file offset 0x",
        ),
        (rust_fixture(), "TLS at fs-0x"),
    ] {
        let out = output_dir("fast_path");
        let out = out.to_str().unwrap();
        let mut fixture = Fixture::start(&binary, &[]);
        let pid = fixture.pid.to_string();
        let args = ["--pid", &pid, "--duration", "1s", "-v", "-o", out];
        let (status, stderr) = run_memprobe(&args, &[]);
        fixture.run_workload();
        assert!(fixture.finish().success());
        assert!(status.success(), "{stderr}");
        let line = stderr
            .lines()
            .find(|l| l.contains("jemalloc 5.3 malloc fast path recognised"))
            .unwrap_or_else(|| panic!("{stderr}"));
        assert!(line.contains("above 4096 bytes"), "{line}");
        assert!(
            line.contains("thread counters at TLS +0x338 and +0x340"),
            "{line}"
        );
        assert!(line.contains(tls), "{line}");
    }
}

/// The CPUs every thread of process `pid` may run on, as /proc lists them.
fn threads_cpus(pid: u32) -> Vec<String> {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).unwrap();
    tasks
        .filter_map(|task| {
            let status = std::fs::read_to_string(task.ok()?.path().join("status")).ok()?;
            let line = status
                .lines()
                .find(|l| l.starts_with("Cpus_allowed_list:"))?;
            Some(line.split_whitespace().last()?.to_owned())
        })
        .collect()
}

/// A target pinned to CPU 0 keeps it: memprobe's threads, the ones started
/// after the attach too, keep to the other CPUs, and say so.
#[test]
fn memprobe_keeps_off_a_pinned_targets_cpus() {
    let _guard = shared();
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    if cpus < 2 {
        eprintln!("skipped: one CPU, nowhere else to run");
        return;
    }
    let out = output_dir("keeps_off_pinned");
    let mut command = Command::new("taskset");
    command.args(["-c", "0"]).arg(sites_fixture());
    let mut fixture = Fixture::start_command(command);
    let memprobe = Memprobe::attach(&fixture, &out, &[]);
    let others = if cpus == 2 {
        "1".to_owned()
    } else {
        format!("1-{}", cpus - 1)
    };
    memprobe.wait_for_stderr(
        &format!("memprobe: running on CPUs {others}, off the CPUs its targets are kept to (0)"),
        std::time::Duration::from_secs(5),
        "the placement's status line",
    );
    fixture.run_workload();
    let threads = threads_cpus(memprobe.pid());
    assert!(!threads.is_empty());
    assert!(threads.iter().all(|t| *t == others), "{threads:?}");
    assert_eq!(threads_cpus(fixture.pid), ["0"]);
    let stderr = memprobe.stop();
    let heap = out.join(format!("memprobe.{}.0.heap", fixture.pid));
    assert!(heap.exists(), "{stderr}");
    fixture.finish();
}
