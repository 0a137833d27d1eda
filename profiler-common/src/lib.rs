//! Types and names shared by the eBPF programs and the userspace profiler.
//!
//! Everything here is `#[repr(C)]`, fixed-size and `Copy`: these structs are
//! the records the kernel writes into maps and the ring buffer.
#![no_std]

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
    /// Processes whose samples carry their Python frames (tgid ->
    /// [`crate::python::PythonProcess`]).
    pub const PYTHON_PROCESSES: &str = "PYTHON_PROCESSES";
    /// Each sampled Python thread's `PyThreadState`, as last found
    /// (pid_tgid -> address), checked by its `native_thread_id` before use.
    pub const PYTHON_THREADS: &str = "PYTHON_THREADS";
    /// Every map. The eBPF side must spell them in `#[map(name = ...)]`
    /// literals (the macro takes no path); a unit test of the profiler
    /// checks the built object has each of these.
    pub const ALL: [&str; 13] = [
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

/// Processes in [`maps::FP_TRUSTED`] still send a stack copy with one
/// sample in this many, so that userspace keeps checking the walk.
pub const FP_CHECK_ONE_IN: u32 = 16;

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

/// Most entry points counted in [`maps::PROBE_HITS`]; probes beyond share
/// the last slot.
pub const MAX_COUNTED_PROBES: u32 = 4096;

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
    /// A task iterator: every user thread's fs base ([`super::ThreadBase`]),
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

mod call_shape;
pub use call_shape::CallShape;

/// Deepest user stack recorded, in frames (the kernel's default
/// `perf_event_max_stack` is 127).
pub const MAX_STACK_DEPTH: usize = 127;

/// What a ring-buffer record is: its header's `kind`.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventKind {
    /// An [`AllocEvent`]: a sampled call, no stack copied.
    Alloc = 1,
    /// An [`AllocReturnEvent`]: the pointer a sampled call returned.
    AllocReturn = 2,
    /// A [`FreeEvent`]: a sampled pointer was freed.
    Free = 3,
    /// A [`ResizeEvent`]: a sampled pointer grew or shrank in place.
    Resize = 4,
    /// An [`AllocStackEvent`].
    AllocWithStack = 5,
    /// An [`AllocStackEvent`] with [`SMALL_STACK_COPY_BYTES`] of stack.
    AllocWithSmallStack = 6,
    /// A [`FreeEvent`]: a sampled pointer passed to `realloc` or
    /// `rallocx`, freed unless the call fails ([`EventKind::Restored`]).
    FreeInResize = 7,
    /// A [`FreeEvent`]: the `realloc` or `rallocx` that freed this
    /// thread's sampled pointer failed; the pointer is live again.
    Restored = 8,
    /// An [`EventHeader`] alone: a watched process mapped a file's code (a
    /// `dlopen`ed library), at `time_ns`.
    MappedCode = 9,
    /// A [`MappingEvent`]: a watched process mapped anonymous memory.
    Mapped = 10,
    /// A [`RemapEvent`]: a watched process unmapped a range.
    Unmapped = 11,
    /// A [`RemapEvent`]: a watched process moved or resized a mapping.
    Remapped = 12,
    /// A [`python::PythonStackEvent`]: the Python frames of the sampled
    /// call whose record comes next from the same thread.
    PythonStack = 13,
    /// An [`ExitCountersEvent`]: threads of a process sampled in windows
    /// end (one that returns or calls `pthread_exit`; all as the process
    /// calls `_exit`).
    ExitCounters = 14,
}

impl EventKind {
    pub const ALL: [EventKind; 14] = [
        EventKind::Alloc,
        EventKind::AllocReturn,
        EventKind::Free,
        EventKind::Resize,
        EventKind::AllocWithStack,
        EventKind::AllocWithSmallStack,
        EventKind::FreeInResize,
        EventKind::Restored,
        EventKind::MappedCode,
        EventKind::Mapped,
        EventKind::Unmapped,
        EventKind::Remapped,
        EventKind::PythonStack,
        EventKind::ExitCounters,
    ];

    /// The kind a header's `kind` field names; `None` for one this build
    /// does not know.
    pub fn from_raw(raw: u32) -> Option<Self> {
        Self::ALL.into_iter().find(|kind| *kind as u32 == raw)
    }
}

