//! The kernel programs' per-CPU counters.

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
    /// Sampled pointers not tracked because [`crate::maps::SAMPLED`] was full.
    SampledSetFull = 4,
    /// Sampled calls lost because [`crate::maps::PENDING`] was full.
    PendingFull = 5,
    /// Sampled calls whose stack could not be read.
    StackErrors = 6,
    /// Runs of a return half (a uretprobe, or a session's return).
    ReturnHalves = 7,
    /// Samples sent without a stack copy because the ring buffer was busy.
    StackCopiesSkipped = 8,
    /// Samples sent without a stack copy because the process's frame
    /// pointers proved right ([`crate::maps::FP_TRUSTED`]).
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
    /// Threads of processes sampled in windows whose end was not noted
    /// because [`crate::maps::THREAD_EXITS`] was full: what they allocated
    /// after their last window is lost.
    ExitsLost = 15,
    /// Frees of sampled pointers not told at once because the ring buffer
    /// was full: the pointer stays in [`crate::maps::SAMPLED`], and the next free
    /// of its address tells it (each try counted).
    FreesPutOff = 16,
    /// Threads' windows that sampled at an entry probe's density from the
    /// time the ring buffer was over half full.
    WindowsThinned = 17,
    /// Windowed calls counted at a fraction of their bytes (sampled that
    /// much sparser, each sample standing for that much more) because the
    /// ring buffer was three quarters full.
    CrowdedCalls = 18,
}

impl Counter {
    pub const COUNT: u32 = 19;
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
        Counter::CrowdedCalls,
    ];
}
