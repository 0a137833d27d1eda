//! Command-line flags: raw values parsed by clap, then turned into the
//! library's validated options.
use std::{ffi::OsString, path::PathBuf, time::Duration};

mod offline;
mod options;
mod values;

pub use offline::Offline;
use values::{
    AllocatorArg, Every, Overhead, PlacementArg, ReturnProbesArg, SamplingArg, TrackArg, UnwindArg,
    parse_duration, parse_every, parse_format, parse_growth, parse_overhead, parse_size,
    parse_windows,
};

use clap::{ArgGroup, Parser};
use profiler::{
    collect::{CollectorOptions, sampling::DEFAULT_SAMPLE_INTERVAL},
    output::Format,
    run::{GrowthTrigger, WindowTiming},
};

const EXAMPLES: &str = "\
Examples:
  Profile a running process for ten minutes, write ./memprobe.1234.0.heap:
    sudo memprobe --pid 1234 --duration 10m

  Two processes until Ctrl-C, with jemalloc's sampling made finer (64 KiB):
    sudo memprobe --pid 1234 --pid 5678 --sample-interval 64KiB --output /tmp/prof

  Start a command with the probes in place, profile it until it exits, and
  exit with its exit code:
    sudo memprobe --output /tmp/prof -- ./server --port 8080

  A busy database whose probes never cost it more than 5% of its own CPU
  time for over 10 s (beyond that memprobe stops tracking its frees, then
  detaches from it):
    sudo memprobe --pid 1234 --max-overhead 5 --duration 30m

  Every malloc sampled where it is called (a trap per call), not on
  jemalloc's slow path:
    sudo memprobe --pid 1234 --sampling entry

  A long run: a snapshot every minute, and one whenever the heap grew by
  20 MiB within 10 minutes; `kill -USR1 <memprobe pid>` takes one at once:
    sudo memprobe --pid 1234 --interval 1m --dump-on-growth 20MiB/10m

  A snapshot whenever resident memory grows by 1 GiB in an hour, heap or not:
    sudo memprobe --pid 1234 --dump-on-growth rss:1GiB/1h

  Every process that uses jemalloc, including those started during the run:
    sudo memprobe --all --allocator jemalloc --duration 5m

  A JVM's native memory (glibc malloc: no LD_PRELOAD, no restart):
    sudo memprobe --pid $(pgrep -f SparkExecutor) --duration 5m

  As a host agent that Parca, Pyroscope (through Alloy) or Prometheus scrape:
    sudo memprobe --all --listen 127.0.0.1:6060 --keep 10
    go tool pprof -top 'http://127.0.0.1:6060/debug/pprof/heap?pid=1234'

  Read the result with the jeprof you know:
    jeprof --text /path/to/binary memprobe.1234.0.heap

  Rank a run's snapshots (likely leaks first), or diff two profiles:
    memprobe leaks /tmp/prof
    memprobe diff memprobe.1234.0.heap memprobe.1234.5.heap