/// Common head of every ring-buffer record.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EventHeader {
    /// An [`EventKind`], as its number.
    pub kind: u32,
    /// Thread id as the kernel sees it (host pid namespace).
    pub tid: u32,
    /// Process id (tgid) as the kernel sees it.
    pub pid: u32,
    /// Index of the probed entry point, from the attach cookie.
    pub probe: u32,
    /// `bpf_ktime_get_ns()`: CLOCK_MONOTONIC.
    pub time_ns: u64,
}

/// A sampled allocation call, written at its entry. Its pointer follows in an
/// [`AllocReturnEvent`] of the same thread.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct AllocEvent {
    pub header: EventHeader,
    /// Requested size in bytes.
    pub size: u64,
    /// Requested alignment, 0 when the call has none.
    pub align: u64,
    /// The return address into the allocator's caller, read from the stack.
    pub caller: u64,
    /// What `bpf_get_stack` returned: bytes written, or a negative errno.
    pub stack_bytes: i64,
    /// User stack by frame pointers; `stack[0]` is the probed instruction.
    pub stack: [u64; MAX_STACK_DEPTH],
    /// Registers at the probe, where DWARF unwinding starts.
    pub regs: UserRegs,
    /// For a call sampled on jemalloc's slow path: the thread's bytes since
    /// its previous crossing, which this call's sample stands for (0 for a
    /// call sampled by its own size).
    pub window: u64,
    /// Where the thread's last probed `realloc` keeps its return address,
    /// and that address, for a sample taken inside the call (jemalloc's
    /// own): a return half there replaces it with the kernel's trampoline.
    /// 0, 0 when not known.
    pub hijacked_slot: u64,
    pub hijacked_return: u64,
    /// Nanoseconds the program spent on this sample before sending it
    /// (Python frames, stack walk and copy): what the sample cost the
    /// thread beyond an unsampled call's hit. 0 where not timed.
    pub send_nanos: u64,
}

/// A sampled allocation call with a copy of its user stack, for DWARF
/// unwinding in userspace (kind [`EventKind::AllocWithStack`], or
/// [`EventKind::AllocWithSmallStack`] with a small copy).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct AllocStackEvent<const N: usize = STACK_COPY_BYTES> {
    pub alloc: AllocEvent,
    /// How many bytes of `stack_copy` were read (0 when none could be).
    pub stack_copy_bytes: u64,
    /// The user stack from `alloc.regs.sp` up.
    pub stack_copy: [u8; N],
}

/// The registers DWARF unwinding needs on x86-64.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct UserRegs {
    pub ip: u64,
    pub sp: u64,
    pub bp: u64,
}

/// Bytes of user stack copied with each sampled call: enough for the frames
/// of typical call chains (deeper ones continue by frame pointers where the
/// code keeps them). Copied page by page, at most [`STACK_COPY_PAGES`] reads.
pub const STACK_COPY_BYTES: usize = 16384;
pub const STACK_COPY_PAGE: usize = 4096;
pub const STACK_COPY_PAGES: usize = STACK_COPY_BYTES / STACK_COPY_PAGE;
/// Bytes of user stack copied with a sample when the ring buffer is too busy
/// for a whole copy: the frames nearest the call, which a frame-pointer walk
/// gets wrong in code without frame pointers (jemalloc's, where its own
/// samples are taken), at an eighth of the ring's space.
pub const SMALL_STACK_COPY_BYTES: usize = 2048;

/// The pointer a sampled allocation call returned (0 when it failed).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct AllocReturnEvent {
    pub header: EventHeader,
    pub ptr: u64,
    /// 1 when the kernel's set of sampled pointers was full: the allocation
    /// counts as allocated but its free cannot be seen.
    pub untracked: u64,
}

/// A sampled pointer was freed (or moved away by a realloc), or restored.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct FreeEvent {
    pub header: EventHeader,
    pub ptr: u64,
}

/// An `mmap` or `mremap` call of a profiled thread, between its entry and
/// its return ([`maps::MAP_CALLS`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MapCall {
    /// `mmap`'s flags; `mremap`'s old address.
    pub flags_or_old: u64,
    /// The length asked for (`mremap`: its old length).
    pub len: u64,
    /// `mremap`'s new length.
    pub new_len: u64,
}

