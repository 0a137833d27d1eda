//! Names of the eBPF object's maps, globals and programs, defined once:
//! the eBPF side spells them in its attributes, userspace looks them up.

/// Map names, defined once. The eBPF side uses them in `#[map(name = ...)]`,
/// userspace to look the maps up after loading.
pub mod maps {
    /// Ring buffer of [`crate::AllocEvent`], [`crate::AllocReturnEvent`],
    /// [`crate::FreeEvent`] and [`crate::ResizeEvent`] records.
    pub const EVENTS: &str = "EVENTS";
    /// Per-thread byte countdown ([`crate::ThreadState`]), keyed by pid_tgid.
    pub const THREADS: &str = "THREADS";
    /// Calls whose return value is wanted ([`crate::PendingCall`]), keyed by pid_tgid.
    pub const PENDING: &str = "PENDING";
    /// Sampled pointers still live ([`crate::LiveKey`] -> u8), so that a free
    /// of an unsampled pointer emits nothing (and, with [`SAMPLED_SLOTS`],
    /// mostly costs no lookup here).
    pub const SAMPLED: &str = "SAMPLED";
    /// How many of [`SAMPLED`]'s pointers hash to each slot (u64), see
    /// [`crate::sampled_slots`].
    pub const SAMPLED_SLOTS: &str = "SAMPLED_SLOTS";
    /// Quantiles of the exponential distribution, see [`crate::sampling`].
    pub const EXP_QUANTILES: &str = "EXP_QUANTILES";
    /// Per-CPU counters indexed by [`crate::Counter`].
    pub const COUNTERS: &str = "COUNTERS";
    /// Per-CPU hits of each attached entry point, indexed by probe index.
    pub const PROBE_HITS: &str = "PROBE_HITS";
    /// Processes (tgid -> u8) whose frame-pointer walks proved as good as
    /// DWARF unwinding: their samples mostly go without a stack copy.
    pub const FP_TRUSTED: &str = "FP_TRUSTED";
    /// Where jemalloc's thread counters are for each probed copy sampled
    /// on its slow path ([`crate::FastPathKey`] -> [`crate::FastPathConfig`]).
    pub const FAST_PATHS: &str = "FAST_PATHS";
    /// Threads inside an `mmap` or `mremap` of anonymous memory, to be
    /// told of at its return (pid_tgid -> [`crate::MapCall`]).
    pub const MAP_CALLS: &str = "MAP_CALLS";
    /// Where each process's threads sampled in windows keep their counter
    /// (tgid -> [`crate::ExitCounters`]), read as it calls `_exit`.
    pub const EXIT_COUNTERS: &str = "EXIT_COUNTERS";
    /// Threads of processes sampled in windows that ended, and jemalloc's
    /// allocated-bytes counter each had then (pid_tgid -> u64): noted by
    /// the exit probes, taken by userspace after the samples sent before.
    pub const THREAD_EXITS: &str = "THREAD_EXITS";
    /// Processes whose samples carry their Python frames (tgid ->
    /// [`crate::python::PythonProcess`]).
    pub const PYTHON_PROCESSES: &str = "PYTHON_PROCESSES";
    /// Each sampled Python thread's `PyThreadState`, as last found
    /// (pid_tgid -> address), checked by its `native_thread_id` before use.
    pub const PYTHON_THREADS: &str = "PYTHON_THREADS";
    /// Every map. The eBPF side must spell them in `#[map(name = ...)]`
    /// literals (the macro takes no path); a unit test of the profiler
    /// checks the built object has each of these.
    pub const ALL: [&str; 15] = [
        EXIT_COUNTERS,
        THREAD_EXITS,
        PYTHON_PROCESSES,
        PYTHON_THREADS,
        MAP_CALLS,
        FAST_PATHS,
        EVENTS,
        THREADS,
        PENDING,
        SAMPLED,
        SAMPLED_SLOTS,
        EXP_QUANTILES,
        COUNTERS,
        PROBE_HITS,
        FP_TRUSTED,
    ];
}

/// Globals of the eBPF object that userspace sets at load time.
pub mod globals {
    /// `u8`: 1 to copy each sampled call's user stack for DWARF unwinding.
    pub const COPY_STACK: &str = "COPY_STACK";
    /// `u64`: above this many unread bytes in the ring buffer, samples go
    /// without their stack copy (a fraction of the size) rather than be lost.
    pub const RING_BUSY_BYTES: &str = "RING_BUSY_BYTES";
    /// `u64`: frequent records wake memprobe only as they take the ring
    /// buffer past this many unread bytes; it drains the ring on a timer
    /// besides.
    pub const RING_WAKE_BYTES: &str = "RING_WAKE_BYTES";
    /// `u64`: byte offset of `thread.fsbase` in `struct task_struct` (from
    /// the kernel's BTF), 0 when unknown: a task's TLS for jemalloc's
    /// thread counters.
    pub const TASK_FSBASE: &str = "TASK_FSBASE";
    /// `u64`: byte offsets of `pid` and `tgid` in `struct task_struct`,
    /// 0 when unknown: the threads [`super::programs::THREAD_BASES`] lists.
    pub const TASK_PID: &str = "TASK_PID";
    pub const TASK_TGID: &str = "TASK_TGID";
    /// `u64`: the mean sampling interval, bytes.
    pub const SAMPLE_INTERVAL: &str = "SAMPLE_INTERVAL";
    /// `u32`: memprobe's own process id, never sampled: `--all`'s
    /// system-wide probes fire in it too, and each of its samples would
    /// make memprobe allocate, and so sample itself, again.
    pub const OWN_TGID: &str = "OWN_TGID";
    pub const ALL: [&str; 8] = [
        COPY_STACK,
        SAMPLE_INTERVAL,
        RING_BUSY_BYTES,
        RING_WAKE_BYTES,
        TASK_FSBASE,
        TASK_PID,
        TASK_TGID,
        OWN_TGID,
    ];
}

