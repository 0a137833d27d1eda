//! `cargo xtask demo`: profile the bundled workload and show its top sites.
use std::{
    io::{BufRead, BufReader},
    process::{Command, Stdio},
};

use anyhow::{Context, Result, bail};

use crate::{run_command, workspace_root};

fn build_workload() -> Result<std::path::PathBuf> {
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

    let mut workload = Command::new(&binary)
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

    let memprobe = root.join("target/release/memprobe");
    let status = Command::new(&memprobe)
        .args(["--pid", &pid, "--duration", duration, "--output"])
        .arg(&output)
        .status();
    let _ = workload.kill();
    let _ = workload.wait();
    if !status.context("running memprobe")?.success() {
        bail!("memprobe failed");
    }

    let heap = std::fs::read_dir(&output)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|e| e == "heap"))
        .context("memprobe wrote no .heap file")?;
    eprintln!("xtask: wrote {}", heap.display());
    for (title, flag) in [
        ("in use", "--inuse_space"),
        ("allocated during the run", "--alloc_space"),
    ] {
        println!("\nTop allocation sites, bytes {title} (jeprof --text {flag}):");
        let report = Command::new("jeprof")
            .args(["--text", flag, "--nodecount=8"])
            .arg(&binary)
            .arg(&heap)
            .stderr(Stdio::null())
            .output()
            .context("running jeprof")?;
        print!("{}", String::from_utf8_lossy(&report.stdout));
    }
    Ok(())
}
