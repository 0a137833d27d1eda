//! Command-line flags: raw values parsed by clap, then turned into the
//! library's validated options.
use std::{ffi::OsString, path::PathBuf, time::Duration};

mod generate;
mod help;
mod offline;
mod options;
mod values;

pub use generate::{generate, generate_request};
pub use offline::Offline;
use values::{
    AllocatorArg, Every, Overhead, PlacementArg, ReturnProbesArg, SamplingArg, TrackArg, UnwindArg,
    parse_duration, parse_every, parse_format, parse_growth, parse_overhead, parse_ring_buffer,
    parse_size, parse_windows,
};

use clap::{ArgGroup, Parser};
use profiler::{
    collect::{CollectorOptions, sampling::DEFAULT_SAMPLE_INTERVAL},
    output::Format,
    run::{GrowthTrigger, WindowTiming},
};

#[derive(Debug, Parser)]
#[command(
    name = "memprobe",
    version,
    about = "Heap profiles of running processes, without a restart.",
    long_about = "Heap profiles of running processes (jemalloc, glibc malloc, mimalloc, \
                  tcmalloc), without a restart; jeprof and pprof read them.",
    disable_help_subcommand = true,
    after_help = help::SHORT_EXAMPLES,
    after_long_help = help::EXAMPLES,
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

    /// Every process with a probed allocator, now and later.
    ///
    /// Each is probed on its own, as with --pid; new ones are looked for
    /// once a second. With --sampling entry the probes are system-wide
    /// instead: every process that maps a probed allocator then traps on
    /// every call while memprobe runs. With glibc's malloc among the
    /// allocators, as by default, that is every process on the host:
    /// `--allocator jemalloc` is what an agent wants.
    #[arg(long)]
    pub all: bool,

    /// A command to start and profile from its first allocation (after --).
    #[arg(last = true, value_name = "CMD")]
    pub command: Vec<OsString>,

    /// How long to profile, e.g. 30s, 10m, 1h30m.
    ///
    /// Default: until Ctrl-C, SIGTERM, or until every process exits.
    #[arg(long, value_name = "DUR", value_parser = parse_duration)]
    pub duration: Option<Duration>,

    /// Folder for the profiles.
    ///
    /// Named memprobe.PID.SEQ.heap and so on; existing files are never
    /// replaced.
    #[arg(long, short = 'o', value_name = "DIR", default_value = ".")]
    pub output: PathBuf,

    /// Say which entry points were attached where, and why the run stopped.
    #[arg(long, short = 'v', hide_short_help = true)]
    pub verbose: bool,

    /// Mean bytes between samples.
    ///
    /// Accepts K/KiB, M/MiB suffixes. Like jemalloc's 2^lg_prof_sample. Smaller is more precise and costs
    /// more.
    #[arg(long, value_name = "BYTES", default_value_t = DEFAULT_SAMPLE_INTERVAL,
          value_parser = parse_size, help_heading = help::SAMPLING)]
    pub sample_interval: u64,

    /// What to track: all, allocations.
    ///
    /// `all`: what is in use. `allocations`: what allocates most; it probes
    /// no free and no return: no trap per free, jemalloc's malloc in
    /// windows and a trap only for the requests no thread cache holds
    /// (other allocators: a trap per allocating call), and profiles of what was
    /// allocated, with in use = allocated, at the least cost.
    #[arg(long, value_name = "WHAT", value_enum, default_value_t = TrackArg::All,
          help_heading = help::SAMPLING, hide_possible_values = true)]
    pub track: TrackArg,

    /// Budget in % of the process's CPU.
    ///
    /// The most a process's probes may cost it, in percent of the CPU time
    /// it uses itself. Estimated from its probe hits at the per-hit costs
    /// timed on this host and its samples as the kernel timed each, with
    /// an allowance for what the traps evict from a busy process's
    /// caches; probes costing under 1% of one CPU are always
    /// within it. A process above it for 10 s first has its sampling
    /// windows narrowed where they make a good part of the cost (and is
    /// judged again), else loses its free probes (its profile then counts
    /// allocations only, and says since when), and if still above it 10 s
    /// later is written out and its allocators' probes detached: it is
    /// still followed to the end (its memory account and mappings in each
    /// snapshot, its heap as it was); memprobe says so each time.
    /// `none` for no limit. Not with --all's system-wide probes
    /// (`--sampling entry`).
    #[arg(long, value_name = "PCT", default_value = "10", value_parser = parse_overhead,
          help_heading = help::SAMPLING)]
    pub max_overhead: Overhead,

    /// Allocators to probe: jemalloc, glibc, mimalloc, tcmalloc, or all.
    ///
    /// glibc is libc.so.6's malloc, tcmalloc gperftools'; `all` probes each
    /// one a process maps (one that is never called costs nothing). Repeat
    /// or separate with commas.
    #[arg(
        long,
        value_name = "NAME",
        value_enum,
        value_delimiter = ',',
        default_value = "all",
        help_heading = help::SAMPLING,
        hide_short_help = true
    )]
    pub allocator: Vec<AllocatorArg>,

    /// A snapshot of every process this often.
    ///
    /// E.g. 1m. Each is complete on its own, like jemalloc's interval
    /// dumps; the last one is written at the end of the run. `kill -USR1` memprobe to
    /// take one at once.
    #[arg(long, value_name = "DUR", value_parser = parse_duration, help_heading = help::SNAPSHOTS)]
    pub interval: Option<Duration>,

    /// Snapshot when the heap grew SIZE in WINDOW.
    ///
    /// E.g. 20MiB/10m (WINDOW defaults to 10m), or, with rss: before SIZE,
    /// resident memory (rss:256MiB/10m: mappings and fragmentation grow it
    /// too); at most once per --min-dump-gap. May be given twice, for both.
    /// Each snapshot says why it was taken.
    #[arg(long, value_name = "SIZE/WINDOW", value_parser = parse_growth,
          help_heading = help::SNAPSHOTS)]
    pub dump_on_growth: Vec<GrowthTrigger>,

    /// Least time between two growth-triggered snapshots of one process.
    #[arg(long, value_name = "DUR", default_value = "10s", value_parser = parse_duration,
          help_heading = help::SNAPSHOTS, hide_short_help = true)]
    pub min_dump_gap: Duration,

    /// Under --track allocations, follow frees for DUR after RSS growth.
    ///
    /// When an rss: --dump-on-growth trigger fires, that process's frees
    /// are followed for DUR, then what it allocated in that span and still
    /// holds is written as a snapshot (a delta: what grew). 0 turns it off.
    #[arg(long, value_name = "DUR", default_value = "1m", value_parser = parse_duration,
          help_heading = help::SNAPSHOTS, hide_short_help = true)]
    pub follow_on_growth: Duration,

    /// Formats to write (default: all five).
    ///
    /// Comma-separated, of: heap (jeprof), pb.gz (pprof, symbolized), folded,
    /// svg (flame graph), sym.heap (jeprof with the symbols inside: needs
    /// no binary).
    #[arg(long, value_name = "FORMATS", value_delimiter = ',', value_parser = parse_format,
          help_heading = help::SNAPSHOTS)]
    pub format: Vec<Format>,

    /// Keep at most N snapshots per process on disk, the oldest removed.
    ///
    /// Never the newest; counted in the summary.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..),
          help_heading = help::SNAPSHOTS, hide_short_help = true)]
    pub keep: Option<u64>,

    /// Keep at most SIZE of snapshot files per process (e.g. 500MiB).
    ///
    /// The oldest snapshots are removed first, never the newest.
    #[arg(long, value_name = "SIZE", value_parser = parse_size, help_heading = help::SNAPSHOTS,
          hide_short_help = true)]
    pub max_disk: Option<u64>,

    /// Serve pprof and Prometheus endpoints here.
    ///
    /// While the run goes on: GET /debug/pprof/heap?pid=PID[&seconds=N]
    /// (gzipped pprof, as Go serves heap profiles), /debug/pprof/ (the
    /// profiled processes; ?format=json) and /metrics (Prometheus), on this
    /// address only, e.g. 127.0.0.1:6060. Profiles show a program's
    /// structure: an address off loopback needs --tls-cert, --tls-key and
    /// --auth-token-file (or --tls-client-ca), or --listen-insecure.
    #[arg(long, value_name = "ADDR:PORT", help_heading = help::ENDPOINTS)]
    pub listen: Option<std::net::SocketAddr>,

    /// Serve --listen over TLS with this certificate chain (PEM).
    ///
    /// With --tls-key.
    #[arg(long, value_name = "FILE", requires_all = ["listen", "tls_key"],
          help_heading = help::ENDPOINTS, hide_short_help = true)]
    pub tls_cert: Option<PathBuf>,

    /// The private key (PEM) of --tls-cert.
    #[arg(long, value_name = "FILE", requires_all = ["listen", "tls_cert"],
          help_heading = help::ENDPOINTS, hide_short_help = true)]
    pub tls_key: Option<PathBuf>,

    /// Ask TLS clients for a certificate signed by one of these CAs (PEM).
    ///
    /// A client without one is refused in the handshake.
    #[arg(long, value_name = "FILE", requires = "tls_cert", help_heading = help::ENDPOINTS,
          hide_short_help = true)]
    pub tls_client_ca: Option<PathBuf>,

    /// Ask every request for `Authorization: Bearer TOKEN`, read from FILE.
    ///
    /// What Prometheus' `authorization: credentials_file` sends; other
    /// requests get a 401.
    #[arg(long, value_name = "FILE", requires = "listen", help_heading = help::ENDPOINTS,
          hide_short_help = true)]
    pub auth_token_file: Option<PathBuf>,

    /// Serve --listen off loopback without TLS or authentication.
    ///
    /// Anyone who reaches the port reads every profiled process's heap.
    #[arg(long, requires = "listen", help_heading = help::ENDPOINTS, hide_short_help = true)]
    pub listen_insecure: bool,

    /// Look for debug files here first.
    ///
    /// By build ID (DIR/.build-id/xx/rest.debug) or by debuglink name
    /// (DIR/NAME): a stripped binary with jemalloc linked in is probed
    /// through its debug file's symbols, and frames are named from it.
    /// /usr/lib/debug inside each process's root is searched too.
    #[arg(long, value_name = "DIR", help_heading = help::SYMBOLS, hide_short_help = true)]
    pub debug_dir: Option<PathBuf>,

    /// Do not ask JVMs for a perf map before each snapshot.
    ///
    /// memprobe runs `jcmd PID Compiler.perfmap`; without it JIT-compiled
    /// Java frames stay unnamed.
    #[arg(long, help_heading = help::SYMBOLS, hide_short_help = true)]
    pub no_java_perfmap: bool,

    /// How jemalloc's malloc and operator new are sampled: windows or entry.
    ///
    /// `windows`: at every call while that costs the process under 1% of
    /// the CPU time it uses itself, or 0.1% of one CPU; once dearer, only in
    /// 100 ms windows opened at random times, for as small a share of the
    /// time as keeps them at that cost, each sample weighed by its thread's
    /// bytes from jemalloc's own counter; requests no thread cache holds
    /// (above 32 KiB by default) always sampled where jemalloc's slow path
    /// takes them. `entry`: a
    /// trap per call. Windows need a recognised jemalloc 5.3 build and BTF;
    /// elsewhere entry is used. Each profile's `# malloc_sampling:` says
    /// which, and why. Frees are probed either way. A jemalloc 5.3 copy
    /// whose process runs jemalloc's own profiler (`prof:true`, active) and
    /// whose symbols are kept is sampled by that profiler instead: memprobe
    /// takes its samples, and only frees that leave jemalloc's fast path
    /// trap.
    #[arg(long, value_name = "HOW", value_enum, default_value_t = SamplingArg::Windows,
          help_heading = help::EXPERT, hide_short_help = true)]
    pub sampling: SamplingArg,

    /// With --sampling windows: `auto`, COST%, or a fixed LENGTH/EVERY.
    ///
    /// `auto`: windows of 100 ms, as often as costs 1% of the CPU time the
    /// process uses itself. COST% (such as 0.3%, the shipped agent's): as
    /// often as costs that share; fewer windows, fewer samples.
    /// LENGTH/EVERY: how long a window stays open and how often one opens
    /// on average, at random times.
    #[arg(long, value_name = "auto|COST%|LENGTH/EVERY", default_value = "auto",
          value_parser = parse_windows, help_heading = help::EXPERT, hide_short_help = true)]
    pub windows: WindowTiming,

    /// Longest gap between measurements of what a probe hit costs, or `never`.
    ///
    /// memprobe times its probes on a copy of itself, in the background,
    /// for some 0.15 s of CPU time no other task wants: 1 s after the
    /// start, then 2 s, 4 s, 8 s after the one before, and so on up to
    /// this gap. A virtual machine's trap costs change by up to 2x from
    /// second to second, so the time reported added and the --max-overhead
    /// budget price hits at the mean of the last eight measurements.
    #[arg(long, value_name = "DUR", default_value = "2m", value_parser = parse_every,
          help_heading = help::EXPERT, hide_short_help = true)]
    pub recalibrate_every: Every,

    /// Largest number of live sampled allocations kept per process.
    ///
    /// Beyond it samples are dropped and counted in the output.
    #[arg(long, value_name = "N", default_value_t = CollectorOptions::default().max_live,
          help_heading = help::EXPERT, hide_short_help = true)]
    pub max_live_samples: usize,

    /// Bytes of the ring buffer the kernel sends samples through.
    ///
    /// A power of two, from 4KiB. When memprobe reads it slower than a busy
    /// process fills it, samples are sent without their stack copy, then
    /// lost;
    /// the summary counts them (`kernel drops: N ring buffer full`). A
    /// window's lost samples are made up for by the others of their
    /// thread; a larger ring loses fewer.
    #[arg(long, value_name = "SIZE", default_value = "8MiB", value_parser = parse_ring_buffer,
          help_heading = help::EXPERT, hide_short_help = true)]
    pub ring_buffer: u32,

    /// How sampled stacks are walked: dwarf, auto or fp.
    ///
    /// `dwarf`: the kernel copies 16 KiB of stack with each sample and
    /// memprobe unwinds it with the binaries' .eh_frame (right for code
    /// built without frame pointers, the default for optimized C, C++ and
    /// Rust). `auto`: dwarf, with frame pointers as a fast path (a process
    /// whose frame-pointer walks matched its DWARF unwinds 32 times in a
    /// row sends only one sample in 16 with a copy, until one does not
    /// match). `fp`: frame pointers only (least work per sample, right only
    /// where all code keeps frame pointers).
    #[arg(long, value_name = "HOW", value_enum, default_value_t = UnwindArg::Auto,
          help_heading = help::EXPERT, hide_short_help = true)]
    pub unwind: UnwindArg,

    /// Where probes go in each function: `emulated` (the first instruction
    /// the kernel emulates rather than single-steps, far cheaper for the
    /// target) or `entry` (each function's first instruction). For tests.
    #[arg(long, value_name = "WHERE", value_enum, default_value_t = PlacementArg::Emulated,
          hide = true)]
    pub placement: PlacementArg,

    /// How allocation calls get their return half: `sessions` (uprobe
    /// sessions, Linux 6.13+), `uretprobes` (every call traps twice, as on
    /// older kernels) or `auto` (sessions when the kernel has them). For
    /// tests.
    #[arg(long, value_name = "HOW", value_enum, default_value_t = ReturnProbesArg::Auto,
          hide = true)]
    pub return_probes: ReturnProbesArg,
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::*;

    #[test]
    fn help_is_complete() {
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
            "--tls-cert",
            "--debug-dir",
            "Examples:",
            "Expert options:",
        ] {
            assert!(help.contains(flag), "{flag} missing from --help");
        }
    }

    /// `-h` fits a screen (40 lines of at most 80 columns) with the usual
    /// flags and three examples; every flag it shows is in `--help`; what
    /// only tests use is in neither.
    #[test]
    fn short_help_fits_a_screen() {
        let short = Cli::command().render_help().to_string();
        let long = Cli::command().render_long_help().to_string();
        let lines: Vec<&str> = short.lines().collect();
        assert!(lines.len() <= 40, "{} lines:\n{short}", lines.len());
        let wide: Vec<&&str> = lines.iter().filter(|l| l.chars().count() > 80).collect();
        assert!(wide.is_empty(), "{wide:?}");
        let examples = lines
            .iter()
            .filter(|l| l.trim_start().starts_with("sudo memprobe"));
        assert!(examples.count() >= 2, "{short}");
        assert!(short.contains("memprobe leaks"), "{short}");
        for flag in ["--pid", "--all", "--duration", "--output", "--listen"] {
            assert!(short.contains(flag), "{flag} missing from -h");
        }
        for flag in short.split_whitespace().filter(|w| w.starts_with("--")) {
            let flag = flag.trim_end_matches(|c: char| !c.is_alphanumeric());
            assert!(long.contains(flag), "{flag} in -h, not in --help");
        }
        for expert in ["--recalibrate-every", "--unwind", "--tls-key", "--windows"] {
            assert!(!short.contains(expert), "{expert} in -h");
        }
        for hidden in ["--placement", "--return-probes", "--generate"] {
            assert!(
                !short.contains(hidden) && !long.contains(hidden),
                "{hidden}"
            );
        }
    }

    #[test]
    fn only_a_whole_generate_command_line_is_one() {
        let args = |a: &[&str]| a.iter().map(OsString::from).collect::<Vec<_>>();
        let request = generate::generate_request(&args(&["memprobe", "--generate", "man"]));
        assert!(matches!(request, Some(Ok(generate::Generated::Man))));
        let request = generate::generate_request(&args(&["memprobe", "--generate", "csh"]));
        assert!(request.is_some_and(|r| r.is_err()));
        let request = generate::generate_request(&args(&["memprobe", "--pid", "1"]));
        assert!(request.is_none());
    }
}