/// Program names, as the eBPF functions are called.
pub mod programs {
    pub const ALLOC_SIZE_ARG0: &str = "alloc_size_arg0";
    pub const ALLOC_SIZE_ARG1: &str = "alloc_size_arg1";
    pub const ALLOC_CALLOC: &str = "alloc_calloc";
    pub const ALLOC_REALLOC: &str = "alloc_realloc";
    pub const ALLOC_POSIX_MEMALIGN: &str = "alloc_posix_memalign";
    pub const ALLOC_MALLOCX: &str = "alloc_mallocx";
    pub const ALLOC_RALLOCX: &str = "alloc_rallocx";
    pub const RESIZE_XALLOCX: &str = "resize_xallocx";
    pub const FREE_ARG0: &str = "free_arg0";
    pub const CALL_RETURN: &str = "call_return";
    pub const ALLOC_SLOW_PATH: &str = "alloc_slow_path";
    pub const ALLOC_LARGE_REQUEST: &str = "alloc_large_request";
    pub const OWN_SAMPLE: &str = "own_sample";
    /// Uprobes on libc's `mmap`, `munmap` and `mremap` (and the return
    /// halves of the first and last) in each profiled process: the
    /// anonymous memory it maps, gives back or moves.
    pub const MMAP_CALL: &str = "mmap_call";
    pub const MMAP_RETURN: &str = "mmap_return";
    pub const MUNMAP_CALL: &str = "munmap_call";
    pub const MREMAP_CALL: &str = "mremap_call";
    pub const MREMAP_RETURN: &str = "mremap_return";
    /// Uprobe on the dynamic loader's `_dl_debug_state`, which it calls
    /// as it maps a library (`dlopen`), for debuggers.
    pub const LIBRARY_LOADED: &str = "library_loaded";
    /// Uprobe on libc's `_exit`: a process sampled in windows ends.
    pub const PROCESS_EXIT: &str = "process_exit";
    /// Uprobe on libc's `__call_tls_dtors`: a thread of a process sampled
    /// in windows ends.
    pub const THREAD_EXIT: &str = "thread_exit";
    /// A task iterator: every user thread's fs base ([`crate::ThreadBase`]),
    /// read when a process's windows begin.
    pub const THREAD_BASES: &str = "thread_bases";
    /// Every program in a profiled process's libc and loader: what it
    /// maps, and its end.
    pub const MAPPINGS: [&str; 8] = [
        MMAP_CALL,
        MMAP_RETURN,
        MUNMAP_CALL,
        MREMAP_CALL,
        MREMAP_RETURN,
        LIBRARY_LOADED,
        PROCESS_EXIT,
        THREAD_EXIT,
    ];
    /// Every plain uprobe program.
    pub const ALL: [&str; 13] = [
        ALLOC_SLOW_PATH,
        ALLOC_LARGE_REQUEST,
        OWN_SAMPLE,
        ALLOC_SIZE_ARG0,
        ALLOC_SIZE_ARG1,
        ALLOC_CALLOC,
        ALLOC_REALLOC,
        ALLOC_POSIX_MEMALIGN,
        ALLOC_MALLOCX,
        ALLOC_RALLOCX,
        RESIZE_XALLOCX,
        FREE_ARG0,
        CALL_RETURN,
    ];

    /// Uprobe-session variants of the programs that need a return half:
    /// one program for both halves, the return half runs only when the
    /// entry asked for it (a sampled call).
    pub mod session {
        pub const SIZE_ARG0: &str = "session_size_arg0";
        pub const SIZE_ARG1: &str = "session_size_arg1";
        pub const CALLOC: &str = "session_calloc";
        pub const REALLOC: &str = "session_realloc";
        pub const POSIX_MEMALIGN: &str = "session_posix_memalign";
        pub const MALLOCX: &str = "session_mallocx";
        pub const RALLOCX: &str = "session_rallocx";
        pub const XALLOCX: &str = "session_xallocx";
        pub const SLOW_PATH: &str = "session_slow_path";
        pub const LARGE_REQUEST: &str = "session_large_request";
        pub const FREE_IN_RESIZE: &str = "session_free_in_resize";
        pub const ALL: [&str; 11] = [
            SLOW_PATH,
            LARGE_REQUEST,
            FREE_IN_RESIZE,
            SIZE_ARG0,
            SIZE_ARG1,
            CALLOC,
            REALLOC,
            POSIX_MEMALIGN,
            MALLOCX,
            RALLOCX,
            XALLOCX,
        ];
    }
}
