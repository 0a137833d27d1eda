//! jemalloc's slow path (`malloc_default`), probed instead of `malloc` and
//! `operator new`, whose inlined fast path serves most calls without a
//! trap. A hit is a large request or a thread in a non-nominal state (an
//! ordinary call, counted by its size), a thread-cache refill (not counted:
//! its bytes are in the next window), or a crossing of the thread's byte
//! threshold: the bytes the thread allocated since its previous crossing,
//! less what entry probes counted meanwhile, are one window counted down at
//! once; the crossing call is sampled when the countdown runs out, standing
//! for its window.
use aya_ebpf::{
    helpers::{bpf_probe_read_kernel, bpf_probe_read_user, generated::bpf_get_current_task},
    programs::ProbeContext,
};
use profiler_common::{Counter, FastPathConfig, FastPathKey, PendingCall, cookie, pending_kind};

use crate::{
    alloc::{count_down, on_allocation},
    maps::{FAST_PATHS, TASK_FSBASE},
    sampling::{Args, Thread, count, count_hit, probe_cookie},
};

const POINTER: PendingCall = PendingCall {
    kind: pending_kind::RETURNED_POINTER,
    addr: 0,
};

/// Returns whether the call's return half is needed.
#[inline(always)]
pub(crate) fn on_slow_path(ctx: &ProbeContext, thread: &Thread) -> bool {
    let size = Args::of(ctx).arg(0);
    let Some((config, allocated, threshold)) = counters(ctx, thread) else {
        return on_allocation(ctx, thread, size, 0, POINTER);
    };
    if size > config.large_above || (threshold == 0 && config.large_only == 0) {
        return on_allocation(ctx, thread, size, 0, POINTER);
    }
    count_hit(ctx);
    if config.large_only != 0 {
        // Windowed sampling: the small ones are the windows' to sample.
        // The thread's counter as first seen here (within its first 64 KiB
        // since the attach: a refill or a crossing) is where its first
        // window's bytes start.
        // SAFETY: the entry belongs to this thread; only this thread writes it.
        unsafe {
            if (*thread.state).last_allocated == 0 {
                (*thread.state).last_allocated = allocated.max(1);
            }
        }
        return false;
    }
    let end = allocated.wrapping_add(small_usable_size(size));
    if end < threshold {
        count(Counter::Refills);
        return false;
    }
    count(Counter::Crossings);
    let state = thread.state;
    // SAFETY: the entry belongs to this thread; only this thread writes it.
    let window = unsafe {
        let since = (*state).last_allocated;
        let counted = (*state).counted_bytes;
        (*state).last_allocated = end;
        (*state).counted_bytes = 0;
        if since == 0 || end <= since {
            // The thread's first crossing seen: its window is unknown.
            return false;
        }
        (end - since).saturating_sub(counted)
    };
    if window == 0 {
        return false;
    }
    count_down(ctx, thread, size, 0, POINTER, window)
}

/// The copy's counter layout and the thread's allocated bytes and next
/// threshold, read from its TLS block.
#[inline(always)]
pub(crate) fn counters(ctx: &ProbeContext, thread: &Thread) -> Option<(FastPathConfig, u64, u64)> {
    let key = FastPathKey {
        pid: (thread.id >> 32) as u32,
        instance: cookie::instance(probe_cookie(ctx)),
    };
    // SAFETY: a lookup in a map of plain values.
    let config = *unsafe { FAST_PATHS.get(key) }?;
    // SAFETY: a plain read of a global userspace set at load time.
    let fsbase_offset = unsafe { core::ptr::read_volatile(&TASK_FSBASE) };
    if fsbase_offset == 0 {
        return None;
    }
    // SAFETY: the helper returns the current task; reads fault safely.
    let fsbase: u64 = unsafe {
        let task = bpf_get_current_task();
        bpf_probe_read_kernel((task + fsbase_offset) as *const u64).ok()?
    };
    let at = fsbase.wrapping_add(config.allocated as u64);
    // SAFETY: reading user memory through the helper, which faults safely.
    let allocated = unsafe { bpf_probe_read_user(at as *const u64) }.ok()?;
    // SAFETY: as above.
    let threshold = unsafe { bpf_probe_read_user((at + 8) as *const u64) }.ok()?;
    Some((config, allocated, threshold))
}

/// jemalloc 5.3's size class of a request of at most 4 KiB.
#[inline(always)]
pub(crate) fn small_usable_size(size: u64) -> u64 {
    if size <= 8 {
        return 8;
    }
    if size <= 64 {
        return (size + 15) & !15;
    }
    // Four classes per doubling above 64 bytes.
    let mut delta = 16u64;
    let mut limit = 128u64;
    while limit < size && limit < 8192 {
        delta <<= 1;
        limit <<= 1;
    }
    (size + delta - 1) & !(delta - 1)
}
