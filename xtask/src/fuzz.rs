//! The test command's bounded run of the `.heap` reader's fuzz target.
//!
//! Unoptimised (`cargo fuzz --dev`) and with no sanitizer: the reader and
//! the analyses are safe Rust, where a fault is a panic libFuzzer catches
//! anyway, and instrumenting every crate, or optimising each in one
//! codegen unit as cargo-fuzz's release builds do, made the build take
//! minutes of the test command.
use std::{
    fs::File,
    os::unix::process::CommandExt,
    process::{Child, Command},
};

use anyhow::{Context, Result, bail};

use crate::{run_command, workspace_root};

/// How long the test command fuzzes the `.heap` reader.
pub const SECONDS: u32 = 30;

/// The fuzz target's build, under way in the background, in a process
/// group of its own: dropped unfinished (the test command failed before
/// its tests), the whole build is stopped.
pub struct Build(Option<Child>);

/// cargo-fuzz's flags, the same for the build and the run (any other
/// would build it again).
fn cargo_fuzz(task: &str) -> Command {
    let mut command = Command::new("rustup");
    command
        .args(["run", "nightly", "cargo", "fuzz", task, "heap_v2"])
        .args(["--dev", "--sanitizer", "none"])
        .current_dir(workspace_root());
    command
}

fn build_log() -> std::path::PathBuf {
    workspace_root().join("target/fuzz-build.log")
}

impl Build {
    /// Starts building the target at the lowest CPU priority, its output
    /// kept in a log: it takes what clippy and the release build leave
    /// idle (their single-crate tails, the downloads), some minutes of the
    /// test command otherwise.
    pub fn start() -> Result<Self> {
        std::fs::create_dir_all(workspace_root().join("target"))?;
        let log = File::create(build_log()).context("creating the fuzz build's log")?;
        let mut command = Command::new("nice");
        let build = cargo_fuzz("build");
        command
            .arg("-n19")
            .arg(build.get_program())
            .args(build.get_args())
            .current_dir(workspace_root())
            .process_group(0)
            .stdout(log.try_clone()?)
            .stderr(log);
        let child = command
            .spawn()
            .with_context(|| format!("starting {command:?}"))?;
        Ok(Self(Some(child)))
    }

    /// Waits for the build to end: before the tests, which time things.
    pub fn finish(mut self) -> Result<()> {
        eprintln!("xtask: the fuzz target's build (started alongside)");
        let mut child = self.0.take().context("the fuzz build was waited for")?;
        let status = child.wait()?;
        if !status.success() {
            let log = std::fs::read_to_string(build_log()).unwrap_or_default();
            eprintln!("{log}");
            bail!("building the fuzz target failed with {status}");
        }
        Ok(())
    }
}

impl Drop for Build {
    fn drop(&mut self) {
        if let Some(mut child) = self.0.take() {
            // SAFETY: a signal to the process group the build leads.
            unsafe { libc::kill(-(child.id() as i32), libc::SIGTERM) };
            let _ = child.wait();
        }
    }
}

/// Runs the built target for `seconds`, from the seed corpus.
pub fn run(seconds: u32) -> Result<()> {
    eprintln!("xtask: fuzzing the .heap reader for {seconds} s");
    run_command(cargo_fuzz("run").args([
        "--",
        &format!("-max_total_time={seconds}"),
        "-max_len=8192",
    ]))
}