memprobe attaches uprobes to the entry points (malloc, calloc, realloc, free,
posix_memalign, aligned_alloc, memalign, valloc, C++ operator new/delete, and
each allocator's own: mallocx..., mi_*, tc_*) of every allocator a process
maps: jemalloc, glibc's malloc, mimalloc and gperftools' tcmalloc, wherever
it lives: a shared library (linked or LD_PRELOADed), linked statically into
the executable or into a library (a JNI library in a JVM, mimalloc inside
libarrow), with any symbol prefix (je_, _rjem_ of tikv-jemallocator).
Libraries loaded later (dlopen) are found within a second. With --pid only the given processes are probed:
other processes mapping the same library run at full speed. --all probes
system-wide instead: every process that maps a probed jemalloc traps on every
call while memprobe runs, profiled or not. Processes in containers are reached
through /proc/PID; outputs are named by host pid.

Allocations are sampled in the kernel by bytes, like jemalloc's own profiler,
and the written estimates are unbiased. A process that runs jemalloc's own
profiler (MALLOC_CONF=prof:true, active) is sampled by it instead where the
build keeps its symbols: memprobe takes jemalloc's samples, and only frees
off jemalloc's fast path trap. memprobe prints one line on stderr
once the probes are attached, and writes the profiles when the duration ends,
on Ctrl-C or SIGTERM, or when a process exits. Needs root (CAP_BPF and
CAP_PERFMON) and a kernel with uprobes and BTF.";

#[derive(Debug, Parser)]
#[command(
    name = "memprobe",
    version,
    about = "Heap profiles of running processes (jemalloc, glibc malloc, mimalloc, tcmalloc), without a restart; jeprof and pprof read them.",
    after_help = EXAMPLES,
    args_conflicts_with_subcommands = true,
    subcommand_negates_reqs = true,
    group(ArgGroup::new("targets").required(true).args(["pids", "all", "command"]))
)]
pub struct Cli {
    /// Work on profiles already written instead of profiling.
    #[command(subcommand)]
    pub offline: Option<Offline>,

    /// Process to profile (repeat for several).
    #[arg(long = "pid", value_name = "PID", value_parser = clap::value_parser!(u32).range(1..))]
    pub pids: Vec<u32>,

    /// Profile every process that maps a probed allocator, now and started
    /// during the run, through system-wide probes (each such process pays
    /// for a trap on every call while memprobe runs; with glibc's malloc
    /// among the allocators, as by default, that is every process on the
    /// host: `--allocator jemalloc,mimalloc,tcmalloc` leaves it out).
    #[arg(long)]
    pub all: bool,

    /// A command to start and profile from its first allocation (after --).
    #[arg(last = true, value_name = "CMD")]
    pub command: Vec<OsString>,

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

    /// Write a full snapshot of every process this often (each complete on
    /// its own, like jemalloc's interval dumps), e.g. 1m; the last one is
    /// written at the end of the run.
    #[arg(long, value_name = "DUR", value_parser = parse_duration)]
    pub interval: Option<Duration>,

    /// Write a snapshot of a process whenever its estimated in-use heap grew
    /// by SIZE within WINDOW (default 10m), e.g. 20MiB/10m, or, with rss:,
    /// its resident memory (rss:256MiB/10m: mappings and fragmentation grow
    /// it too); at most once per --min-dump-gap. May be given twice, for
    /// both. Each snapshot says why it was taken.
    #[arg(long, value_name = "[rss:]SIZE[/WINDOW]", value_parser = parse_growth)]
    pub dump_on_growth: Vec<GrowthTrigger>,

    /// Least time between two growth-triggered snapshots of one process.
    #[arg(long, value_name = "DUR", default_value = "10s", value_parser = parse_duration)]
    pub min_dump_gap: Duration,

    /// What to write for each snapshot, comma-separated: heap (jeprof),
    /// pb.gz (pprof, symbolized), folded, svg (flame graph), sym.heap (jeprof
    /// with the symbols inside: needs no binary). Default: all of them.
    #[arg(long, value_name = "FORMATS", value_delimiter = ',', value_parser = parse_format)]
    pub format: Vec<Format>,

    /// What to track: `all` (allocations and frees: what is in use) or
    /// `allocations` (no free probes and no return probes: one trap per
    /// allocating call and none per free; profiles of what was allocated,
    /// with in use = allocated), for "what allocates most" at the least cost.
    #[arg(long, value_name = "WHAT", value_enum, default_value_t = TrackArg::All)]
    pub track: TrackArg,

