//! The flags' values: clap's value types, what they turn into in the
//! library, and the parsers of sizes, durations and growth triggers.
use std::{path::PathBuf, time::Duration};

use clap::ValueEnum;
use profiler::{
    AllocatorKind,
    offline::{Binaries, report::Measure},
    output::Format,
    run::{Growing, GrowthTrigger, WindowTiming},
};

/// Where offline commands find the profiled binaries and their debug files.
#[derive(Debug, clap::Args)]
pub struct BinariesArgs {
    /// Look for the binaries under this folder (as jeprof's --lib_prefix).
    #[arg(long, value_name = "DIR")]
    lib_prefix: Option<PathBuf>,
    /// Look for debug files here first, by build ID (DIR/.build-id/xx/rest.debug)
    /// or by the binary's debuglink name (DIR/NAME), to name frames of stripped
    /// binaries; /usr/lib/debug is searched too.
    #[arg(long, value_name = "DIR")]
    debug_dir: Option<PathBuf>,
}

impl From<BinariesArgs> for Binaries {
    fn from(args: BinariesArgs) -> Self {
        Binaries {
            lib_prefix: args.lib_prefix,
            debug_dir: args.debug_dir,
        }
    }
}

/// `--allocator`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum AllocatorArg {
    Jemalloc,
    Glibc,
    Mimalloc,
    Tcmalloc,
    All,
}

impl AllocatorArg {
    /// The allocators the flags name, each once.
    pub fn kinds(args: &[AllocatorArg]) -> Vec<AllocatorKind> {
        AllocatorKind::ALL
            .into_iter()
            .filter(|kind| {
                args.iter().any(|arg| match arg {
                    AllocatorArg::All => true,
                    AllocatorArg::Jemalloc => *kind == AllocatorKind::Jemalloc,
                    AllocatorArg::Glibc => *kind == AllocatorKind::Glibc,
                    AllocatorArg::Mimalloc => *kind == AllocatorKind::Mimalloc,
                    AllocatorArg::Tcmalloc => *kind == AllocatorKind::Tcmalloc,
                })
            })
            .collect()
    }
}

/// A flag's value that does not parse, and what to give instead.
#[derive(Debug, PartialEq, thiserror::Error)]
pub enum ValueError {
    #[error("{0:?} is not a percentage (e.g. 10) or none")]
    NotPercentage(String),
    #[error("{0:?}: the budget must be above 0%")]
    NoBudget(String),
    #[error("{0} (use a duration such as 30s, 10m or 1h)")]
    NotDuration(#[from] humantime::DurationError),
    #[error("the duration must be longer than zero")]
    ZeroDuration,
    #[error("unknown format '{0}' (use heap, pb.gz, folded, svg or sym.heap)")]
    UnknownFormat(String),
    #[error(
        "give auto, what windows may cost such as 0.3%, or a window's length and how often \
         one opens, such as 100ms/4s"
    )]
    NotWindows,
    #[error("what windows may cost must be above 0% and at most 100%, such as 0.3%")]
    WindowsCost,
    #[error(
        "a window ({}) must be shorter than the time between two ({})",
        humantime::format_duration(*.length),
        humantime::format_duration(*.every)
    )]
    WindowTooLong { length: Duration, every: Duration },
    #[error("'{0}' is not a size (use bytes such as 4096, 64KiB or 1MiB)")]
    NotSize(String),
    #[error("unknown size unit '{0}' (use KiB, MiB or GiB)")]
    UnknownUnit(String),
    #[error("'{0}' is too large")]
    TooLarge(String),
    #[error("the size must be at least 1 byte")]
    ZeroSize,
    #[error("the ring buffer must be a power of two from 4KiB to 1GiB, such as 32MiB")]
    RingBuffer,
}

/// `--max-overhead`: a share of one CPU, or none.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Overhead(pub Option<f64>);

/// `--max-overhead PCT`: a percentage above 0, or `none`.
pub fn parse_overhead(text: &str) -> Result<Overhead, ValueError> {
    if text == "none" {
        return Ok(Overhead(None));
    }
    let percent: f64 = text
        .trim_end_matches('%')
        .parse()
        .map_err(|_| ValueError::NotPercentage(text.into()))?;
    if !(percent > 0.0 && percent.is_finite()) {
        return Err(ValueError::NoBudget(text.into()));
    }
    Ok(Overhead(Some(percent / 100.0)))
}

/// `--sampling`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum SamplingArg {
    Windows,
    Entry,
}

/// `--placement`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum PlacementArg {
    Emulated,
    Entry,
}

/// `--return-probes`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ReturnProbesArg {
    Auto,
    Sessions,
    Uretprobes,
}

/// `--track`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum TrackArg {
    All,
    Allocations,
}

/// `--unwind`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum UnwindArg {
    Auto,
    Dwarf,
    Fp,
}

/// `report --measure`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum MeasureArg {
    InuseSpace,
    InuseObjects,
    AllocSpace,
    AllocObjects,
}

impl From<MeasureArg> for Measure {
    fn from(arg: MeasureArg) -> Self {
        match arg {
            MeasureArg::InuseSpace => Measure::InuseSpace,
            MeasureArg::InuseObjects => Measure::InuseObjects,
            MeasureArg::AllocSpace => Measure::AllocSpace,
            MeasureArg::AllocObjects => Measure::AllocObjects,
        }
    }
}

/// `convert --to`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ConvertTo {
    Pprof,
    Folded,
}

impl From<ConvertTo> for Format {
    fn from(to: ConvertTo) -> Self {
        match to {
            ConvertTo::Pprof => Format::Pprof,
            ConvertTo::Folded => Format::Folded,
        }
    }
}

