//! Command-line flags: raw values parsed by clap, then turned into the
//! library's validated options.
use std::{path::PathBuf, time::Duration};

use clap::Parser;
use profiler::{
    collector::CollectorOptions, kernel::KernelOptions, sampling::DEFAULT_SAMPLE_INTERVAL,
    session::SessionOptions,
};

const EXAMPLES: &str = "\
Examples:
  Profile a running process for ten minutes, write ./memprobe.1234.0.heap:
    sudo memprobe --pid 1234 --duration 10m

  Two processes until Ctrl-C, with jemalloc's sampling made finer (64 KiB):
    sudo memprobe --pid 1234 --pid 5678 --sample-interval 64KiB --output /tmp/prof

  Read the result with the jeprof you know:
    jeprof --text /path/to/binary memprobe.1234.0.heap

memprobe attaches uprobes to jemalloc's entry points (malloc, calloc, realloc,
free, posix_memalign, aligned_alloc, memalign, valloc, mallocx, rallocx,
xallocx, dallocx, sdallocx, C++ operator new/delete) in the given processes
only; other processes are not slowed. Allocations are sampled in the kernel by
bytes, like jemalloc's own profiler, and the written estimates are unbiased.
It prints one line on stderr once the probes are attached, and writes the
profiles when the duration ends, on Ctrl-C or SIGTERM, or when a process exits.
Needs root (CAP_BPF and CAP_PERFMON) and a kernel with uprobes and BTF.";

#[derive(Debug, Parser)]
#[command(
    name = "memprobe",
    version,
    about = "Heap profiles of running jemalloc processes, without a restart; jeprof reads them.",
    after_help = EXAMPLES
)]
pub struct Cli {
    /// Process to profile (repeat for several).
    #[arg(long = "pid", value_name = "PID", required = true, value_parser = clap::value_parser!(u32).range(1..))]
    pub pids: Vec<u32>,

    /// How long to profile, e.g. 30s, 10m, 1h30m. Default: until Ctrl-C,
    /// SIGTERM, or until every process exits.
    #[arg(long, value_name = "DUR", value_parser = parse_duration)]
    pub duration: Option<Duration>,

    /// Folder for the profiles, named memprobe.<pid>.<seq>.heap; existing
    /// files are never replaced.
    #[arg(long, short = 'o', value_name = "DIR", default_value = ".")]
    pub output: PathBuf,

    /// Mean bytes between samples, like jemalloc's 2^lg_prof_sample; accepts
    /// K/KiB, M/MiB suffixes. Smaller is more precise and costs more.
    #[arg(long, value_name = "BYTES", default_value_t = DEFAULT_SAMPLE_INTERVAL, value_parser = parse_size)]
    pub sample_interval: u64,

    /// Largest number of live sampled allocations kept per process; beyond
    /// it samples are dropped and counted in the output.
    #[arg(long, value_name = "N", default_value_t = CollectorOptions::default().max_live)]
    pub max_live_samples: usize,

    /// Say which entry points were attached where, and why the run stopped.
    #[arg(long, short = 'v')]
    pub verbose: bool,
}

impl Cli {
    pub fn session_options(&self, progress: bool) -> SessionOptions {
        let collector = CollectorOptions {
            sample_interval: self.sample_interval,
            max_live: self.max_live_samples,
            ..CollectorOptions::default()
        };
        let kernel = KernelOptions {
            sample_interval: self.sample_interval,
            ..KernelOptions::default()
        };
        SessionOptions {
            pids: self.pids.clone(),
            duration: self.duration,
            output_dir: self.output.clone(),
            kernel,
            collector,
            verbose: self.verbose,
            progress,
        }
    }
}

fn parse_duration(text: &str) -> Result<Duration, String> {
    let duration = humantime::parse_duration(text)
        .map_err(|e| format!("{e} (use a duration such as 30s, 10m or 1h)"))?;
    if duration.is_zero() {
        return Err("the duration must be longer than zero".into());
    }
    Ok(duration)
}

pub fn parse_size(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let number: u64 = number
        .parse()
        .map_err(|_| format!("'{text}' is not a size (use bytes such as 4096, 64KiB or 1MiB)"))?;
    let multiplier: u64 = match unit.trim() {
        "" | "B" => 1,
        "K" | "KB" | "KiB" | "k" => 1 << 10,
        "M" | "MB" | "MiB" => 1 << 20,
        "G" | "GB" | "GiB" => 1 << 30,
        other => return Err(format!("unknown size unit '{other}' (use KiB, MiB or GiB)")),
    };
    let size = number
        .checked_mul(multiplier)
        .ok_or_else(|| format!("'{text}' is too large"))?;
    if size == 0 {
        return Err("the size must be at least 1 byte".into());
    }
    Ok(size)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("64KiB"), Ok(65536));
        assert_eq!(parse_size("1M"), Ok(1 << 20));
        assert!(parse_size("0").is_err());
        assert!(parse_size("12 parsecs").is_err());
        assert!(parse_size("99999999999999999999").is_err());
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("10m"), Ok(Duration::from_secs(600)));
        assert!(parse_duration("0s").is_err());
        assert!(parse_duration("soon").is_err());
    }

    #[test]
    fn help_is_complete() {
        use clap::CommandFactory;
        let help = Cli::command().render_long_help().to_string();
        for flag in [
            "--pid",
            "--duration",
            "--output",
            "--sample-interval",
            "--verbose",
            "Examples:",
        ] {
            assert!(help.contains(flag), "{flag} missing from --help");
        }
    }
}
