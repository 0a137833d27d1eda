//! `cargo xtask demo`: profile the bundled workload and show its top sites.
use std::{
    io::{BufRead, BufReader},
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use anyhow::{Context, Result, bail};

use crate::{run_command, workspace_root};

fn build_workload() -> Result<PathBuf> {
    let root = workspace_root();
    let out = root.join("target/demo");
    std::fs::create_dir_all(&out)?;
    let binary = out.join("workload");
    run_command(
        Command::new("cc")
            .args([
                "-O1",
                "-g",
                "-fno-omit-frame-pointer",
                "-fno-optimize-sibling-calls",
                "-o",
            ])
            .arg(&binary)
            .arg(root.join("xtask/demo/workload.c"))
            .arg("-ljemalloc"),
    )?;
    Ok(binary)
}

pub fn show(duration: &str) -> Result<()> {
    let root = workspace_root();
    let binary = build_workload()?;
    let output = root.join("target/demo/out");
    let _ = std::fs::remove_dir_all(&output);
    std::fs::create_dir_all(&output)?;
    let memprobe = root.join("target/release/memprobe");
    profile_workload(&binary, &memprobe, &output, duration)?;
    let heaps = snapshots(&output)?;
    let last = heaps.last().context("memprobe wrote no .heap file")?;
    eprintln!(
        "xtask: wrote {} snapshots in {}",
        heaps.len(),
        output.display()
    );
    print_reports(&memprobe, &output, last)?;
    println!(
        "\nThe same files work with jeprof (jeprof --text {} {}) and go tool pprof (*.pb.gz).",
        binary.display(),
        last.display()
    );
    Ok(())
}

/// Starts the workload and profiles it for `duration`, a snapshot a
/// second, into `output`; the workload is ended after.
fn profile_workload(binary: &Path, memprobe: &Path, output: &Path, duration: &str) -> Result<()> {
    let mut workload = Command::new(binary)
        .stdout(Stdio::piped())
        .spawn()
        .context("starting the demo workload")?;
    let mut ready = String::new();
    BufReader::new(workload.stdout.take().context("workload stdout")?).read_line(&mut ready)?;
    let pid = ready
        .trim()
        .strip_prefix("ready ")
        .context("the demo workload did not start")?
        .to_owned();
    eprintln!("xtask: demo workload running as pid {pid}; profiling it for {duration}");
    let status = Command::new(memprobe)
        .args(["--pid", &pid, "--duration", duration, "--interval", "1s"])
        .arg("--output")
        .arg(output)
        .status();
    let _ = workload.kill();
    let _ = workload.wait();
    if !status.context("running memprobe")?.success() {
        bail!("memprobe failed");
    }
    Ok(())
}

/// The `.heap` snapshots in `output` (not the `.sym.heap` copies), in
/// the order taken (memprobe.<pid>.<seq>.heap).
fn snapshots(output: &Path) -> Result<Vec<PathBuf>> {
    let mut heaps: Vec<PathBuf> = std::fs::read_dir(output)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            let name = p.to_string_lossy();
            name.ends_with(".heap") && !name.ends_with(".sym.heap")
        })
        .collect();
    heaps.sort_by_key(|p| {
        let name = p.file_name().unwrap_or_default().to_string_lossy();
        name.split('.').nth(2).and_then(|n| n.parse::<u64>().ok())
    });
    Ok(heaps)
}

/// The top sites of the last snapshot, in use and allocated, and the
/// leak ranking over all of them.
fn print_reports(memprobe: &Path, output: &Path, last: &Path) -> Result<()> {
    for (title, measure) in [
        ("in use", "inuse-space"),
        ("allocated during the run", "alloc-space"),
    ] {
        println!("\nTop allocation sites, bytes {title} (memprobe report --measure {measure}):");
        run_command(
            Command::new(memprobe)
                .args(["report", "--top", "6", "--measure", measure])
                .arg(last),
        )?;
    }
    println!("\nSites over the run's snapshots (memprobe leaks):");
    run_command(Command::new(memprobe).arg("leaks").arg(output))
}
