//! A finished heap profile of one process: what every writer takes.

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
    /// `key: value` facts about the run (drops, reason for the dump), written
    /// where each format keeps comments.
    pub notes: Vec<(String, String)>,
    /// Names of JIT-compiled code in the stacks (a JVM's perf map is gone by
    /// the time anyone reads the profile), keyed by the address as looked
    /// up (return address - 1).
    pub jit_symbols: Vec<(u64, String)>,
}

impl HeapProfile {
    pub fn inuse_bytes(&self) -> f64 {
        self.stacks.iter().map(|s| s.inuse_bytes).sum()
    }

    pub fn alloc_bytes(&self) -> f64 {
        self.stacks.iter().map(|s| s.alloc_bytes).sum()
    }
}
