//! Every map and global of the eBPF object. Sizes are defaults; userspace sets the real
//! ones at load time (`EbpfLoader::map_max_entries`). `#[map(name = ...)]`
//! takes only a literal: each must equal its constant in
//! `profiler_common::maps`, which the profiler's unit test
//! `kernel::tests::every_name_userspace_uses_is_in_the_object` checks.
use aya_ebpf::{
    macros::map,
    maps::{Array, HashMap, LruHashMap, PerCpuArray, RingBuf},
};
use profiler_common::{
    ExitCounters, FastPathConfig, FastPathKey, LiveKey, MapCall, PendingCall, ThreadState,
    python::PythonProcess, sampling,
};

#[map(name = "EVENTS")]
pub static EVENTS: RingBuf = RingBuf::with_byte_size(8 << 20, 0);

/// LRU: a thread that exited leaves its entry behind; eviction only means a
/// fresh countdown, which the exponential distribution makes harmless.
#[map(name = "THREADS")]
pub static THREADS: LruHashMap<u64, ThreadState> = LruHashMap::with_max_entries(65536, 0);

#[map(name = "PENDING")]
pub static PENDING: LruHashMap<u64, PendingCall> = LruHashMap::with_max_entries(16384, 0);

#[map(name = "SAMPLED")]
pub static SAMPLED: HashMap<LiveKey, u8> = HashMap::with_max_entries(262144, 0);

#[map(name = "SAMPLED_SLOTS")]
pub static SAMPLED_SLOTS: Array<u64> =
    Array::with_max_entries(profiler_common::sampled_slots::SLOTS, 0);

#[map(name = "EXP_QUANTILES")]
pub static EXP_QUANTILES: Array<u64> = Array::with_max_entries(sampling::TABLE_LEN, 0);

#[map(name = "COUNTERS")]
pub static COUNTERS: PerCpuArray<u64> =
    PerCpuArray::with_max_entries(profiler_common::Counter::COUNT, 0);

#[map(name = "FP_TRUSTED")]
pub static FP_TRUSTED: HashMap<u32, u8> = HashMap::with_max_entries(8192, 0);

#[map(name = "PROBE_HITS")]
pub static PROBE_HITS: PerCpuArray<u64> =
    PerCpuArray::with_max_entries(profiler_common::MAX_COUNTED_PROBES, 0);

/// LRU: a thread killed inside `mmap` leaves its call behind.
#[map(name = "MAP_CALLS")]
pub static MAP_CALLS: LruHashMap<u64, MapCall> = LruHashMap::with_max_entries(4096, 0);

/// A process's threads' counters, listed by userspace, bounded by the
/// processes sampled in windows at once.
#[map(name = "EXIT_COUNTERS")]
pub static EXIT_COUNTERS: HashMap<u32, ExitCounters> = HashMap::with_max_entries(1024, 0);

/// Threads of processes sampled in windows that ended (pid_tgid ->
/// jemalloc's allocated-bytes counter then), until userspace takes them:
/// bounded by the exits between two of its drains.
#[map(name = "THREAD_EXITS")]
pub static THREAD_EXITS: HashMap<u64, u64> = HashMap::with_max_entries(16384, 0);

#[map(name = "FAST_PATHS")]
pub static FAST_PATHS: HashMap<FastPathKey, FastPathConfig> = HashMap::with_max_entries(4096, 0);

#[map(name = "PYTHON_PROCESSES")]
pub static PYTHON_PROCESSES: HashMap<u32, PythonProcess> = HashMap::with_max_entries(4096, 0);

/// LRU: a thread that exited leaves its entry behind.
#[map(name = "PYTHON_THREADS")]
pub static PYTHON_THREADS: LruHashMap<u64, u64> = LruHashMap::with_max_entries(16384, 0);

/// Set by userspace (`globals::TASK_FSBASE`): 0 when unknown.
#[unsafe(no_mangle)]
pub static TASK_FSBASE: u64 = 0;

/// Set by userspace (`globals::TASK_PID`, `globals::TASK_TGID`): 0 when
/// unknown.
#[unsafe(no_mangle)]
pub static TASK_PID: u64 = 0;
#[unsafe(no_mangle)]
pub static TASK_TGID: u64 = 0;

/// Set by userspace (`globals::COPY_STACK`): 0 when stacks are walked by
/// frame pointers alone (`--unwind fp`).
#[unsafe(no_mangle)]
pub static COPY_STACK: u8 = 1;

/// Set by userspace (`globals::OWN_TGID`).
#[unsafe(no_mangle)]
pub static OWN_TGID: u32 = 0;

/// Set by userspace (`globals::RING_BUSY_BYTES`).
#[unsafe(no_mangle)]
pub static RING_BUSY_BYTES: u64 = 4 << 20;

/// Set by userspace (`globals::SAMPLE_INTERVAL`).
#[unsafe(no_mangle)]
pub static SAMPLE_INTERVAL: u64 = 512 << 10;

/// Set by userspace (`globals::RING_WAKE_BYTES`).
#[unsafe(no_mangle)]
pub static RING_WAKE_BYTES: u64 = 1 << 20;
