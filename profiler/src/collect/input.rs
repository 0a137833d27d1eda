//! What a process's heap is told: finished samples, and what became of
//! their pointers.
use crate::discover::AllocatorKind;

/// A sampled allocation call, finished: its stack unwound, its probe's
/// allocator and sampling looked up.
#[derive(Clone, Debug, PartialEq)]
pub struct Sample {
    pub tid: u32,
    pub size: u64,
    pub align: u64,
    /// Return addresses, innermost first.
    pub frames: Vec<u64>,
    /// Whether the kernel could not walk its stack.
    pub stack_error: bool,
    /// The allocator of the probe that fired, which sizes the bytes.
    pub allocator: AllocatorKind,
    /// The bytes it was counted as: in a sampling window, its size made
    /// denser; on jemalloc's slow path, the window of bytes it closed (0:
    /// sampled by its own size).
    pub window: u64,
    /// The mean interval it was drawn with, where not the run's (jemalloc's
    /// own profiler's).
    pub interval: Option<u64>,
    /// The allocator copy of the probe.
    pub copy: u16,
    /// For a call sampled in a sampling window, how many times its
    /// window's bytes its thread allocated over the stretch of the run the
    /// window stands for (known once the window closes); `None` elsewhere.
    pub scale: Option<f64>,
}

/// One thing that happened to a process's sampled allocations.
#[derive(Clone, Debug, PartialEq)]
pub enum HeapEvent {
    Sampled(Sample),
    /// The pointer the thread's last sampled call returned (`untracked`:
    /// the kernel's set of sampled pointers was full).
    Returned {
        tid: u32,
        time_ns: u64,
        ptr: u64,
        untracked: bool,
    },
    /// A sampled pointer was freed; by a `realloc` or `rallocx` where
    /// `in_resize` (then `Restored` follows on the same thread if the call
    /// fails).
    Freed {
        tid: u32,
        ptr: u64,
        in_resize: bool,
    },
    /// The resize that freed the thread's sampled `ptr` failed.
    Restored {
        tid: u32,
        ptr: u64,
    },
    /// A sampled pointer grew or shrank in place.
    Resized {
        ptr: u64,
        new_size: u64,
    },
}

impl HeapEvent {
    /// The thread it happened on, where known.
    pub fn tid(&self) -> Option<u32> {
        match self {
            HeapEvent::Sampled(sample) => Some(sample.tid),
            HeapEvent::Returned { tid, .. }
            | HeapEvent::Freed { tid, .. }
            | HeapEvent::Restored { tid, .. } => Some(*tid),
            HeapEvent::Resized { .. } => None,
        }
    }
}
