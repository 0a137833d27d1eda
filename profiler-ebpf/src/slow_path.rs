//! jemalloc's slow path (`malloc_default`), probed beside `malloc` and
//! `operator new`'s windowed entry probes: every request above the fast
//! path's largest reaches it and is sampled by its size there, so a big
//! buffer is never left to a window's chance. A small request here (a
//! thread-cache refill, a crossing of the thread's byte threshold) is the
//! windows' to sample. Where frees are not followed, the probe sits past
//! the slow path's own size check instead, and small calls never trap.
use aya_ebpf::{
    bindings::pt_regs,
    helpers::{bpf_probe_read_kernel, bpf_probe_read_user, generated::bpf_get_current_task},
    programs::ProbeContext,
};
use profiler_common::{FastPathConfig, FastPathKey, PendingCall, cookie, gpr, pending_kind};

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
    let Some((config, allocated)) = counters(ctx, thread) else {
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

/// A request above the fast path's largest, probed inside the slow path
/// past its own size check, where no small call comes: its size is in the
/// register the copy's config names. No return half (`--track
/// allocations`).
#[inline(always)]
pub(crate) fn on_large_request(ctx: &ProbeContext, thread: &Thread) {
    let thread = &Thread {
        past_entry: true,
        ..*thread
    };
    let key = FastPathKey {
        pid: (thread.id >> 32) as u32,
        instance: cookie::instance(probe_cookie(ctx)),
    };
    // SAFETY: a lookup in a map of plain values.
    let Some(config) = (unsafe { FAST_PATHS.get(key) }) else {
        count_hit(ctx);
        return;
    };
    // SAFETY: `regs` points at the probe's pt_regs, readable for its lifetime.
    let size = register(unsafe { &*ctx.regs }, config.size_register);
    on_allocation(ctx, thread, size, 0, POINTER);
}

/// General-purpose register `number` (one of [`gpr`]). Read through the
/// helper: the compiler merges the arms into one load from a computed
/// offset, which the verifier refuses as a direct access to the context.
#[inline(always)]
fn register(regs: &pt_regs, number: u64) -> u64 {
    let field = match number {
        gpr::RAX => &regs.rax,
        gpr::RBX => &regs.rbx,
        gpr::RCX => &regs.rcx,
        gpr::RDX => &regs.rdx,
        gpr::RSI => &regs.rsi,
        gpr::RDI => &regs.rdi,
        gpr::RBP => &regs.rbp,
        gpr::R8 => &regs.r8,
        gpr::R9 => &regs.r9,
        gpr::R10 => &regs.r10,
        gpr::R11 => &regs.r11,
        gpr::R12 => &regs.r12,
        gpr::R13 => &regs.r13,
        gpr::R14 => &regs.r14,
        _ => &regs.r15,
    };
    // SAFETY: a field of the probe's pt_regs; the helper faults safely.
    unsafe { bpf_probe_read_kernel(field as *const u64) }.unwrap_or(0)
}

/// The copy's counter layout and the thread's allocated bytes, read from
/// its TLS block.
#[inline(always)]
pub(crate) fn counters(ctx: &ProbeContext, thread: &Thread) -> Option<(FastPathConfig, u64)> {
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
    Some((config, allocated))
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
