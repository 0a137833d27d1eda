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

const LIBJEMALLOC: &str = "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2";

/// The malloc/free loop, linked to jemalloc or (`libs` empty) on glibc's.
fn build_loop(out: &Path, name: &str, libs: &[&str]) -> Result<PathBuf> {
    let binary = out.join(name);
    run_command(
        Command::new("cc")
            .args(["-O2", "-o"])
            .arg(&binary)
            .arg(workspace_root().join("tests/fixtures/malloc_loop.c"))
            .args(libs),
    )?;
    Ok(binary)
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

fn start_memprobe(memprobe: &Path, args: &[&str]) -> Result<Child> {
    let mut child = Command::new(memprobe)
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()?;
    let mut lines = BufReader::new(child.stderr.take().context("stderr")?).lines();
    for line in lines.by_ref() {
        if line?.contains("memprobe: attached") {
            // Keep draining stderr so memprobe never blocks on it.
            std::thread::spawn(move || for _ in lines {});
            return Ok(child);
        }
    }
    bail!("memprobe did not attach")
}

fn stop(child: &mut Child) {
    // SAFETY: signalling our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    let _ = child.wait();
}

pub fn bench() -> Result<()> {
    let root = workspace_root();
    let out = root.join("target/bench");
    let _ = std::fs::remove_dir_all(&out);
    std::fs::create_dir_all(&out)?;
    let memprobe = root.join("target/release/memprobe");
    let malloc_loop = build_loop(&out, "malloc_loop", &["-ljemalloc"])?;
    let glibc_loop = build_loop(&out, "malloc_loop_glibc", &[])?;
    let profiles = out.join("profiles");
    std::fs::create_dir_all(&profiles)?;
    let profiles_dir = profiles.to_str().context("path")?.to_owned();

    eprintln!("bench: malloc/free loop");
    let none = loop_ns(
        || {
            let mut c = Command::new(&malloc_loop);
            c.arg("5000000");
            c
        },
        5,
    )?;
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
    let memprobe_loop_of =
        |malloc_loop: &Path, options: &'static [&'static str], pairs: &'static str| {
            let memprobe = memprobe.clone();
            let malloc_loop = malloc_loop.to_owned();
            let profiles_dir = profiles_dir.clone();
            move || {
                let mut c = Command::new(&memprobe);
                c.args(options)
                    .args(["--format", "heap", "-o", &profiles_dir, "--"])
                    .arg(&malloc_loop)
                    .arg(pairs);
                c
            }
        };
    let memprobe_loop = |options: &'static [&'static str], pairs: &'static str| {
        memprobe_loop_of(&malloc_loop, options, pairs)
    };
    let entry_placement = &["--placement", "entry", "--return-probes", "uretprobes"];
    let memprobe_entry = loop_ns(memprobe_loop(entry_placement, "20000"), 3)?;
    let uretprobes = &["--return-probes", "uretprobes"];
    let memprobe_uretprobes = loop_ns(memprobe_loop(uretprobes, "500000"), 3)?;
    let memprobe_emulated = loop_ns(memprobe_loop(&[], "500000"), 3)?;
    let allocations_only = &["--track", "allocations"];
    let memprobe_allocations = loop_ns(memprobe_loop(allocations_only, "500000"), 3)?;
    eprintln!("bench: malloc/free loop on glibc's malloc");
    let glibc_none = loop_ns(
        || {
            let mut c = Command::new(&glibc_loop);
            c.arg("5000000");
            c
        },
        5,
    )?;
    let glibc_memprobe = loop_ns(memprobe_loop_of(&glibc_loop, &[], "500000"), 3)?;
    // What a sampled call's stack walk costs: at 16 KiB about one call in
    // 170 is sampled; with and without the stack copy for DWARF.
    eprintln!("bench: stack walks of sampled calls");
    let fine_fp = &["--sample-interval", "16KiB", "--unwind", "fp"];
    let sampled_fp = loop_ns(memprobe_loop(fine_fp, "2000000"), 3)?;
    let fine_dwarf = &["--sample-interval", "16KiB", "--unwind", "dwarf"];
    let sampled_dwarf = loop_ns(memprobe_loop(fine_dwarf, "2000000"), 3)?;

    // memprobe's own CPU and memory at a sustained allocation rate.
    eprintln!("bench: memprobe's own CPU and memory");
    let mut sustained = Command::new(&malloc_loop)
        .args(["0", "6"])
        .stdout(Stdio::null())
        .spawn()?;
    let pid = sustained.id().to_string();
    let started = Instant::now();
    let mut probe = start_memprobe(&memprobe, &["--pid", &pid, "-o", &profiles_dir])?;
    let _ = sustained.wait();
    let own = usage(probe.id());
    let wall = started.elapsed();
    stop(&mut probe);

    eprintln!("bench: redis-server under redis-benchmark");
    let redis = redis_bench(&memprobe, &profiles_dir)?;

    eprintln!("bench: offline reports of a large program's profile");
    let offline = offline_bench(&memprobe, &out)?;

    let added_memleak = memleak - none;
    let added_emulated = memprobe_emulated - none;
    let mut table = String::new();
    table.push_str("| malloc+free loop (libjemalloc.so.2) | ns per pair | added ns | vs memleak placement |\n|---|---|---|---|\n");
    table.push_str(&format!("| no profiler | {none:.1} | - | - |\n"));
    table.push_str(&format!(
        "| probes placed as bcc memleak (bpftrace: uprobe+uretprobe malloc, uprobe free) | {memleak:.0} | {added_memleak:.0} | 1.0x |\n"
    ));
    table.push_str(&format!(
        "| memprobe `--placement entry --return-probes uretprobes` | {memprobe_entry:.0} | {:.0} | {:.1}x less |\n",
        memprobe_entry - none,
        added_memleak / (memprobe_entry - none)
    ));
    table.push_str(&format!(
        "| memprobe `--return-probes uretprobes` (emulated placement; kernels before 6.13) | {memprobe_uretprobes:.0} | {:.0} | {:.1}x less |\n",
        memprobe_uretprobes - none,
        added_memleak / (memprobe_uretprobes - none)
    ));
    table.push_str(&format!(
        "| memprobe (default: emulated placement, uprobe sessions) | {memprobe_emulated:.0} | {added_emulated:.0} | {:.1}x less |\n",
        added_memleak / added_emulated
    ));
    table.push_str(&format!(
        "| memprobe `--track allocations` (no free probe, no return half) | {memprobe_allocations:.0} | {:.0} | {:.1}x less |\n",
        memprobe_allocations - none,
        added_memleak / (memprobe_allocations - none)
    ));
    table.push_str(&format!(
        "\n| the same loop on glibc's malloc (libc.so.6) | ns per pair | added ns | vs jemalloc's added ns |\n|---|---|---|---|\n\
         | no profiler | {glibc_none:.1} | - | - |\n\
         | memprobe (default) | {glibc_memprobe:.0} | {:.0} | {:.2}x |\n",
        glibc_memprobe - glibc_none,
        (glibc_memprobe - glibc_none) / added_emulated
    ));
    table.push_str(&format!(
        "\n| sampled calls' stacks, `--sample-interval 16KiB` (about 1 call in 170 sampled) | ns per pair |\n|---|---|\n\
         | `--unwind fp` (frame-pointer walk in the kernel) | {sampled_fp:.0} |\n\
         | `--unwind dwarf` (every sample with 16 KiB of stack copied for DWARF unwinding) | {sampled_dwarf:.0} ({:+.0}) |\n",
        sampled_dwarf - sampled_fp
    ));
    if let Some((cpu, rss)) = own {
        table.push_str(&format!(
            "\nmemprobe itself while the loop ran ({:.1} s): {:.2} s CPU ({:.1}% of one CPU), peak RSS {:.1} MiB.\n",
            wall.as_secs_f64(),
            cpu,
            100.0 * cpu / wall.as_secs_f64(),
            rss as f64 / 1024.0
        ));
    }
    table.push_str(&format!(
        "\n| redis-server 7 (libjemalloc), redis-benchmark SET/GET, 50 clients | requests/s |\n|---|---|\n\
         | without memprobe | {:.0} |\n| with memprobe attached | {:.0} ({:.1}% of the rate without) |\n",
        redis.0,
        redis.1,
        100.0 * redis.1 / redis.0
    ));
    if let Some((cpu, rss)) = redis.2 {
        table.push_str(&format!(
            "\nmemprobe itself during the redis run: {cpu:.2} s CPU, peak RSS {:.1} MiB.\n",
            rss as f64 / 1024.0
        ));
    }
    table.push_str(&offline);
    std::fs::write(out.join("results.md"), &table)?;
    println!("{table}");
    eprintln!("bench: results in {}", out.join("results.md").display());
    Ok(())
}

