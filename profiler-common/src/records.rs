//! The records the kernel programs write into the ring buffer (and the
//! task iterator's), each behind an [`EventHeader`].

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
    /// A [`crate::python::PythonStackEvent`]: the Python frames of the sampled
    /// call whose record comes next from the same thread.
    PythonStack = 13,
}

impl EventKind {
    pub const ALL: [EventKind; 13] = [
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

/// One user thread's fs base, as [`crate::programs::THREAD_BASES`] writes it:
/// where its TLS block ends, so that userspace can read jemalloc's
/// counters there.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ThreadBase {
    pub tgid: u32,
    pub tid: u32,
    pub fsbase: u64,
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