pub fn parse_duration(text: &str) -> Result<Duration, ValueError> {
    let duration = humantime::parse_duration(text)?;
    if duration.is_zero() {
        return Err(ValueError::ZeroDuration);
    }
    Ok(duration)
}

/// `--recalibrate-every`: a duration, or never.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Every(pub Option<Duration>);

pub fn parse_every(text: &str) -> Result<Every, ValueError> {
    if text == "never" {
        return Ok(Every(None));
    }
    parse_duration(text).map(|every| Every(Some(every)))
}

pub fn parse_format(text: &str) -> Result<Format, ValueError> {
    Format::from_extension(text.trim()).ok_or_else(|| ValueError::UnknownFormat(text.into()))
}

/// `--windows auto|COST%|LENGTH/EVERY`: adaptive (at what share of the
/// process's own CPU time), or a window's length and the mean time between
/// two, the first under the second.
pub fn parse_windows(text: &str) -> Result<WindowTiming, ValueError> {
    if text == "auto" {
        return Ok(WindowTiming::default());
    }
    if let Some(percent) = text.strip_suffix('%') {
        let percent: f64 = percent
            .trim()
            .parse()
            .map_err(|_| ValueError::WindowsCost)?;
        if !(percent > 0.0 && percent <= 100.0) {
            return Err(ValueError::WindowsCost);
        }
        return Ok(WindowTiming {
            cost: percent / 100.0,
            ..WindowTiming::default()
        });
    }
    let (length, every) = text.split_once('/').ok_or(ValueError::NotWindows)?;
    let (length, every) = (parse_duration(length)?, parse_duration(every)?);
    if length >= every {
        return Err(ValueError::WindowTooLong { length, every });
    }
    Ok(WindowTiming {
        length,
        every: Some(every),
        ..WindowTiming::default()
    })
}

pub fn parse_growth(text: &str) -> Result<GrowthTrigger, ValueError> {
    let (of, text) = match text.strip_prefix("rss:") {
        Some(rest) => (Growing::Resident, rest),
        None => (Growing::Heap, text.strip_prefix("heap:").unwrap_or(text)),
    };
    let (size, window) = match text.split_once('/') {
        Some((size, window)) => (size, parse_duration(window)?),
        None => (text, Duration::from_secs(600)),
    };
    Ok(GrowthTrigger {
        of,
        size: parse_size(size)?,
        window,
    })
}

pub fn parse_size(text: &str) -> Result<u64, ValueError> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let number: u64 = number
        .parse()
        .map_err(|_| ValueError::NotSize(text.into()))?;
    let multiplier: u64 = match unit.trim() {
        "" | "B" => 1,
        "K" | "KB" | "KiB" | "k" => 1 << 10,
        "M" | "MB" | "MiB" => 1 << 20,
        "G" | "GB" | "GiB" => 1 << 30,
        other => return Err(ValueError::UnknownUnit(other.into())),
    };
    let size = number
        .checked_mul(multiplier)
        .ok_or_else(|| ValueError::TooLarge(text.into()))?;
    if size == 0 {
        return Err(ValueError::ZeroSize);
    }
    Ok(size)
}

/// `--ring-buffer`: what the kernel takes, a power of two of pages (a
/// sample's stack copy takes 16 KiB, and fewer are sent in smaller ones).
pub fn parse_ring_buffer(text: &str) -> Result<u32, ValueError> {
    let size = parse_size(text)?;
    if !size.is_power_of_two() || !(4 << 10..=1 << 30).contains(&size) {
        return Err(ValueError::RingBuffer);
    }
    Ok(size as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ring_buffers_are_powers_of_two_the_kernel_takes() {
        assert_eq!(parse_ring_buffer("32MiB"), Ok(32 << 20));
        assert_eq!(parse_ring_buffer("4KiB"), Ok(4 << 10));
        for refused in ["3MiB", "2KiB", "2GiB"] {
            assert_eq!(parse_ring_buffer(refused), Err(ValueError::RingBuffer));
        }
    }

    #[test]
    fn window_timings() {
        let timing = parse_windows("50ms/2s").unwrap();
        assert_eq!(timing.length, Duration::from_millis(50));
        assert_eq!(timing.every, Some(Duration::from_secs(2)));
        assert_eq!(parse_windows("auto").unwrap(), WindowTiming::default());
        let cheaper = parse_windows("0.3%").unwrap();
        assert_eq!((cheaper.every, cheaper.cost), (None, 0.003));
        let error = |text| parse_windows(text).unwrap_err().to_string();
        assert!(error("2s/1s").contains("shorter"));
        assert!(error("100ms").contains("100ms/4s"));
        assert!(error("0%").contains("above 0%"));
        assert!(error("abc%").contains("such as 0.3%"));
    }

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
    fn growth_triggers() {
        assert_eq!(
            parse_growth("20MiB/10m"),
            Ok(GrowthTrigger {
                of: Growing::Heap,
                size: 20 << 20,
                window: Duration::from_secs(600)
            })
        );
        assert_eq!(parse_growth("rss:1GiB/1h").unwrap().of, Growing::Resident);
        assert_eq!(parse_growth("rss:1GiB/1h").unwrap().size, 1 << 30);
        assert_eq!(parse_growth("1M").unwrap().window, Duration::from_secs(600));
        assert!(parse_growth("20MiB/never").is_err());
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("10m"), Ok(Duration::from_secs(600)));
        assert!(parse_duration("0s").is_err());
        assert!(parse_duration("soon").is_err());
    }

    #[test]
    fn intervals_or_never() {
        assert_eq!(parse_every("2m"), Ok(Every(Some(Duration::from_secs(120)))));
        assert_eq!(parse_every("never"), Ok(Every(None)));
        assert!(parse_every("0s").is_err());
        assert!(parse_every("sometimes").is_err());
    }
}
