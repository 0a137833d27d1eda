//! `cargo xtask bench`: what memprobe costs the profiled process, side by
//! side in one run: a malloc/free loop with no profiler, with probes placed
//! as bcc's memleak places them (a bpftrace script), and with memprobe; then
//! redis-server under redis-benchmark with and without memprobe attached.
use std::{
    io::{BufRead, BufReader},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};

use crate::{run_command, workspace_root};

mod attached;
mod floor;
mod one_trap;
mod own_profiler;
mod redis;
mod switches;
use attached::{AttachedLoops, attached_loops, attached_table};
use redis::{Load, redis_bench, redis_table};

const LIBJEMALLOC: &str = "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2";

/// A C fixture (`tests/fixtures/SOURCE.c`) built as `name` in `out`, with
/// `libs`.
fn build_fixture(out: &Path, source: &str, name: &str, libs: &[&str]) -> Result<PathBuf> {
    let binary = out.join(name);
    run_command(
        Command::new("cc")
            .args(["-O2", "-o"])
            .arg(&binary)
            .arg(workspace_root().join(format!("tests/fixtures/{source}.c")))
            .args(libs),
    )?;
    Ok(binary)
}

/// The malloc/free loop, linked to jemalloc or (`libs` empty) on glibc's.
fn build_loop(out: &Path, name: &str, libs: &[&str]) -> Result<PathBuf> {
    build_fixture(out, "malloc_loop", name, libs)
}

/// Nanoseconds per malloc+free pair printed by the loop (best of `runs`).
fn loop_ns(mut make: impl FnMut() -> Command, runs: usize) -> Result<f64> {
    let mut best = f64::INFINITY;
    for _ in 0..runs {
        let output = make().stderr(Stdio::null()).output()?;
        let text = String::from_utf8_lossy(&output.stdout);
        let ns: f64 = text
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .next_back()
            .with_context(|| format!("no timing in {text:?}"))?;
        best = best.min(ns);
    }
    Ok(best)
}

/// CPU seconds and peak RSS (KiB) of a live process.
fn usage(pid: u32) -> Usage {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let ticks: f64 = fields.get(11)?.parse::<f64>().ok()? + fields.get(12)?.parse::<f64>().ok()?;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let peak = status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()?;
    Some((ticks / hz, peak))
}

/// memprobe's stderr lines, collected as they come, with when each came.
type Stderr = std::sync::Arc<std::sync::Mutex<Vec<(Instant, String)>>>;

