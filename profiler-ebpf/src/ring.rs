//! When a record wakes memprobe. The kernel's default wakes the reader at
//! each record sent to a ring it has read to the end, which a reader that
//! keeps up makes nearly every record: each wake-up is an interrupt the
//! profiled thread raises on its own CPU (an APIC write, a VM exit on a
//! guest), measured dearer than the trap itself. So the frequent records
//! (samples, their returns and frees, mappings) wake it only as they take
//! the ring past `RING_WAKE_BYTES`, and memprobe drains it on a timer too.
use aya_ebpf::{
    bindings::{BPF_RB_AVAIL_DATA, BPF_RB_FORCE_WAKEUP, BPF_RB_NO_WAKEUP},
    maps::ring_buf::RingBufEntry,
};

use crate::maps::{EVENTS, RING_WAKE_BYTES};

/// The flags to send a record of `bytes` with: a wake-up only if it takes
/// the ring past `RING_WAKE_BYTES`. `reserved`: the record is in the ring
/// already (reserved, not yet submitted), else about to be copied in. (Two
/// CPUs crossing it at once may both miss it: the timer drains anyway.)
#[inline(always)]
fn wake_flags(bytes: u64, reserved: bool) -> u64 {
    let queued = EVENTS.query(BPF_RB_AVAIL_DATA as u64);
    let before = if reserved {
        queued.saturating_sub(bytes)
    } else {
        queued
    };
    // SAFETY: a plain read of a global userspace set at load time.
    let wake_at = unsafe { core::ptr::read_volatile(&RING_WAKE_BYTES) };
    if before < wake_at && before + bytes >= wake_at {
        BPF_RB_FORCE_WAKEUP as u64
    } else {
        BPF_RB_NO_WAKEUP as u64
    }
}

/// Copies `record` into the ring, waking memprobe only as it takes the
/// ring past `RING_WAKE_BYTES`.
#[inline(always)]
pub(crate) fn output<T>(record: &T) -> Result<(), i32> {
    EVENTS.output::<T>(record, wake_flags(size_of::<T>() as u64, false))
}

/// Submits a record reserved in the ring, waking memprobe only as it takes
/// the ring past `RING_WAKE_BYTES`.
#[inline(always)]
pub(crate) fn submit<T>(entry: RingBufEntry<T>) {
    entry.submit(wake_flags(size_of::<T>() as u64, true));
}
