//! Frees, resizes and returns: one lookup unless the pointer or the call
//! was sampled.
use aya_ebpf::{
    EbpfContext,
    helpers::{bpf_get_current_pid_tgid, bpf_probe_read_user},
    programs::ProbeContext,
};
use profiler_common::{
    AllocReturnEvent, Counter, FreeEvent, LiveKey, PendingCall, ResizeEvent, cookie, event_kind,
    pending_kind,
};

use crate::{
    maps::{EVENTS, PENDING, SAMPLED},
    sampling::{Thread, count, header, probe_cookie},
};

#[inline(always)]
pub(crate) fn live_key(id: u64, cookie: u64, ptr: u64) -> LiveKey {
    LiveKey {
        pid: (id >> 32) as u32,
        instance: cookie::instance(cookie),
        ptr,
    }
}

/// A free: costs one lookup unless the pointer was sampled.
#[inline(always)]
pub(crate) fn on_free(ctx: &ProbeContext, ptr: u64) {
    count(Counter::FreeCalls);
    if ptr == 0 {
        return;
    }
    let id = bpf_get_current_pid_tgid();
    let probe_cookie = probe_cookie(ctx);
    let key = live_key(id, probe_cookie, ptr);
    if SAMPLED.get_ptr(key).is_none() {
        return;
    }
    let event = FreeEvent {
        header: header(event_kind::FREE, id, cookie::probe_index(probe_cookie)),
        ptr,
    };
    if EVENTS.output::<FreeEvent>(event, 0).is_err() {
        // Kept in the set: the address's next free, once reused, reports
        // it; dropped here the sample would stay in use for good.
        count(Counter::RingBufferFull);
        return;
    }
    // Only now: the region is not free (nor reusable) before this returns.
    let _ = SAMPLED.remove(key);
}

/// xallocx of a sampled pointer: its new size comes at return. Returns
/// whether the return half is needed.
#[inline(always)]
pub(crate) fn on_resize_entry(ctx: &ProbeContext, thread: &Thread, ptr: u64) -> bool {
    let id = thread.id;
    let key = live_key(id, probe_cookie(ctx), ptr);
    if SAMPLED.get_ptr(key).is_none() {
        return false;
    }
    let pending = PendingCall {
        kind: pending_kind::RESIZE,
        addr: ptr,
    };
    if PENDING.insert(id, pending, 0).is_err() {
        count(Counter::PendingFull);
        return false;
    }
    thread.expect_return(ctx);
    true
}

/// Return of a probed call: one lookup unless the call was sampled.
#[inline(always)]
pub(crate) fn on_return<C: EbpfContext>(ctx: &C, returned: u64) {
    count(Counter::ReturnHalves);
    let id = bpf_get_current_pid_tgid();
    let Some(pending) = PENDING.get_ptr(id) else {
        return;
    };
    // SAFETY: the entry is this thread's; copy it out before removing it.
    let pending = unsafe { *pending };
    let _ = PENDING.remove(id);
    let probe_cookie = probe_cookie(ctx);
    let probe = cookie::probe_index(probe_cookie);
    match pending.kind {
        pending_kind::RESIZE => {
            let event = ResizeEvent {
                header: header(event_kind::RESIZE, id, probe),
                ptr: pending.addr,
                new_size: returned,
            };
            if EVENTS.output::<ResizeEvent>(event, 0).is_err() {
                count(Counter::RingBufferFull);
            }
        }
        pending_kind::STORED_POINTER => {
            // posix_memalign returns 0 on success, an errno otherwise.
            let ptr = if returned == 0 {
                // SAFETY: reading user memory through the helper, which faults safely.
                unsafe { bpf_probe_read_user(pending.addr as *const u64) }.unwrap_or(0)
            } else {
                0
            };
            finish_allocation(id, probe_cookie, ptr);
        }
        _ => finish_allocation(id, probe_cookie, returned),
    }
}

#[inline(always)]
pub(crate) fn finish_allocation(id: u64, probe_cookie: u64, ptr: u64) {
    let mut untracked = 0;
    if ptr != 0 {
        let key = live_key(id, probe_cookie, ptr);
        if SAMPLED.insert(key, 0u8, 0).is_err() {
            count(Counter::SampledSetFull);
            untracked = 1;
        }
    }
    let event = AllocReturnEvent {
        header: header(
            event_kind::ALLOC_RETURN,
            id,
            cookie::probe_index(probe_cookie),
        ),
        ptr,
        untracked,
    };
    if EVENTS.output::<AllocReturnEvent>(event, 0).is_err() {
        count(Counter::RingBufferFull);
    }
}
