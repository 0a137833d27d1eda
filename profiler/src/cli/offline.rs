//! The offline commands: reading, comparing and converting profiles
//! already written.
use std::{path::PathBuf, time::Duration};

use crate::cli::values::{BinariesArgs, ConvertTo, MeasureArg, parse_duration};

#[derive(Debug, clap::Subcommand)]
pub enum Offline {
    /// Rank the sites of a run's snapshots, likely leaks first.
    ///
    /// Likely leaks (growing, never shrinking) first, then working sets
    /// and bursts released later.
    #[command(after_help = "Example:\n  memprobe leaks /tmp/prof --min-age 10m")]
    Leaks {
        /// The --output folder of a run (memprobe.<pid>.<seq>.heap files).
        dir: PathBuf,
        /// Only this process's snapshots.
        #[arg(long)]
        pid: Option<u32>,
        /// Keep only sites whose oldest live allocation is older than DUR.
        #[arg(long, value_name = "DUR", value_parser = parse_duration)]
        min_age: Option<Duration>,
        #[command(flatten)]
        binaries: BinariesArgs,
    },
    /// An SVG flame graph of a .heap file's bytes in use.
    ///
    /// Of memprobe's .heap files or jemalloc's; with --base, a
    /// differential one: red grew, blue shrank.
    #[command(
        after_help = "Example:\n  memprobe flamegraph memprobe.1234.5.heap --base memprobe.1234.0.heap -o growth.svg"
    )]
    Flamegraph {
        file: PathBuf,
        /// An earlier profile of the same process to compare with.
        #[arg(long, value_name = "OLD")]
        base: Option<PathBuf>,
        /// Where to write the SVG.
        #[arg(long, short = 'o', value_name = "OUT.svg")]
        output: PathBuf,
        #[command(flatten)]
        binaries: BinariesArgs,
    },
    /// The top functions of a .heap file, like `jeprof --text`.
    ///
    /// Of memprobe's .heap files or jemalloc's own dumps, with the same
    /// numbers as jeprof, without addr2line.
    #[command(
        after_help = "Example:\n  memprobe report memprobe.1234.0.heap --measure alloc-space"
    )]
    Report {
        file: PathBuf,
        /// Subtract this earlier profile of the same process first, per
        /// identical stack (as jeprof's --base): what changed since.
        #[arg(long, value_name = "OLD")]
        base: Option<PathBuf>,
        /// What to rank by.
        #[arg(long, value_enum, default_value_t = MeasureArg::InuseSpace)]
        measure: MeasureArg,
        /// How many functions to list.
        #[arg(long, default_value_t = 30)]
        top: usize,
        #[command(flatten)]
        binaries: BinariesArgs,
    },
    /// Convert a .heap file to pprof (.pb.gz) or folded stacks.
    #[command(
        after_help = "Example:\n  memprobe convert memprobe.1234.0.heap --to pprof -o heap.pb.gz"
    )]
    Convert {
        file: PathBuf,
        /// pprof or folded.
        #[arg(long, value_enum)]
        to: ConvertTo,
        /// Where to write.
        #[arg(long, short = 'o', value_name = "OUT")]
        output: PathBuf,
        #[command(flatten)]
        binaries: BinariesArgs,
    },
    /// Growth in bytes in use per site from OLD to NEW.
    ///
    /// Two .heap files of one process, memprobe's or jemalloc's own.
    #[command(after_help = "Example:\n  memprobe diff memprobe.1234.0.heap memprobe.1234.5.heap")]
    Diff {
        old: PathBuf,
        new: PathBuf,
        #[command(flatten)]
        binaries: BinariesArgs,
    },
}