/// CPU seconds and peak RSS in KiB of a process.
type Usage = Option<(f64, u64)>;

/// Requests per second without and with memprobe, and memprobe's usage.
fn redis_bench(memprobe: &Path, profiles_dir: &str) -> Result<(f64, f64, Usage)> {
    let port = "6399";
    let mut server = Command::new("redis-server")
        .args([
            "--port",
            port,
            "--save",
            "",
            "--appendonly",
            "no",
            "--bind",
            "127.0.0.1",
        ])
        .stdout(Stdio::null())
        .spawn()
        .context("starting redis-server")?;
    std::thread::sleep(Duration::from_millis(500));
    let benchmark = || -> Result<f64> {
        let output = Command::new("redis-benchmark")
            .args([
                "-h",
                "127.0.0.1",
                "-p",
                port,
                "-t",
                "set,get",
                "-n",
                "200000",
                "-d",
                "256",
                "-q",
            ])
            .output()?;
        let text = String::from_utf8_lossy(&output.stdout);
        // "SET: 98765.43 requests per second, p50=..." per test.
        let rates: Vec<f64> = text
            .split(['\r', '\n'])
            .filter_map(|line| {
                line.split_once(": ")?
                    .1
                    .split_whitespace()
                    .next()?
                    .parse()
                    .ok()
            })
            .collect();
        if rates.is_empty() {
            bail!("no rate in redis-benchmark output: {text}");
        }
        Ok(rates.iter().sum::<f64>() / rates.len() as f64)
    };
    let result = (|| {
        let without = benchmark()?.max(benchmark()?);
        let pid = server.id().to_string();
        let mut probe = start_memprobe(memprobe, &["--pid", &pid, "-o", profiles_dir])?;
        let with = benchmark()?.max(benchmark()?);
        let own = usage(probe.id());
        stop(&mut probe);
        Ok((without, with, own))
    })();
    let _ = server.kill();
    let _ = server.wait();
    result
}

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
