//! What following mappings costs: an mmap/munmap loop (64 KiB mapped, a
//! page touched, unmapped) and a loop of the cheapest system call, with no
//! profiler and while memprobe profiles another process (in rounds, taking
//! turns), and the mmap loop profiled itself (each mapping trapped and sent
//! with its stack). A process that does not map memory runs none of it.
use std::{
    path::Path,
    process::{Command, Stdio},
};

use anyhow::Result;

use super::{build_fixture, loop_ns, start_memprobe, stop};

/// Nanoseconds per mmap+munmap pair and per system call, side by side.
pub(super) struct MappingCosts {
    map_none: f64,
    map_other_profiled: f64,
    map_profiled: f64,
    syscall_none: f64,
    syscall_other_profiled: f64,
}

const PAIRS: &str = "200000";
const CALLS: &str = "3000000";
/// Rounds of no profiler, then memprobe beside.
const ROUNDS: usize = 3;
/// Pairs when profiled: each mapping is trapped, sent and unwound.
const PROFILED_PAIRS: &str = "20000";

pub(super) fn mapping_costs(
    memprobe: &Path,
    out: &Path,
    profiles_dir: &str,
) -> Result<MappingCosts> {
    eprintln!("bench: mmap/munmap loop, system call loop");
    let map_loop = build_fixture(out, "map_loop", "map_loop", &[])?;
    let syscall_loop = build_fixture(out, "syscall_loop", "syscall_loop", &[])?;
    let run = |binary: &Path, arg: &'static str| {
        let binary = binary.to_owned();
        move || {
            let mut c = Command::new(&binary);
            c.arg(arg);
            c
        }
    };
    // Rounds of: no profiler, then memprobe on an idle process (the loops
    // not profiled), so that the host's drift falls on both alike.
    let (mut map_none, mut syscall_none) = (f64::INFINITY, f64::INFINITY);
    let (mut map_other, mut syscall_other) = (f64::INFINITY, f64::INFINITY);
    for _ in 0..ROUNDS {
        map_none = map_none.min(loop_ns(run(&map_loop, PAIRS), 3)?);
        syscall_none = syscall_none.min(loop_ns(run(&syscall_loop, CALLS), 3)?);
        let mut idle = Command::new("sleep")
            .arg("600")
            .stdout(Stdio::null())
            .spawn()?;
        std::thread::sleep(std::time::Duration::from_millis(200));
        let pid = idle.id().to_string();
        let args = ["--pid", &pid, "--format", "heap", "-o", profiles_dir];
        let (mut watching, _) = start_memprobe(memprobe, &args)?;
        // Its start-up work (measuring probe costs) done.
        std::thread::sleep(std::time::Duration::from_secs(3));
        let map = loop_ns(run(&map_loop, PAIRS), 3);
        let syscall = loop_ns(run(&syscall_loop, CALLS), 3);
        stop(&mut watching);
        let _ = idle.kill();
        let _ = idle.wait();
        map_other = map_other.min(map?);
        syscall_other = syscall_other.min(syscall?);
    }
    let map_profiled = loop_ns(
        || {
            let mut c = Command::new(memprobe);
            c.args([
                "--max-overhead",
                "none",
                "--format",
                "heap",
                "-o",
                profiles_dir,
            ])
            .arg("--")
            .arg(&map_loop)
            .arg(PROFILED_PAIRS);
            c
        },
        3,
    )?;
    Ok(MappingCosts {
        map_none,
        map_other_profiled: map_other,
        map_profiled,
        syscall_none,
        syscall_other_profiled: syscall_other,
    })
}

pub(super) fn mapping_table(costs: &MappingCosts) -> String {
    let row =
        |name: &str, ns: f64, none: f64| format!("| {name} | {ns:.0} ns | {:.2}x |\n", ns / none);
    let mut table = String::from(
        "\nFollowing mappings (best of 3 rounds of 3 runs, no profiler and memprobe beside \
         taking turns; profiled: best of 3 runs)\n\n| loop, setup | per iteration | vs no \
         profiler |\n|---|---|---|\n",
    );
    let map = costs.map_none;
    table.push_str(&row(
        "mmap + touch + munmap of 64 KiB, no profiler",
        map,
        map,
    ));
    table.push_str(&row(
        "the same, memprobe profiling another process",
        costs.map_other_profiled,
        map,
    ));
    table.push_str(&row(
        "the same, profiled (each mapping trapped and sent with its stack)",
        costs.map_profiled,
        map,
    ));
    let syscall = costs.syscall_none;
    table.push_str(&row("getppid, no profiler", syscall, syscall));
    table.push_str(&row(
        "getppid, memprobe profiling another process",
        costs.syscall_other_profiled,
        syscall,
    ));
    table
}