    /// The most a process's probes may cost it, in percent of the CPU time
    /// it uses itself (estimated from its probe hits and the per-hit costs
    /// timed on this host, with an allowance for what the traps evict from
    /// a busy process's caches; probes costing under 1% of one CPU are
    /// always within it): a process above it for 10 s first has its
    /// sampling windows narrowed where they make a good part of the cost
    /// (and is judged again), else loses its free
    /// probes (its profile then counts allocations only, and says since
    /// when), and if still above it 10 s later is written out and
    /// detached; memprobe says so each time. `none` for no limit. Not with
    /// --all's system-wide probes (`--sampling entry`).
    #[arg(long, value_name = "PCT", default_value = "10", value_parser = parse_overhead)]
    pub max_overhead: Overhead,

    /// How jemalloc's malloc and operator new are sampled: `windows` (at
    /// every call while that costs the process under 1% of the CPU time it
    /// uses itself, or 0.1% of one CPU; once
    /// dearer, only in 100 ms windows opened at random times, for as small
    /// a share of the time as keeps them at that cost, each sample weighed
    /// by its thread's bytes from jemalloc's own counter; requests above
    /// 4 KiB always sampled on jemalloc's slow path, which they all reach)
    /// or `entry` (a trap per call). Windows need a recognised jemalloc
    /// 5.3 build and BTF; elsewhere entry is used. Each profile's
    /// `# malloc_sampling:` says which, and why. Frees are probed either
    /// way. A jemalloc 5.3 copy whose process runs jemalloc's own profiler
    /// (`prof:true`, active) and whose symbols are kept is sampled by that
    /// profiler instead: memprobe takes its samples, and only frees that
    /// leave jemalloc's fast path trap.
    #[arg(long, value_name = "HOW", value_enum, default_value_t = SamplingArg::Windows)]
    pub sampling: SamplingArg,

    /// With --sampling windows: `auto` (windows of 100 ms, as often as
    /// their cost allows), or a fixed LENGTH/EVERY: how long a window
    /// stays open and how often one opens on average, at random times.
    #[arg(long, value_name = "auto|LENGTH/EVERY", default_value = "auto", value_parser = parse_windows)]
    pub windows: WindowTiming,

    /// How often the cost of a probe hit is measured again during the run
    /// (memprobe times its probes on a copy of itself for some 0.5 s of one
    /// CPU, in the background): a virtual machine's trap costs drift by a
    /// fifth over minutes, and the time reported added and the
    /// `--max-overhead` budget price hits at the latest costs. `never` to
    /// measure once, at start.
    #[arg(long, value_name = "DUR", default_value = "2m", value_parser = parse_every)]
    pub recalibrate_every: Every,

