//! What the kernel programs keep in maps between calls: per thread, per
//! call in flight, per probed jemalloc copy and per sampled pointer.

/// An `mmap` or `mremap` call of a profiled thread, between its entry and
/// its return ([`crate::maps::MAP_CALLS`]).
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

/// Threads of a process whose counters are read as it ends: at most
/// this many (the busiest, as userspace lists them).
pub const MAX_EXIT_THREADS: usize = 256;

/// Where a process's threads sampled in windows keep jemalloc's
/// allocated-bytes counter ([`crate::maps::EXIT_COUNTERS`], by tgid), listed by
/// userspace after each window: read as the process calls `_exit`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ExitCounters {
    pub count: u64,
    pub tids: [u32; MAX_EXIT_THREADS],
    pub addresses: [u64; MAX_EXIT_THREADS],
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
    /// The thread's fs base as its last windowed call found the counter:
    /// a later thread given its id has another, and the counter noted is
    /// not its own.
    pub counter_fsbase: u64,
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

/// Key of [`crate::maps::FAST_PATHS`]: a process and a probed jemalloc copy.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct FastPathKey {
    pub pid: u32,
    pub instance: u32,
}

/// Where a jemalloc copy keeps a thread's counters (see
/// [`crate::tls::counter_address`]), and how its calls are sampled.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FastPathConfig {
    /// The allocated-bytes counter's address from the thread's fs base
    /// (static TLS), or from its block for the module (dynamic TLS).
    pub allocated: i64,
    /// 0 for static TLS; else the copy's TLS module id, its index in a
    /// thread's dtv (a library loaded with `dlopen`).
    pub tls_module: u64,
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
