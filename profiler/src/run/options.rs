//! What a run is told to do.
use std::{ffi::OsString, path::PathBuf, time::Duration};

use crate::{
    collect::{CollectorOptions, sampling::DEFAULT_SAMPLE_INTERVAL},
    kernel::KernelOptions,
    output::Format,
};

/// Where jemalloc's `malloc` and `operator new` are sampled.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Sampling {
    /// At their entry: one trap per call.
    Entry,
    /// At their entry while that is cheap, else only in short windows at
    /// random times, weighed by jemalloc's per-thread byte counter; every
    /// request no thread cache holds where the slow path takes it. For jemalloc copies
    /// whose build is recognised; the others are sampled at entry.
    #[default]
    Windows,
}

/// Which processes to profile.
#[derive(Clone, Debug)]
pub enum Targets {
    /// These running processes.
    Pids(Vec<u32>),
    /// Every process that maps jemalloc, now and started during the run,
    /// through system-wide probes.
    All,
    /// Start this command with the probes in place; exit with its code.
    Launch(Vec<OsString>),
}

/// Everything a run needs to know.
#[derive(Clone, Debug)]
pub struct SessionOptions {
    pub targets: Targets,
    /// Stop after this long; `None` runs until Ctrl-C, SIGTERM or the
    /// processes exit.
    pub duration: Option<Duration>,
    /// Default: the current directory.
    pub output_dir: PathBuf,
    /// Mean bytes between samples, for the kernel's countdown and the
    /// estimates' weights alike. Default: 512 KiB, as jemalloc.
    pub sample_interval: u64,
    pub kernel: KernelOptions,
    pub collector: CollectorOptions,
    /// Say what was attached where.
    pub verbose: bool,
    /// Redraw a status line once a second (on a terminal).
    pub progress: bool,
    /// How often to look for newly loaded libraries and new processes.
    /// Default: one second.
    pub rescan_interval: Duration,
    /// Write a full snapshot of every process this often. Default: none.
    pub snapshot_interval: Option<Duration>,
    /// Write a snapshot when a process's estimated in-use heap grew this much.
    pub dump_on_growth: Vec<GrowthTrigger>,
    /// Least time between two growth-triggered snapshots of one process.
    /// Default: 10 s.
    pub min_dump_gap: Duration,
    /// Under `--track allocations`: how long a process's frees are followed
    /// after its resident memory grew (an `rss:` growth trigger), the delta
    /// over that span written as a snapshot. Zero: not at all. Default: 1 min.
    pub follow_on_growth: Duration,
    /// The files each snapshot is written as. Default: all formats.
    pub formats: Vec<Format>,
    /// Snapshots kept per process on disk (`--keep`, `--max-disk`).
    /// Default: all.
    pub retention: crate::run::Retention,
    /// Serve `/debug/pprof/` and `/metrics` here while the run goes on.
    /// Default: nowhere.
    pub listen: Option<std::net::SocketAddr>,
    /// `--sampling windows`: how long a window lasts and how often one
    /// opens. Default: 100 ms, as often as their cost allows.
    pub windows: crate::run::WindowTiming,
    /// Who may read the endpoints: TLS, a bearer token, client
    /// certificates. Default: none of them (then `listen` must be on
    /// loopback).
    pub access: crate::serve::AccessOptions,
    /// A folder of debug files to look in first (by build ID or debuglink
    /// name), for stripped binaries: to find their allocator's entry points
    /// and to name their frames. Default: none (`/usr/lib/debug` in each
    /// process's root is always searched).
    pub debug_dir: Option<PathBuf>,
    /// `--max-overhead`: the share of the CPU time a process uses itself
    /// (0.1 = 10%) its probes may cost it for 10 s before they are made
    /// cheaper; `None` for no budget. Default: 10%.
    pub max_overhead: Option<f64>,
    /// `--sampling`. Default: in windows where it can be.
    pub sampling: Sampling,
    /// `--recalibrate-every`: the longest gap between measurements of the
    /// per-hit costs while the run goes on (the first come 1 s, 2 s, 4 s...
    /// apart; hits are priced at the mean of the last few, a VM's trap
    /// costs changing by up to 2x from second to second); `None` for only
    /// at start. Default: two minutes.
    pub recalibrate_every: Option<std::time::Duration>,
    /// The allocators to probe (`--allocator`). Default: all of them.
    pub allocators: Vec<crate::discover::AllocatorKind>,
    /// Ask JVMs for a perf map (`jcmd PID Compiler.perfmap`) before each
    /// snapshot, to name JIT-compiled Java frames. Default: yes.
    pub java_perfmap: bool,
}

impl Targets {
    /// The launched command's program, for messages.
    pub fn command_program(&self) -> std::path::PathBuf {
        match self {
            Targets::Launch(command) => command.first().map(Into::into).unwrap_or_default(),
            _ => std::path::PathBuf::new(),
        }
    }
}

/// `--dump-on-growth [rss:]SIZE[/WINDOW]`: growth of `size` bytes within
/// `window`, of the heap in use or of resident memory.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GrowthTrigger {
    pub of: Growing,
    pub size: u64,
    pub window: Duration,
}

/// What a growth trigger watches.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Growing {
    /// The estimated heap in use.
    #[default]
    Heap,
    /// The process's resident memory (RSS), as the kernel counts it.
    Resident,
}

impl Default for SessionOptions {
    fn default() -> Self {
        Self {
            targets: Targets::Pids(Vec::new()),
            duration: None,
            output_dir: PathBuf::from("."),
            sample_interval: DEFAULT_SAMPLE_INTERVAL,
            kernel: KernelOptions::default(),
            collector: CollectorOptions::default(),
            verbose: false,
            progress: false,
            rescan_interval: Duration::from_secs(1),
            snapshot_interval: None,
            dump_on_growth: Vec::new(),
            min_dump_gap: Duration::from_secs(10),
            follow_on_growth: Duration::from_secs(60),
            formats: Format::ALL.to_vec(),
            java_perfmap: true,
            max_overhead: Some(0.10),
            sampling: Sampling::Windows,
            recalibrate_every: Some(std::time::Duration::from_secs(120)),
            allocators: crate::discover::AllocatorKind::ALL.to_vec(),
            debug_dir: None,
            listen: None,
            windows: crate::run::WindowTiming::default(),
            access: crate::serve::AccessOptions::default(),
            retention: crate::run::Retention::default(),
        }
    }
}