/// Anonymous memory a watched process mapped, with the stack that mapped
/// it: the frame-pointer walk, and the registers and stack bytes for DWARF
/// unwinding (as a sampled call's).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct MappingEvent {
    pub header: EventHeader,
    pub addr: u64,
    pub len: u64,
    /// `mmap`'s flags (`MAP_SHARED` is 1).
    pub flags: u64,
    /// What `bpf_get_stack` returned: bytes written, or a negative errno.
    pub stack_bytes: i64,
    /// `stack[0]` is the instruction after the system call.
    pub stack: [u64; MAX_STACK_DEPTH],
    pub regs: UserRegs,
    /// How many bytes of `stack_copy` were read (0 when none could be).
    pub stack_copy_bytes: u64,
    pub stack_copy: [u8; STACK_COPY_BYTES],
}

/// A range a watched process unmapped (`new_len` 0), or a mapping it moved
/// or resized with `mremap`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct RemapEvent {
    pub header: EventHeader,
    pub addr: u64,
    pub len: u64,
    pub new_addr: u64,
    pub new_len: u64,
}

/// Threads of a process whose counters are read as it ends: at most
/// this many (the busiest, as userspace lists them).
pub const MAX_EXIT_THREADS: usize = 256;

/// Where a process's threads sampled in windows keep jemalloc's
/// allocated-bytes counter ([`maps::EXIT_COUNTERS`], by tgid), listed by
/// userspace after each window: read as the process calls `_exit`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ExitCounters {
    pub count: u64,
    pub tids: [u32; MAX_EXIT_THREADS],
    pub addresses: [u64; MAX_EXIT_THREADS],
}

/// One user thread's fs base, as [`programs::THREAD_BASES`] writes it:
/// where its TLS block ends, so that userspace can read jemalloc's
/// counters there.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ThreadBase {
    pub tgid: u32,
    pub tid: u32,
    pub fsbase: u64,
}

/// Threads of a process sampled in windows end: a thread that returns or
/// calls `pthread_exit` (libc's `__call_tls_dtors`, in the thread), or
/// every listed one as the process calls `_exit` (from `exit`, or a
/// return from `main`). Each one's counter, its memory still there, which
/// ends what the thread allocated after its last window.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ExitCountersEvent {
    pub header: EventHeader,
    pub count: u64,
    pub tids: [u32; MAX_EXIT_THREADS],
    pub allocated: [u64; MAX_EXIT_THREADS],
}

/// A sampled pointer was resized in place by `xallocx`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct ResizeEvent {
    pub header: EventHeader,
    pub ptr: u64,
    /// The usable size `xallocx` returned.
    pub new_size: u64,
}

/// Byte countdown of one thread.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct ThreadState {
    pub bytes_until_sample: i64,
    /// `rsp` at the return of this thread's sampled call in flight (0 when
    /// none): how a uprobe session program tells its return half apart.
    pub return_sp: u64,
    /// Where this thread's last probed `realloc` or `rallocx` (where
    /// jemalloc's own samples are taken) keeps its return address, and that
    /// address. A return half replaces it with the kernel's trampoline:
    /// memprobe's, or that of any uprobe session on the same file (the
    /// kernel runs other processes' session programs too, and a filtered
    /// one asks for the return). Samples inside the call carry both.
    pub resize_slot: u64,
    pub resize_return: u64,
    /// The last call of this thread to an entry point that may pass its
    /// call on to another probed entry point (glibc's realloc calling
    /// malloc): that inner call must not be counted again.
    pub forwarder: Forwarder,
    /// jemalloc's allocated-bytes counter of the thread at its first
    /// slow-path call seen (0: none seen yet), where its first window's
    /// bytes start.
    pub first_allocated: u64,
    /// Windowed sampling: the sampling window the thread's last windowed
    /// call fell in ([`FastPathConfig::window`]), and jemalloc's
    /// allocated-bytes counter at its first call in it and after its last:
    /// what the thread allocated in the window, by any call.
    pub window: u64,
    pub window_first: u64,
    pub window_end: u64,
    /// Where that counter is in the thread's TLS (0: not known yet), as
    /// its last windowed call found it: read again as its process calls
    /// `_exit` or the run ends, for what it allocated after its last
    /// window.
    pub counter_at: u64,
    /// The bytes the samples of its last window stand for (each its usable
    /// size over the chance its call was sampled), sent and lost (the ring
    /// buffer full, or the table of calls in flight): the sent stand for
    /// their share of the window's bytes. Weighed, not counted, since a
    /// window samples sparser while the ring is busy, so that a lost
    /// sample stands for more bytes than a sent one.
    pub window_sent_bytes: u64,
    pub window_lost_bytes: u64,
    /// 1 once the ring buffer was over half full in its last window: the
    /// rest of the window samples at an entry probe's density.
    pub window_thinned: u64,
}

