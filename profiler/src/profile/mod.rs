//! A finished heap profile of one process: what every writer takes.
mod delta;
mod memory;
mod notes;

pub use memory::{MappedRange, MemoryAccount, MemoryReading, SiteMemory};
pub use notes::ProfileNotes;

/// Estimated allocations of one call stack.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StackEstimate {
    /// Return addresses, innermost first: `frames[0]` is the return address
    /// into the allocator's caller. Allocator frames are already cut off.
    pub frames: Vec<u64>,
    /// Estimated objects and bytes still in use at the end of the profile.
    pub inuse_objects: f64,
    pub inuse_bytes: f64,
    /// Estimated objects and bytes allocated since the probes were attached.
    pub alloc_objects: f64,
    pub alloc_bytes: f64,
    /// Seconds since the oldest still-live sampled allocation of this stack
    /// was made, when one is live.
    pub oldest_live_s: Option<f64>,
}

/// The heap profile of one process at one moment.
#[derive(Clone, Debug, Default)]
pub struct HeapProfile {
    pub pid: u32,
    /// Mean sampling interval in bytes.
    pub sample_interval: u64,
    pub stacks: Vec<StackEstimate>,
    /// `/proc/PID/maps` as last read.
    pub mapped_libraries: String,
    /// What it says of itself (the run, drops, the reason for the dump).
    pub notes: ProfileNotes,
    /// Names of JIT-compiled code in the stacks (a JVM's perf map is gone by
    /// the time anyone reads the profile), keyed by the address as looked
    /// up (return address - 1).
    pub jit_symbols: Vec<(u64, String)>,
    /// The Python frames in the stacks, keyed by the address as looked up
    /// (return address - 1): each stands for a function, file and line.
    pub python_frames: Vec<(u64, PythonFrameName)>,
    /// What the kernel said of its memory, where read (a live process).
    pub memory: Option<MemoryReading>,
    /// That memory accounted for, once its mappings' stacks are named.
    pub account: Option<MemoryAccount>,
}

/// A Python frame as a profile names it: the function (its qualified
/// name), its file and the line it was running.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PythonFrameName {
    pub function: String,
    pub file: String,
    pub line: u32,
}

impl HeapProfile {
    pub fn inuse_bytes(&self) -> f64 {
        self.stacks.iter().map(|s| s.inuse_bytes).sum()
    }

    pub fn alloc_bytes(&self) -> f64 {
        self.stacks.iter().map(|s| s.alloc_bytes).sum()
    }
}

/// What was lost, so that the output can say so.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Drops {
    /// Sampled allocations not tracked because the live table was full.
    pub live_table_full: u64,
    /// Sampled allocations the kernel could not track (its set was full).
    pub untracked_in_kernel: u64,
    /// Samples whose stack went to the overflow stack (stack table full).
    pub stack_table_full: u64,
    /// Returns with no sampled call before them (the call's record was lost).
    pub unmatched_returns: u64,
    /// Samples whose stack could not be walked.
    pub stack_errors: u64,
    /// Samples whose immediate caller was hidden by another tool's return
    /// probe (the return address was the kernel's uretprobe trampoline).
    pub trampoline_callers: u64,
    /// Samples whose stack was unwound with DWARF CFI (the rest used the
    /// frame-pointer walk alone).
    pub dwarf_unwound: u64,
    /// Samples whose stack stops short of the outermost frame: the unwind
    /// needed more than the copied stack, or found no way up.
    pub truncated_stacks: u64,
    /// Samples walked by frame pointers alone because the process's walks
    /// had proved as good as DWARF's.
    pub trusted_frame_pointers: u64,
    /// Samples of a Python process left with their native frames alone:
    /// too many distinct Python frames (function, file, line) to name.
    pub python_frames_dropped: u64,
}
