//! The texts around the flags: a screenful for `-h`, everything for
//! `--help` and the man page.

/// The usual runs, under `-h`.
pub(super) const SHORT_EXAMPLES: &str = "\
Examples:
  sudo memprobe --pid 1234 --duration 10m      profile a running process
  sudo memprobe -o /tmp/prof -- ./server       start a command under the probes
  memprobe leaks /tmp/prof                     rank a run's likely leaks";

/// Headings of `--help` (the flags a first run needs stand under none).
pub(super) const SAMPLING: &str = "Sampling";
pub(super) const SNAPSHOTS: &str = "Snapshots";
pub(super) const ENDPOINTS: &str = "Endpoints";
pub(super) const SYMBOLS: &str = "Symbols";
pub(super) const EXPERT: &str = "Expert options";

pub(super) const EXAMPLES: &str = "\
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
    sudo memprobe --all --allocator jemalloc --track allocations \\
      --windows 0.3% --listen 127.0.0.1:6060 --keep 10
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
other processes mapping the same library run at full speed; so does --all,
which probes each jemalloc process on its own (with --sampling entry it
probes system-wide: every process that maps a probed allocator then traps on
every call). Processes in containers are reached through /proc/PID; outputs
are named by host pid. A process kept to some CPUs (taskset, a cpuset) keeps
them: with --pid, memprobe's own threads run on the others, where any remain.

Allocations are sampled in the kernel by bytes, like jemalloc's own profiler,
and the written estimates are unbiased. A process that runs jemalloc's own
profiler (MALLOC_CONF=prof:true, active) is sampled by it instead where the
build keeps its symbols: memprobe takes jemalloc's samples, and only frees
off jemalloc's fast path trap. memprobe prints one line on stderr
once the probes are attached, and writes the profiles when the duration ends,
on Ctrl-C or SIGTERM, or when a process exits. Needs root (CAP_BPF and
CAP_PERFMON) and a kernel with uprobes and BTF.";
