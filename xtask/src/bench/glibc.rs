//! A process on glibc's malloc (the allocator of most C and C++ servers,
//! and of a JVM's native memory), attached with `--pid` while it runs:
//! what memprobe costs it against the one-trap floor at glibc's `free`.
//! glibc has no slow path to sample on and no per-thread byte counter to
//! weigh windows by, so at the defaults its every call traps.
use std::{path::Path, process::Command};

use anyhow::Result;

use super::{
    attached::{Attached, ONE_TRAP, best_of_three, floor_ns, start_timed, wait_ns},
    build_loop,
    floor::memprobe_places,
    one_trap::OneTrap,
};

const LIBC: &str = "/usr/lib/x86_64-linux-gnu/libc.so.6";

/// Nanoseconds per malloc+free pair of the running glibc loop.
pub(super) struct GlibcCosts {
    none: f64,
    one_trap: f64,
    defaults: f64,
    allocations: f64,
}

pub(super) fn glibc_costs(memprobe: &Path, out: &Path, profiles_dir: &str) -> Result<GlibcCosts> {
    eprintln!(
        "bench: a glibc loop attached with --pid: one-trap floor, defaults, --track allocations"
    );
    let glibc_loop = build_loop(out, "malloc_loop_glibc", &[])?;
    let places = memprobe_places(memprobe, &glibc_loop, LIBC)?;
    // The loop repeats one cycle of sizes (64 to 127 bytes), as a server
    // repeats a request's allocations; timed for 3 s.
    let timed_loop = || {
        let mut command = Command::new(&glibc_loop);
        command.args(["0", "3"]);
        command
    };
    let none = best_of_three(|| Ok(wait_ns(start_timed(timed_loop(), None)?)?.0))?;
    let one_trap = floor_ns(timed_loop, "one-trap floor", |pid| {
        OneTrap::attach(pid, &places[1])
    })?;
    let defaults = Attached::new(memprobe, profiles_dir, &[]).ns(timed_loop)?;
    let allocations_only = ["--track", "allocations"];
    let allocations = Attached::new(memprobe, profiles_dir, &allocations_only).ns(timed_loop)?;
    Ok(GlibcCosts {
        none,
        one_trap,
        defaults,
        allocations,
    })
}

/// docs/overhead.md's glibc table.
pub(super) fn glibc_table(r: &GlibcCosts) -> String {
    let (none, one_trap) = (r.none, r.one_trap - r.none);
    let row = |name: &str, ns: f64| {
        format!(
            "| {name} | {ns:.0} | {:.0} | {:.2}x |\n",
            ns - none,
            (ns - none) / one_trap
        )
    };
    let mut table = String::from(
        "\n| a malloc/free loop on glibc (libc.so.6), attached with `--pid` while it runs | ns per pair | added ns | vs one-trap floor |\n|---|---|---|---|\n",
    );
    table.push_str(&format!("| no profiler | {none:.1} | - | - |\n"));
    table.push_str(&row(ONE_TRAP, r.one_trap));
    table.push_str(&row(
        "memprobe at defaults, `--max-overhead none` (every malloc and free traps: glibc has no windows)",
        r.defaults,
    ));
    table.push_str(&row(
        "memprobe `--track allocations` (every malloc traps, no free)",
        r.allocations,
    ));
    table
}