/// Key of [`maps::FAST_PATHS`]: a process and a probed jemalloc copy.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct FastPathKey {
    pub pid: u32,
    pub instance: u32,
}

/// Where a jemalloc copy keeps a thread's counters, from its fs base.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FastPathConfig {
    /// fs-relative address of the allocated-bytes counter.
    pub allocated: i64,
    /// Requests above this many bytes are sampled where the slow path
    /// sends them, every one of them (none is left to chance): above the
    /// thread cache's largest where that place was found, else above the
    /// fast path's largest, at the slow path's entry. Smaller ones are
    /// sampled by windowed entry probes.
    pub large_above: u64,
    /// Inside the window now open each call's bytes count 2^window_shift
    /// times towards the thread's countdown: windows see a share of the
    /// calls near 2^-window_shift, and sampling them more densely keeps
    /// the samples as many as sampling every call would give.
    pub window_shift: u64,
    /// The process's sampling window now open (numbered from 1), which its
    /// windowed calls note in their thread's state.
    pub window: u64,
    /// The process addresses of jemalloc's slow path, `[start, end)`: a
    /// call to its large requests' function from elsewhere (`calloc`,
    /// `realloc`, probed at their own entries) is not counted there.
    pub callers: [u64; 2],
}

/// The densest a window samples: 2^MAX_WINDOW_SHIFT times an entry probe's
/// rate.
pub const MAX_WINDOW_SHIFT: u64 = 7;

/// An allocation call that may pass itself on to another entry point of
/// the same allocator. The next allocation entry on the thread is that
/// inner call (and is not counted) when it is a tail call (its return
/// address sits in the same slot and is the same) or a call made from the
/// forwarder's code (its return address lies within [`FORWARD_WINDOW`]
/// bytes after the forwarder's probe, its slot deeper on the stack).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct Forwarder {
    /// Address of the forwarder's return-address slot; 0 when none.
    pub slot: u64,
    /// The return address in that slot.
    pub return_address: u64,
    /// Where the forwarder's probe fired.
    pub ip: u64,
    /// The forwarder's probe index: a call to the same entry point is never
    /// its own inner call.
    pub probe: u64,
}

/// Bytes after a forwarder's probe within which its calls to other entry
/// points lie (glibc 2.36's realloc calls malloc at +1015).
pub const FORWARD_WINDOW: u64 = 4096;

/// What a return probe must do for the call in flight on a thread.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct PendingCall {
    /// One of [`pending_kind`].
    pub kind: u64,
    /// For `posix_memalign`: where the pointer is stored. For `xallocx`: the
    /// pointer being resized. For a sampled `realloc` or `rallocx`
    /// (`RETURNED_POINTER`): its old pointer if that was sampled too, to
    /// restore if the call fails; else 0.
    pub addr: u64,
}

pub mod pending_kind {
    /// The pointer is the return value.
    pub const RETURNED_POINTER: u64 = 1;
    /// The pointer is stored at `addr` (posix_memalign); the return value is an errno.
    pub const STORED_POINTER: u64 = 2;
    /// `xallocx` of the sampled pointer at `addr`; the return value is its new size.
    pub const RESIZE: u64 = 3;
    /// `realloc` or `rallocx` of the sampled pointer at `addr`, the call
    /// itself not sampled: a null return means it failed and `addr` lives on.
    pub const RESTORE_IF_FAILED: u64 = 4;
}

/// Key of the kernel's set of sampled pointers: pointers are only unique
/// within one process, and a free is matched against the allocator
/// instance (one copy of jemalloc) that made the pointer.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct LiveKey {
    pub pid: u32,
    pub instance: u32,
    pub ptr: u64,
}

