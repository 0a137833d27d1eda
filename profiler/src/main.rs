//! The `memprobe` binary: parse flags, run a session, report. The work is in
//! the `profiler` library.
mod cli;

use std::{io::IsTerminal, process::ExitCode};

use anyhow::Context;
use clap::Parser;

fn main() -> ExitCode {
    // memprobe's copy that times probe hits at start exits in here.
    profiler::run::cost::calibrate::serve_as_target();
    let args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    if let Some(request) = cli::generate_request(&args) {
        let written = request.map_err(anyhow::Error::msg).and_then(|what| {
            cli::generate(what, &mut std::io::stdout().lock()).context("writing to stdout")
        });
        return match written {
            Ok(()) => ExitCode::SUCCESS,
            Err(error) => {
                eprintln!("memprobe: error: {error:#}");
                ExitCode::from(2)
            }
        };
    }
    let cli = match cli::Cli::try_parse_from(&args) {
        Ok(cli) => cli,
        Err(error) => {
            use clap::error::ErrorKind;
            if matches!(
                error.kind(),
                ErrorKind::DisplayHelp | ErrorKind::DisplayVersion
            ) {
                error.exit();
            }
            // One line, not clap's usage block: the message is what comes
            // before the first blank line or the usage.
            let rendered = error.to_string();
            let message: Vec<&str> = rendered
                .lines()
                .take_while(|l| !l.trim().is_empty() && !l.starts_with("Usage:"))
                .map(str::trim)
                .collect();
            let message = message.join(" ");
            let message = message.trim_start_matches("error: ");
            eprintln!("memprobe: error: {message}; see `memprobe --help`");
            return ExitCode::from(2);
        }
    };
    match run(cli) {
        Ok(code) => code,
        Err(error) => {
            eprintln!("memprobe: error: {error:#}");
            ExitCode::FAILURE
        }
    }
}

fn offline(command: cli::Offline) -> anyhow::Result<ExitCode> {
    use profiler::offline::{self, analysis::LeakOptions};
    let stdout = std::io::stdout().lock();
    match command {
        cli::Offline::Leaks {
            dir,
            pid,
            min_age,
            binaries,
        } => offline::leaks(
            &dir,
            pid,
            &LeakOptions { min_age },
            &binaries.into(),
            stdout,
        )?,
        cli::Offline::Diff { old, new, binaries } => {
            offline::diff_files(&old, &new, &binaries.into(), stdout)?
        }
        cli::Offline::Report {
            file,
            base,
            measure,
            top,
            binaries,
        } => offline::report(
            &file,
            base.as_deref(),
            measure.into(),
            &binaries.into(),
            top,
            stdout,
        )?,
        cli::Offline::Convert {
            file,
            to,
            output,
            binaries,
        } => {
            let out = std::fs::File::create(&output)
                .map(std::io::BufWriter::new)
                .with_context(|| format!("creating {}", output.display()))?;
            offline::convert(&file, to.into(), &binaries.into(), out)
                .with_context(|| format!("converting to {}", output.display()))?;
        }
        cli::Offline::Flamegraph {
            file,
            base,
            output,
            binaries,
        } => offline::flamegraph_file(&file, base.as_deref(), &binaries.into(), &output)?,
    }
    Ok(ExitCode::SUCCESS)
}

/// After a run with snapshots: the leak ranking of each process, briefly.
fn leak_summary(summary: &profiler::run::Summary) {
    for process in summary.processes.iter().filter(|p| p.heaps.len() >= 3) {
        let mut table = Vec::new();
        let options = profiler::offline::analysis::LeakOptions::default();
        if profiler::offline::leaks_of(&process.heaps, &options, &Default::default(), 3, &mut table)
            .is_ok()
        {
            eprintln!(
                "memprobe: pid {} over {} snapshots:",
                process.pid,
                process.heaps.len()
            );
            eprint!("{}", String::from_utf8_lossy(&table));
        }
    }
}

fn run(cli: cli::Cli) -> anyhow::Result<ExitCode> {
    if let Some(command) = cli.offline {
        return offline(command);
    }
    let progress = std::io::stderr().is_terminal();
    let options = cli.session_options(progress);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the runtime")?;
    let mut stderr = std::io::stderr();
    let summary = runtime.block_on(profiler::run::run(options, &mut stderr))?;
    for line in profiler::run::summary_lines(&summary) {
        eprintln!("{line}");
    }
    leak_summary(&summary);
    // Launch mode: the command's exit code is ours.
    Ok(match summary.exit_code {
        Some(code) => ExitCode::from(code.clamp(0, 255) as u8),
        None => ExitCode::SUCCESS,
    })
}
