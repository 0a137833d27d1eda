//! The malloc/free loops: no profiler, probes placed as bcc's memleak
//! places them, memprobe in each mode, glibc's malloc, sampled stacks, and
//! memprobe's own CPU and memory; each run started under memprobe, then
//! attached with `--pid` (`attached.rs`).
use std::{
    path::Path,
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::Result;

use super::{
    LIBJEMALLOC, Usage,
    attached::{AttachedLoops, attached_loops, attached_table},
    build_loop, loop_ns, start_memprobe, stop, usage,
};

/// Nanoseconds per malloc+free pair of each configuration, one run.
pub(super) struct LoopResults {
    none: f64,
    memleak: f64,
    entry: f64,
    uretprobes: f64,
    emulated: f64,
    allocations: f64,
    glibc_none: f64,
    glibc_memprobe: f64,
    sampled_fp: f64,
    sampled_dwarf: f64,
    /// Attached to a running loop: the two-trap floor and memprobe.
    pub(super) attached: AttachedLoops,
    /// memprobe's own CPU and memory over a sustained loop, and its length.
    own: Usage,
    own_wall: Duration,
}

/// The malloc/free loops, side by side.
pub(super) fn measure_loops(
    memprobe: &Path,
    out: &Path,
    profiles_dir: &str,
) -> Result<LoopResults> {
    let malloc_loop = build_loop(out, "malloc_loop", &["-ljemalloc"])?;
    let glibc_loop = build_loop(out, "malloc_loop_glibc", &[])?;
    eprintln!("bench: malloc/free loop");
    let plain = |binary: &Path| {
        let binary = binary.to_owned();
        move || {
            let mut c = Command::new(&binary);
            c.arg("5000000");
            c
        }
    };
    let none = loop_ns(plain(&malloc_loop), 5)?;
    let script = format!(
        "uprobe:{LIBJEMALLOC}:malloc {{ @size[tid] = arg0; }} \
         uretprobe:{LIBJEMALLOC}:malloc {{ @live[retval] = @size[tid]; delete(@size[tid]); }} \
         uprobe:{LIBJEMALLOC}:free {{ delete(@live[arg0]); }} \
         END {{ clear(@size); clear(@live); }}"
    );
    let memleak = loop_ns(
        || {
            let mut c = Command::new("bpftrace");
            c.args(["-e", &script, "-c"])
                .arg(format!("{} 20000", malloc_loop.display()));
            c
        },
        3,
    )?;
    let under = |binary: &Path, options: &'static [&'static str], pairs: &'static str| {
        let (memprobe, binary) = (memprobe.to_owned(), binary.to_owned());
        let profiles_dir = profiles_dir.to_owned();
        move || {
            let mut c = Command::new(&memprobe);
            c.args(options)
                .args(["--max-overhead", "none"])
                .args(["--format", "heap", "-o", &profiles_dir, "--"])
                .arg(&binary)
                .arg(pairs);
            c
        }
    };
    let entry_placement = &["--placement", "entry", "--return-probes", "uretprobes"];
    let entry = loop_ns(under(&malloc_loop, entry_placement, "20000"), 3)?;
    let uretprobes = &["--return-probes", "uretprobes"];
    let uretprobes = loop_ns(under(&malloc_loop, uretprobes, "500000"), 3)?;
    let emulated = loop_ns(under(&malloc_loop, &[], "500000"), 3)?;
    let allocations_only = &["--track", "allocations"];
    let allocations = loop_ns(under(&malloc_loop, allocations_only, "500000"), 3)?;
    eprintln!("bench: malloc/free loop on glibc's malloc");
    let glibc_none = loop_ns(plain(&glibc_loop), 5)?;
    let glibc_memprobe = loop_ns(under(&glibc_loop, &[], "500000"), 3)?;
    // What a sampled call's stack walk costs: at 16 KiB about one call in
    // 170 is sampled; with and without the stack copy for DWARF.
    eprintln!("bench: stack walks of sampled calls");
    let fine_fp = &["--sample-interval", "16KiB", "--unwind", "fp"];
    let sampled_fp = loop_ns(under(&malloc_loop, fine_fp, "2000000"), 3)?;
    let fine_dwarf = &["--sample-interval", "16KiB", "--unwind", "dwarf"];
    let sampled_dwarf = loop_ns(under(&malloc_loop, fine_dwarf, "2000000"), 3)?;
    let attached = attached_loops(memprobe, &malloc_loop, profiles_dir)?;
    let (own, own_wall) = own_usage(memprobe, &malloc_loop, profiles_dir)?;
    Ok(LoopResults {
        none,
        memleak,
        entry,
        uretprobes,
        emulated,
        allocations,
        glibc_none,
        glibc_memprobe,
        sampled_fp,
        sampled_dwarf,
        attached,
        own,
        own_wall,
    })
}