    /// Which allocators to probe: jemalloc, glibc (libc.so.6's malloc),
    /// mimalloc, tcmalloc (gperftools), or all (each one a process maps; one
    /// that is never called costs nothing). Repeat or separate with commas.
    #[arg(
        long,
        value_name = "NAME",
        value_enum,
        value_delimiter = ',',
        default_value = "all"
    )]
    pub allocator: Vec<AllocatorArg>,

    /// Keep at most N snapshots per process on disk, removing the oldest
    /// (never the newest); counted in the summary.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub keep: Option<u64>,

    /// Keep at most SIZE of snapshot files per process (e.g. 500MiB),
    /// removing the oldest snapshots first, never the newest.
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    pub max_disk: Option<u64>,

    /// Serve, while the run goes on, GET /debug/pprof/heap?pid=PID[&seconds=N]
    /// (gzipped pprof, as Go serves heap profiles), /debug/pprof/ (the
    /// profiled processes; ?format=json) and /metrics (Prometheus) on this
    /// address only, e.g. 127.0.0.1:6060. Profiles show a program's
    /// structure: an address off loopback needs --tls-cert, --tls-key and
    /// --auth-token-file (or --tls-client-ca), or --listen-insecure.
    #[arg(long, value_name = "ADDR:PORT")]
    pub listen: Option<std::net::SocketAddr>,

    /// Serve --listen over TLS with this certificate chain (PEM); with
    /// --tls-key.
    #[arg(long, value_name = "FILE", requires_all = ["listen", "tls_key"])]
    pub tls_cert: Option<PathBuf>,

    /// The private key (PEM) of --tls-cert.
    #[arg(long, value_name = "FILE", requires_all = ["listen", "tls_cert"])]
    pub tls_key: Option<PathBuf>,

    /// Ask TLS clients for a certificate signed by one of these CAs (PEM);
    /// a client without one is refused in the handshake.
    #[arg(long, value_name = "FILE", requires = "tls_cert")]
    pub tls_client_ca: Option<PathBuf>,

    /// Ask every request for `Authorization: Bearer TOKEN`, the token held
    /// in this file (what Prometheus' `authorization: credentials_file`
    /// sends); others get a 401.
    #[arg(long, value_name = "FILE", requires = "listen")]
    pub auth_token_file: Option<PathBuf>,

    /// Serve --listen off loopback without TLS or authentication: anyone
    /// who reaches the port reads every profiled process's heap.
    #[arg(long, requires = "listen")]
    pub listen_insecure: bool,

    /// Look for debug files here first, by build ID (DIR/.build-id/xx/rest.debug)
    /// or by debuglink name (DIR/NAME): a stripped binary with jemalloc linked
    /// in is probed through its debug file's symbols, and frames are named
    /// from it. /usr/lib/debug inside each process's root is searched too.
    #[arg(long, value_name = "DIR")]
    pub debug_dir: Option<PathBuf>,

    /// Do not ask JVMs for a perf map (jcmd PID Compiler.perfmap) before
    /// each snapshot; JIT-compiled Java frames then stay unnamed.
    #[arg(long)]
    pub no_java_perfmap: bool,

    /// Largest number of live sampled allocations kept per process; beyond
    /// it samples are dropped and counted in the output.
    #[arg(long, value_name = "N", default_value_t = CollectorOptions::default().max_live)]
    pub max_live_samples: usize,

    /// Where probes go in each function: `emulated` (the first instruction
    /// the kernel emulates rather than single-steps, far cheaper for the
    /// target) or `entry` (each function's first instruction).
    #[arg(long, value_name = "WHERE", value_enum, default_value_t = PlacementArg::Emulated)]
    pub placement: PlacementArg,

    /// How allocation calls get their return half (where the new pointer is
    /// read): `sessions` (uprobe sessions, Linux 6.13+: only sampled calls
    /// trap at their return), `uretprobes` (every call traps twice, as on
    /// older kernels) or `auto` (sessions when the kernel has them).
    #[arg(long, value_name = "HOW", value_enum, default_value_t = ReturnProbesArg::Auto)]
    pub return_probes: ReturnProbesArg,

    /// How sampled stacks are walked: `dwarf` (the kernel copies 16 KiB of
    /// stack with each sample and memprobe unwinds it with the binaries'
    /// .eh_frame: right for code built without frame pointers, the default
    /// for optimized C, C++ and Rust), `auto` (dwarf, with frame pointers as
    /// a fast path: a process whose frame-pointer walks matched its DWARF
    /// unwinds 32 times in a row sends only one sample in 16 with a copy,
    /// until one does not match) or `fp` (frame pointers only: least work
    /// per sample, right only where all code keeps frame pointers).
    #[arg(long, value_name = "HOW", value_enum, default_value_t = UnwindArg::Auto)]
    pub unwind: UnwindArg,

    /// Say which entry points were attached where, and why the run stopped.
    #[arg(long, short = 'v')]
    pub verbose: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn help_is_complete() {
        use clap::CommandFactory;
        let help = Cli::command().render_long_help().to_string();
        for flag in [
            "--pid",
            "--all",
            "-- ./server",
            "--duration",
            "--output",
            "--sample-interval",
            "--interval",
            "--dump-on-growth",
            "USR1",
            "--verbose",
            "--allocator",
            "--max-overhead",
            "--sampling",
            "--recalibrate-every",
            "Examples:",
        ] {
            assert!(help.contains(flag), "{flag} missing from --help");
        }
    }
}