/// Starts memprobe and waits for its line saying it attached; every line
/// is kept.
/// No budget: the bench measures what memprobe costs, unbounded.
fn start_memprobe(memprobe: &Path, args: &[&str]) -> Result<(Child, Stderr)> {
    let mut child = Command::new(memprobe)
        .args(args)
        .args(["--max-overhead", "none"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()?;
    let mut lines = BufReader::new(child.stderr.take().context("stderr")?).lines();
    let kept = Stderr::default();
    for line in lines.by_ref() {
        let line = line?;
        let attached = line.contains("memprobe: attached");
        if let Ok(mut kept) = kept.lock() {
            kept.push((Instant::now(), line));
        }
        if attached {
            // Keep draining stderr so memprobe never blocks on it.
            let sink = kept.clone();
            std::thread::spawn(move || {
                for line in lines.map_while(|l| l.ok()) {
                    if let Ok(mut sink) = sink.lock() {
                        sink.push((Instant::now(), line));
                    }
                }
            });
            return Ok((child, kept));
        }
    }
    bail!("memprobe did not attach")
}

/// memprobe's first line containing `text`.
fn line_with(stderr: &Stderr, text: &str) -> Option<String> {
    let lines = stderr.lock().ok()?;
    lines
        .iter()
        .find(|(_, l)| l.contains(text))
        .map(|(_, l)| l.clone())
}

/// When memprobe first said something containing `text`.
fn said(stderr: &Stderr, text: &str) -> Option<Instant> {
    let lines = stderr.lock().ok()?;
    lines
        .iter()
        .find(|(_, l)| l.contains(text))
        .map(|(at, _)| *at)
}

/// What memprobe says when a process's slow-path trial keeps the slow path.
const SLOW_PATH_KEPT: &str = "stays on jemalloc's slow path";
/// What it says when the trial sends it back to entry sampling.
const FELL_BACK: &str = "back to entry sampling";

fn stop(child: &mut Child) {
    // SAFETY: signalling our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    let _ = child.wait();
}

/// A part of the bench run alone (while working on it).
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Part {
    /// The malloc/free loops.
    Loops,
    /// A context-switching process with unhit probes.
    Switches,
    /// A loop running jemalloc's own profiler (prof:true).
    OwnProfiler,
    /// redis-server under redis-benchmark, each load.
    Redis,
    /// redis-server under redis-benchmark's own load alone (3-byte values,
    /// not pipelined), in the most rounds.
    RedisDefaultLoad,
    /// Offline reports of a large profile.
    Offline,
}

pub fn bench(only: Option<Part>) -> Result<()> {
    let root = workspace_root();
    let out = root.join("target/bench");
    let _ = std::fs::remove_dir_all(&out);
    std::fs::create_dir_all(&out)?;
    let memprobe = root.join("target/release/memprobe");
    let profiles = out.join("profiles");
    std::fs::create_dir_all(&profiles)?;
    let profiles_dir = profiles.to_str().context("path")?.to_owned();
    let runs = |part| only.is_none_or(|only| only == part);

    let mut table = String::new();
    let mut places = None;
    if runs(Part::Loops) {
        let loops = measure_loops(&memprobe, &out, &profiles_dir)?;
        table.push_str(&loop_table(&loops));
        places = Some(loops.attached.places);
    }
    if runs(Part::Switches) {
        let result = switches::switches(&memprobe, &out, &profiles_dir)?;
        table.push_str(&switches::switches_table(&result));
    }
    if runs(Part::OwnProfiler) {
        let result = own_profiler::own_profiler(&memprobe, &profiles_dir)?;
        table.push_str(&own_profiler::own_profiler_table(&result));
    }
    let loads: &[Load] = match only {
        None | Some(Part::Redis) => &redis::LOADS,
        Some(Part::RedisDefaultLoad) => &redis::LOADS[..1],
        Some(_) => &[],
    };
    if !loads.is_empty() {
        let places = match places {
            Some(places) => places,
            None => {
                let malloc_loop = build_loop(&out, "malloc_loop", &["-ljemalloc"])?;
                floor::memprobe_places(&memprobe, &malloc_loop, LIBJEMALLOC)?
            }
        };
        for &load in loads {
            eprintln!(
                "bench: redis-server under redis-benchmark, {}-byte values, pipelining {}",
                load.value_bytes, load.pipeline
            );
            let redis = redis_bench(&memprobe, &profiles_dir, &places, load)?;
            table.push_str(&redis_table(&redis));
        }
    }
    if runs(Part::Offline) {
        eprintln!("bench: offline reports of a large program's profile");
        table.push_str(&offline_bench(&memprobe, &out)?);
    }
    std::fs::write(out.join("results.md"), &table)?;
    println!("{table}");
    eprintln!("bench: results in {}", out.join("results.md").display());
    Ok(())
}

/// Nanoseconds per malloc+free pair of each configuration, one run.
struct LoopResults {
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
    attached: AttachedLoops,
    /// memprobe's own CPU and memory over a sustained loop, and its length.
    own: Usage,
    own_wall: Duration,
}

/// The malloc/free loops, side by side.
fn measure_loops(memprobe: &Path, out: &Path, profiles_dir: &str) -> Result<LoopResults> {
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

/// The README's loop tables.
fn loop_table(r: &LoopResults) -> String {
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

/// CPU seconds and peak RSS in KiB of a process.
type Usage = Option<(f64, u64)>;

/// Seconds of the fastest of `runs` runs of `command`.
fn best_time(mut make: impl FnMut() -> Command, runs: usize) -> Result<f64> {
    let mut best = f64::INFINITY;
    for _ in 0..runs {
        let started = Instant::now();
        let status = make()
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()?;
        if !status.success() {
            bail!("{:?} failed", make());
        }
        best = best.min(started.elapsed().as_secs_f64());
    }
    Ok(best)
}

/// A JVM's start-up profiled at 4 KiB (libjvm.so is 20 MB with a large
/// symbol table): jeprof --collapsed (binutils) against memprobe's own
/// symbolization (blazesym), same profile, same machine, one run.
fn offline_bench(memprobe: &Path, out: &Path) -> Result<String> {
    let java = PathBuf::from("/usr/lib/jvm/java-17-openjdk-amd64/bin/java");
    let dir = out.join("jvm");
    std::fs::create_dir_all(&dir)?;
    let status = Command::new(memprobe)
        .args(["--sample-interval", "4096", "--format", "heap", "-o"])
        .arg(&dir)
        .arg("--")
        .arg(&java)
        .args(["-Xshare:off", "-XX:+UseSerialGC", "-version"])
        .env("LD_PRELOAD", LIBJEMALLOC)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()?;
    if !status.success() {
        bail!("profiling the JVM failed");
    }
    let heap = std::fs::read_dir(&dir)?
        .flatten()
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|e| e == "heap"))
        .context("no JVM profile")?;
    let text = std::fs::read_to_string(&heap)?;
    let stacks = text.lines().filter(|l| l.starts_with('@')).count();
    let jeprof = best_time(
        || {
            let mut c = Command::new("jeprof");
            c.arg("--collapsed").arg(&java).arg(&heap);
            c
        },
        3,
    )?;
    let folded = best_time(
        || {
            let mut c = Command::new(memprobe);
            c.args(["convert", "--to", "folded", "-o", "/dev/null"])
                .arg(&heap);
            c
        },
        3,
    )?;
    let report = best_time(
        || {
            let mut c = Command::new(memprobe);
            c.arg("report").arg(&heap);
            c
        },
        3,
    )?;
    Ok(format!(
        "\n| offline, JVM start-up profile ({stacks} stacks, libjvm.so) | seconds | vs jeprof |\n|---|---|---|\n\
         | `jeprof --collapsed` | {jeprof:.2} | 1.0x |\n\
         | `memprobe convert --to folded` | {folded:.3} | {:.0}x faster |\n\
         | `memprobe report` | {report:.3} | {:.0}x faster |\n",
        jeprof / folded,
        jeprof / report
    ))
}
