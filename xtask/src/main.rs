//! `cargo xtask`: set-up, the demo and the test suite, each installing what
//! it needs first (idempotently), so that a fresh machine needs nothing else.
mod bench;
mod demo;
mod dist;
mod fuzz;
mod kernels;
mod pythons;
mod setup;
mod soak;
mod wheels;

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "cargo xtask", about = "memprobe's developer tasks")]
struct Cli {
    #[command(subcommand)]
    task: Task,
}

#[derive(Subcommand)]
enum Task {
    /// Install what building and testing need: Debian packages, the
    /// nightly's rust-src, bpf-linker built against the nightly's LLVM,
    /// qemu and the Debian kernels the kernels suite boots.
    Setup,
    /// Set up, build, profile a bundled jemalloc workload for a few seconds,
    /// write its profile and print the top allocation sites.
    Demo {
        /// How long to profile the demo workload.
        #[arg(long, default_value = "5s")]
        duration: String,
    },
    /// Set up, build, and measure what memprobe costs the profiled process,
    /// side by side with no profiler and with bcc memleak's probe placement;
    /// writes target/bench/results.md.
    Bench {
        /// Only this part of the bench.
        #[arg(long)]
        only: Option<bench::Part>,
    },
    /// Set up, then run every check: rustfmt, clippy (userspace and eBPF),
    /// unit tests, the integration tests that attach to real processes, and
    /// a bounded run of the fuzz target of the .heap reader.
    Test {
        /// Only run tests whose name contains this.
        filter: Option<String>,
    },
    /// Set up, build, and run the release binary's smoke suite on the
    /// host's kernel and on Debian's 6.1 and 6.12 kernels booted under qemu
    /// (part of `test`); writes target/vm/results.md.
    Kernels,
    /// Set up, build, and run memprobe as a host agent for a long run
    /// (--all, 4 KiB interval, --listen scraped, --keep) next to a busy
    /// allocator, reading its memory; fails if it keeps growing. Writes
    /// target/soak/results.md.
    Soak {
        /// How long.
        #[arg(long, default_value = "10m")]
        duration: String,
    },
    /// Build the release binary and a .deb of it (man page, shell
    /// completions, systemd unit): target/dist/memprobe_VERSION_amd64.deb.
    Dist,
}

fn main() -> Result<()> {
    match Cli::parse().task {
        Task::Setup => {
            setup::install()?;
            kernels::install()
        }
        Task::Demo { duration } => {
            setup::install()?;
            build_release()?;
            demo::show(&duration)
        }
        Task::Bench { only } => {
            setup::install()?;
            setup::install_bench_tools()?;
            build_release()?;
            bench::bench(only)
        }
        Task::Test { filter } => {
            setup::install()?;
            setup::install_cargo_fuzz()?;
            // A whole run fuzzes at its end: the target builds meanwhile.
            let fuzz_build = filter.is_none().then(fuzz::Build::start).transpose()?;
            kernels::install()?;
            test(filter.as_deref(), fuzz_build)
        }
        Task::Soak { duration } => {
            setup::install()?;
            build_release()?;
            let duration = humantime::parse_duration(&duration).context("--duration")?;
            soak::soak(duration, &release_binary())
        }
        Task::Dist => {
            setup::install()?;
            build_release()?;
            dist::deb().map(drop)
        }
        Task::Kernels => {
            setup::install()?;
            kernels::install()?;
            build_release()?;
            let (passed, failed) = kernels::run(&release_binary())?;
            println!("kernels: {passed} passed, {failed} failed");
            if failed > 0 {
                bail!("the smoke suite failed on {failed} kernels");
            }
            Ok(())
        }
    }
}

pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives in the workspace")
        .to_owned()
}

/// Runs a command in the workspace root, failing with its name if it fails.
pub fn run_command(command: &mut Command) -> Result<()> {
    command.current_dir(workspace_root());
    let status = command
        .status()
        .with_context(|| format!("starting {command:?}"))?;
    if !status.success() {
        bail!("{command:?} failed with {status}");
    }
    Ok(())
}

fn cargo() -> Command {
    Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
}