/// memprobe's own CPU and memory over a 6 s loop at a sustained rate.
fn own_usage(memprobe: &Path, malloc_loop: &Path, profiles_dir: &str) -> Result<(Usage, Duration)> {
    // memprobe's own CPU and memory at a sustained allocation rate.
    eprintln!("bench: memprobe's own CPU and memory");
    let mut sustained = Command::new(malloc_loop)
        .args(["0", "6"])
        .stdout(Stdio::null())
        .spawn()?;
    let pid = sustained.id().to_string();
    let started = Instant::now();
    let (mut probe, _) = start_memprobe(memprobe, &["--pid", &pid, "-o", profiles_dir])?;
    let _ = sustained.wait();
    let own = usage(probe.id());
    let own_wall = started.elapsed();
    stop(&mut probe);
    Ok((own, own_wall))
}

/// docs/overhead.md's loop tables.
pub(super) fn loop_table(r: &LoopResults) -> String {
    let none = r.none;
    let added_memleak = r.memleak - none;
    let row = |name: &str, ns: f64| {
        format!(
            "| {name} | {ns:.0} | {:.0} | {:.1}x less |\n",
            ns - none,
            added_memleak / (ns - none)
        )
    };
    let mut table = String::new();
    table.push_str("| malloc+free loop (libjemalloc.so.2) | ns per pair | added ns | vs memleak placement |\n|---|---|---|---|\n");
    table.push_str(&format!("| no profiler | {none:.1} | - | - |\n"));
    table.push_str(&format!(
        "| probes placed as bcc memleak (bpftrace: uprobe+uretprobe malloc, uprobe free) | {:.0} | {added_memleak:.0} | 1.0x |\n",
        r.memleak
    ));
    table.push_str(&row(
        "memprobe `--placement entry --return-probes uretprobes`",
        r.entry,
    ));
    table.push_str(&row(
        "memprobe `--return-probes uretprobes` (emulated placement; kernels before 6.13)",
        r.uretprobes,
    ));
    table.push_str(&row(
        "memprobe (default: emulated placement, uprobe sessions)",
        r.emulated,
    ));
    table.push_str(&row(
        "memprobe `--track allocations` (no free probe, no return half)",
        r.allocations,
    ));
    table.push_str(&attached_table(none, &r.attached));
    table.push_str(&format!(
        "\n| the same loop on glibc's malloc (libc.so.6) | ns per pair | added ns | vs jemalloc's added ns |\n|---|---|---|---|\n\
         | no profiler | {:.1} | - | - |\n\
         | memprobe (default) | {:.0} | {:.0} | {:.2}x |\n",
        r.glibc_none,
        r.glibc_memprobe,
        r.glibc_memprobe - r.glibc_none,
        (r.glibc_memprobe - r.glibc_none) / (r.emulated - none)
    ));
    table.push_str(&format!(
        "\n| sampled calls' stacks, `--sample-interval 16KiB` (about 1 call in 170 sampled) | ns per pair |\n|---|---|\n\
         | `--unwind fp` (frame-pointer walk in the kernel) | {:.0} |\n\
         | `--unwind dwarf` (every sample with 16 KiB of stack copied for DWARF unwinding) | {:.0} ({:+.0}) |\n",
        r.sampled_fp,
        r.sampled_dwarf,
        r.sampled_dwarf - r.sampled_fp
    ));
    if let Some((cpu, rss)) = r.own {
        let wall = r.own_wall.as_secs_f64();
        table.push_str(&format!(
            "\nmemprobe itself while the loop ran ({wall:.1} s): {cpu:.2} s CPU ({:.1}% of one CPU), peak RSS {:.1} MiB.\n",
            100.0 * cpu / wall,
            rss as f64 / 1024.0
        ));
    }
    table
}
