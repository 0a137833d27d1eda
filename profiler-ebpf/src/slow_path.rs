//! jemalloc's slow path (`malloc_default`), probed beside `malloc` and
//! `operator new`'s windowed entry probes: every request above the fast
//! path's largest reaches it and is sampled by its size there, so a big
//! buffer is never left to a window's chance. A small request here (a
//! thread-cache refill, a crossing of the thread's byte threshold) is the
//! windows' to sample. Where the function the slow path calls for requests
//! no thread cache holds was found, that is probed instead, and neither
//! small nor middle-sized requests trap.
use aya_ebpf::{
    helpers::{bpf_probe_read_kernel, bpf_probe_read_user, generated::bpf_get_current_task},
    programs::ProbeContext,
};
use profiler_common::{FastPathConfig, FastPathKey, PendingCall, cookie, pending_kind, tls};

use crate::{
    alloc::on_allocation,
    maps::{FAST_PATHS, TASK_FSBASE},
    sampling::{Args, Thread, count_hit, probe_cookie},
};

const POINTER: PendingCall = PendingCall {
    kind: pending_kind::RETURNED_POINTER,
    addr: 0,
};

/// Returns whether the call's return half is needed.
#[inline(always)]
pub(crate) fn on_slow_path(ctx: &ProbeContext, thread: &Thread) -> bool {
    let thread = &Thread {
        past_entry: true,
        ..*thread
    };
    let size = Args::of(ctx).arg(0);
    let Some(Counters {
        config, allocated, ..
    }) = counters(ctx, thread)
    else {
        return on_allocation(ctx, thread, size, 0, POINTER);
    };
    if size > config.large_above {
        return on_allocation(ctx, thread, size, 0, POINTER);
    }
    count_hit(ctx);
    // The small ones are the windows' to sample. The thread's counter as
    // first seen here (within its first 64 KiB since the attach: a refill
    // or a crossing of its threshold) is where its first window's bytes
    // start.
    // SAFETY: the entry belongs to this thread; only this thread writes it.
    unsafe {
        if (*thread.state).first_allocated == 0 {
            (*thread.state).first_allocated = allocated.max(1);
        }
    }
    false
}

/// jemalloc's `arena_malloc_hard(tsdn, arena, size, ind, zero)`, where the
/// slow path sends the requests no thread cache holds: counted when called
/// from the slow path for more than the copy's limit (its other callers
/// are probed at their own entries; a thread without a cache sends its
/// small requests here too, the windows' to sample). Returns whether the
/// call's return half is needed.
#[inline(always)]
pub(crate) fn on_large_request(ctx: &ProbeContext, thread: &Thread) -> bool {
    let thread = &Thread {
        past_entry: true,
        ..*thread
    };
    let Some(config) = fast_path(ctx, thread) else {
        count_hit(ctx);
        return false;
    };
    let args = Args::of(ctx);
    let slot = args.stack_pointer + cookie::return_address_offset(probe_cookie(ctx));
    // SAFETY: reading user memory through the helper, which faults safely.
    let caller = unsafe { bpf_probe_read_user(slot as *const u64) }.unwrap_or(0);
    let [start, end] = config.callers;
    let size = args.arg(2);
    if caller.wrapping_sub(start) >= end.wrapping_sub(start) || size <= config.large_above {
        count_hit(ctx);
        return false;
    }
    on_allocation(ctx, thread, size, 0, POINTER)
}

/// What userspace told the kernel of the probed copy in this thread's
/// process.
#[inline(always)]
fn fast_path(ctx: &ProbeContext, thread: &Thread) -> Option<FastPathConfig> {
    let key = FastPathKey {
        pid: (thread.id >> 32) as u32,
        instance: cookie::instance(probe_cookie(ctx)),
    };
    // SAFETY: a lookup in a map of plain values.
    unsafe { FAST_PATHS.get(key) }.copied()
}

/// The current thread's allocated-bytes counter of a probed copy.
#[derive(Clone, Copy)]
pub(crate) struct Counters {
    /// The copy's layout, as userspace told it.
    pub config: FastPathConfig,
    /// The thread's allocated bytes.
    pub allocated: u64,
    /// Where they are, and the thread's fs base they were found from.
    pub at: u64,
    pub fsbase: u64,
}

/// The copy's counter layout, and the thread's allocated bytes and where
/// they are, read from its TLS.
#[inline(always)]
pub(crate) fn counters(ctx: &ProbeContext, thread: &Thread) -> Option<Counters> {
    let config = fast_path(ctx, thread)?;
    let fsbase = current_fsbase()?;
    let read = |at: u64| {
        // SAFETY: reading user memory through the helper, which faults safely.
        unsafe { bpf_probe_read_user(at as *const u64) }.ok()
    };
    let at = tls::counter_address(&config, fsbase, read)?;
    Some(Counters {
        config,
        allocated: read(at)?,
        at,
        fsbase,
    })
}

/// The current thread's fs base, where its TLS block ends.
#[inline(always)]
pub(crate) fn current_fsbase() -> Option<u64> {
    // SAFETY: a plain read of a global userspace set at load time.
    let fsbase_offset = unsafe { core::ptr::read_volatile(&TASK_FSBASE) };
    if fsbase_offset == 0 {
        return None;
    }
    // SAFETY: the helper returns the current task; reads fault safely.
    unsafe {
        let task = bpf_get_current_task();
        bpf_probe_read_kernel((task + fsbase_offset) as *const u64).ok()
    }
}

/// jemalloc 5.3's size class of a request (its `sz_s2u`): 8 bytes, 16-byte
/// steps to 64, then four classes per doubling.
#[inline(always)]
pub(crate) fn usable_size(size: u64) -> u64 {
    if size <= 8 {
        return 8;
    }
    if size <= 64 {
        return (size + 15) & !15;
    }
    let mut delta = 16u64;
    let mut limit = 128u64;
    // Bounded for the verifier: the doublings to 2^62.
    for _ in 0..56 {
        if limit >= size {
            break;
        }
        delta <<= 1;
        limit <<= 1;
    }
    (size + delta - 1) & !(delta - 1)
}
