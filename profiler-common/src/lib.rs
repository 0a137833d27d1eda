//! Types and names shared by the eBPF programs and the userspace profiler.
//!
//! Everything here is `#[repr(C)]`, fixed-size and `Copy`: these structs are
//! the records the kernel writes into maps and the ring buffer.
#![no_std]

mod call_shape;
pub mod cookie;
mod counter;
mod names;
pub mod python;
mod records;
pub mod sampled_slots;
pub mod sampling;
mod state;
pub mod tls;

pub use call_shape::CallShape;
pub use counter::Counter;
pub use names::{globals, maps, programs};
pub use records::*;
pub use state::*;

/// Processes in [`maps::FP_TRUSTED`] still send a stack copy with one
/// sample in this many, so that userspace keeps checking the walk.
pub const FP_CHECK_ONE_IN: u32 = 16;

/// Most entry points counted in [`maps::PROBE_HITS`]; probes beyond share
/// the last slot.
pub const MAX_COUNTED_PROBES: u32 = 4096;

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