/// Per-CPU counters kept by the eBPF programs.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Counter {
    /// Allocation calls seen (sampled or not).
    AllocCalls = 0,
    /// Allocation calls that were sampled.
    SampledCalls = 1,
    /// Free calls seen.
    FreeCalls = 2,
    /// Records lost because the ring buffer was full.
    RingBufferFull = 3,
    /// Sampled pointers not tracked because [`maps::SAMPLED`] was full.
    SampledSetFull = 4,
    /// Sampled calls lost because [`maps::PENDING`] was full.
    PendingFull = 5,
    /// Sampled calls whose stack could not be read.
    StackErrors = 6,
    /// Runs of a return half (a uretprobe, or a session's return).
    ReturnHalves = 7,
    /// Samples sent without a stack copy because the ring buffer was busy.
    StackCopiesSkipped = 8,
    /// Samples sent without a stack copy because the process's frame
    /// pointers proved right ([`maps::FP_TRUSTED`]).
    FramePointerFastPath = 9,
    /// Allocation calls made by another probed allocation call (glibc's
    /// realloc calling malloc): not counted twice.
    InnerCalls = 10,
    /// Samples sent with a small stack copy because the ring buffer was
    /// too busy for a whole one.
    SmallStackCopies = 11,
    /// Mappings, unmappings and remappings of watched processes not told
    /// because the ring buffer was full.
    MappingEventsLost = 12,
    /// Mappings told without their stack copy because the ring buffer was
    /// busy.
    MappingStacksSkipped = 13,
    /// Samples of a Python process sent without their Python frames: the
    /// ring buffer had no room for them.
    PythonStacksLost = 14,
    /// Exits of processes sampled in windows not told because the ring
    /// buffer was full: what their threads allocated after their last
    /// window is lost.
    ExitsLost = 15,
    /// Frees of sampled pointers not told at once because the ring buffer
    /// was full: the pointer stays in [`maps::SAMPLED`], and the next free
    /// of its address tells it (each try counted).
    FreesPutOff = 16,
    /// Threads' windows that sampled at an entry probe's density from the
    /// time the ring buffer was over half full.
    WindowsThinned = 17,
}

impl Counter {
    pub const COUNT: u32 = 18;
    pub const ALL: [Counter; Self::COUNT as usize] = [
        Counter::AllocCalls,
        Counter::SampledCalls,
        Counter::FreeCalls,
        Counter::RingBufferFull,
        Counter::SampledSetFull,
        Counter::PendingFull,
        Counter::StackErrors,
        Counter::ReturnHalves,
        Counter::StackCopiesSkipped,
        Counter::FramePointerFastPath,
        Counter::InnerCalls,
        Counter::SmallStackCopies,
        Counter::MappingEventsLost,
        Counter::MappingStacksSkipped,
        Counter::PythonStacksLost,
        Counter::ExitsLost,
        Counter::FreesPutOff,
        Counter::WindowsThinned,
    ];
}

pub mod cookie;

pub mod python;

pub mod sampled_slots;

pub mod sampling;

#[cfg(feature = "user")]
mod pod {
    use super::*;
    // SAFETY: all of these are repr(C), Copy, and valid for any bit pattern.
    unsafe impl aya::Pod for ThreadState {}
    unsafe impl aya::Pod for Forwarder {}
    unsafe impl aya::Pod for FastPathKey {}
    unsafe impl aya::Pod for FastPathConfig {}
    unsafe impl aya::Pod for ExitCounters {}
    unsafe impl aya::Pod for PendingCall {}
    unsafe impl aya::Pod for LiveKey {}
    unsafe impl aya::Pod for python::PythonProcess {}
}

#[cfg(test)]
mod tests {
    use super::sampling::*;

    #[test]
    fn split_random_finds_leading_zeros_and_mantissa() {
        assert_eq!(split_random(0x8000_0000), (0, 0));
        assert_eq!(split_random(0xffff_ffff), (0, QUANTILE_COUNT - 1));
        assert_eq!(split_random(0x4000_0000), (1, 0));
        assert_eq!(split_random(0x0000_0001), (31, 0));
        assert_eq!(split_random(0), (31, 0));
        // 0b0110_0000... : one leading zero, mantissa 1.1 -> index half way.
        assert_eq!(split_random(0x6000_0000), (1, QUANTILE_COUNT / 2));
    }

    #[test]
    fn cookie_fields_round_trip() {
        use super::cookie::*;
        let c = encode(0x1ead_beef, 24, 7, true);
        assert_eq!(probe_index(c), 0x1ead_beef);
        assert!(!is_windowed(c));
        assert_eq!(probe_index(windowed(c)), 0x1ead_beef);
        assert!(is_windowed(windowed(c)) && forwards(windowed(c)));
        assert_eq!(return_address_offset(c), 24);
        assert_eq!(instance(c), 7);
        assert!(forwards(c));
        assert!(!forwards(encode(0x1ead_beef, 24, 7, false)));
    }
}
