//! Frees, resizes and returns: one lookup unless the pointer or the call
//! was sampled.

use aya_ebpf::{
    EbpfContext,
    helpers::{bpf_get_current_pid_tgid, bpf_probe_read_user},
    programs::ProbeContext,
};
use profiler_common::{
    AllocReturnEvent, Counter, EventKind, FreeEvent, LiveKey, PendingCall, ResizeEvent, cookie,
    pending_kind,
};

use crate::{
    maps::PENDING,
    ring, sampled,
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
    free_if_sampled(ctx, ptr, EventKind::Free);
}

/// `realloc` or `rallocx` of `ptr` to `size`: the old pointer is freed
/// now, at the entry, since the call frees it inside and another thread
/// may get the region before the call returns. Returns whether the free
/// is to be undone if the call fails (a sampled pointer, a size that is
/// not 0: a null return then means failure, not a free).
#[inline(always)]
pub(crate) fn on_free_in_resize(ctx: &ProbeContext, ptr: u64, size: u64) -> bool {
    free_if_sampled(ctx, ptr, EventKind::FreeInResize) && size != 0
}

/// Removes a sampled `ptr` from the set and reports it (as `kind`);
/// whether it was sampled and reported.
#[inline(always)]
fn free_if_sampled(ctx: &ProbeContext, ptr: u64, kind: EventKind) -> bool {
    count(Counter::FreeCalls);
    if ptr == 0 || !sampled::may_hold(ptr) {
        return false;
    }
    let id = bpf_get_current_pid_tgid();
    let probe_cookie = probe_cookie(ctx);
    let key = live_key(id, probe_cookie, ptr);
    if !sampled::contains(&key) {
        return false;
    }
    let event = FreeEvent {
        header: header(kind, id, cookie::probe_index(probe_cookie)),
        ptr,
    };
    if ring::output(&event).is_err() {
        // Kept in the set: the address's next free, once reused, reports
        // it; dropped here the sample would stay in use for good.
        count(Counter::FreesPutOff);
        return false;
    }
    // Only now: the region is not free (nor reusable) before this returns.
    sampled::remove(&key);
    true
}

/// A resize whose own call is not sampled freed the sampled `ptr`: its
/// return half undoes that if the call failed. Returns whether the return
/// half is needed.
#[inline(always)]
pub(crate) fn expect_restore(ctx: &ProbeContext, thread: &Thread, ptr: u64) -> bool {
    let pending = PendingCall {
        kind: pending_kind::RESTORE_IF_FAILED,
        addr: ptr,
    };
    if PENDING.insert(thread.id, pending, 0).is_err() {
        count(Counter::PendingFull);
        return false;
    }
    thread.expect_return(ctx);
    true
}

/// The resize that freed the sampled `ptr` failed: it was never freed, so
/// no other thread can have it; back into the set, and reported.
#[inline(always)]
fn restore(id: u64, probe_cookie: u64, ptr: u64) {
    let key = live_key(id, probe_cookie, ptr);
    if !sampled::insert(&key) {
        count(Counter::SampledSetFull);
        return;
    }
    let event = FreeEvent {
        header: header(EventKind::Restored, id, cookie::probe_index(probe_cookie)),
        ptr,
    };
    if ring::output(&event).is_err() {
        count(Counter::RingBufferFull);
        // Not followed in userspace: its free must not be reported either.
        sampled::remove(&key);
    }
}

/// xallocx of a sampled pointer: its new size comes at return. Returns
/// whether the return half is needed.
#[inline(always)]
pub(crate) fn on_resize_entry(ctx: &ProbeContext, thread: &Thread, ptr: u64) -> bool {
    let id = thread.id;
    let key = live_key(id, probe_cookie(ctx), ptr);
    if !sampled::holds(&key) {
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
                header: header(EventKind::Resize, id, probe),
                ptr: pending.addr,
                new_size: returned,
            };
            if ring::output(&event).is_err() {
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
        pending_kind::RESTORE_IF_FAILED => {
            if returned == 0 {
                restore(id, probe_cookie, pending.addr);
            }
        }
        _ => {
            // A sampled resize of a sampled pointer (`addr`) that failed.
            if returned == 0 && pending.addr != 0 {
                restore(id, probe_cookie, pending.addr);
            }
            finish_allocation(id, probe_cookie, returned)
        }
    }
}

#[inline(always)]
pub(crate) fn finish_allocation(id: u64, probe_cookie: u64, ptr: u64) {
    let mut untracked = 0;
    if ptr != 0 {
        let key = live_key(id, probe_cookie, ptr);
        if !sampled::insert(&key) {
            count(Counter::SampledSetFull);
            untracked = 1;
        }
    }
    let event = AllocReturnEvent {
        header: header(
            EventKind::AllocReturn,
            id,
            cookie::probe_index(probe_cookie),
        ),
        ptr,
        untracked,
    };
    if ring::output(&event).is_err() {
        count(Counter::RingBufferFull);
    }
}