fn release_binary() -> PathBuf {
    workspace_root().join("target/release/memprobe")
}

fn build_release() -> Result<()> {
    eprintln!("xtask: building memprobe (release)");
    run_command(cargo().args(["build", "--release", "--package", "profiler"]))
}

/// rustfmt and clippy, warnings as errors, on the userspace crates and
/// on the eBPF one (its own target, with the nightly).
fn lint() -> Result<()> {
    eprintln!("xtask: rustfmt");
    run_command(cargo().args(["fmt", "--all", "--check"]))?;
    eprintln!("xtask: clippy (userspace)");
    // The release profile, as the build and the tests after it: their
    // build scripts (the eBPF object's among them) and proc macros are
    // built once.
    run_command(
        cargo()
            .args(["clippy", "--release", "--all-targets", "--"])
            .args(DENY_WARNINGS),
    )?;
    eprintln!("xtask: clippy (eBPF)");
    run_command(
        Command::new("rustup")
            .args([
                "run",
                "nightly",
                "cargo",
                "clippy",
                "--package",
                "profiler-ebpf",
            ])
            .args(["--target", "bpfel-unknown-none", "-Z", "build-std=core"])
            .args(["--release", "--"])
            .args(DENY_WARNINGS),
    )
}

const DENY_WARNINGS: [&str; 2] = ["-D", "warnings"];

/// `cargo xtask test`: the lints, the build and its package, then the
/// tests (with `filter`, those alone; else the kernels and fuzzers too).
fn test(filter: Option<&str>, fuzz_build: Option<fuzz::Build>) -> Result<()> {
    lint()?;
    build_release()?;
    eprintln!("xtask: the .deb");
    let deb = dist::deb()?;
    eprintln!("xtask: Pythons of later Debian suites");
    let pythons = pythons::unpack_all()?;
    eprintln!("xtask: wheels the Python tests load");
    let wheels = wheels::download_all()?;
    if let Some(build) = fuzz_build {
        build.finish()?;
    }
    eprintln!("xtask: tests");
    let binary = release_binary();
    let mut command = cargo();
    command
        .args([
            "test",
            "--release",
            "--workspace",
            "--exclude",
            "profiler-ebpf",
        ])
        .env("MEMPROBE_BIN", &binary)
        .env("MEMPROBE_DEB", &deb)
        .envs(pythons)
        .env(wheels.0, &wheels.1);
    if let Some(filter) = filter {
        command.arg(filter);
    }
    let (mut passed, mut failed) = run_counting_tests(&mut command)?;
    if filter.is_none() {
        eprintln!("xtask: kernels");
        // Each kernel counts as one test: its table row says which check failed.
        let (kernels_passed, kernels_failed) = kernels::run(&binary)?;
        passed += kernels_passed;
        failed += kernels_failed;
        fuzz::run(fuzz::SECONDS)?;
    }
    // One closing line over every test binary of the run.
    println!("tests: {passed} passed, {failed} failed");
    if failed > 0 {
        bail!("{failed} tests failed");
    }
    Ok(())
}

/// Runs `cargo test`, passing its output through, and adds up its
/// "test result: ok. N passed; M failed" lines.
fn run_counting_tests(command: &mut Command) -> Result<(u64, u64)> {
    use std::io::{BufRead, BufReader};
    command
        .current_dir(workspace_root())
        .stdout(std::process::Stdio::piped());
    let mut child = command
        .spawn()
        .with_context(|| format!("starting {command:?}"))?;
    let (mut passed, mut failed) = (0, 0);
    for line in BufReader::new(child.stdout.take().context("stdout")?).lines() {
        let line = line?;
        println!("{line}");
        if let Some(result) = line.strip_prefix("test result: ") {
            let number = |word: &str| -> u64 {
                result
                    .split(['.', ';'])
                    .find_map(|part| part.trim().strip_suffix(word)?.trim().parse().ok())
                    .unwrap_or(0)
            };
            passed += number("passed");
            failed += number("failed");
        }
    }
    let status = child.wait()?;
    if !status.success() {
        println!("tests: {passed} passed, {failed} failed");
        bail!("{command:?} failed with {status}");
    }
    Ok((passed, failed))
}
