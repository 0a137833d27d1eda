//! Allocation calls: the countdown crossed, a sampled call is recorded
//! with its stack (copied for DWARF unwinding, or walked by frame pointers).
use core::{ffi::c_void, mem::size_of, ptr::addr_of_mut};

use aya_ebpf::{
    EbpfContext,
    bindings::{BPF_F_USER_STACK, BPF_RB_AVAIL_DATA},
    helpers::{
        bpf_probe_read_user,
        generated::{
            bpf_get_prandom_u32, bpf_get_stack, bpf_probe_read_user as bpf_probe_read_user_raw,
        },
    },
    programs::ProbeContext,
};
use profiler_common::{
    AllocEvent, AllocStackEvent, Counter, EventKind, FP_CHECK_ONE_IN, MAX_STACK_DEPTH,
    MAX_WINDOW_SHIFT, PendingCall, SMALL_STACK_COPY_BYTES, STACK_COPY_BYTES, STACK_COPY_PAGE,
    STACK_COPY_PAGES, UserRegs, cookie,
};

use crate::{
    maps::{COPY_STACK, EVENTS, FP_TRUSTED, PENDING, RING_BUSY_BYTES, SAMPLE_INTERVAL},
    python, ring,
    sampling::{Args, Thread, count, count_hit, draw_countdown, header_at, now, probe_cookie},
    slow_path::{counters, usable_size},
};

/// Counts `size` bytes down on this thread; records the call if it crossed.
/// A call made by another probed allocation call is not counted again.
/// Returns whether the call's return half is needed.
#[inline(always)]
pub(crate) fn on_allocation(
    ctx: &ProbeContext,
    thread: &Thread,
    size: u64,
    align: u64,
    pending: PendingCall,
) -> bool {
    count_hit(ctx);
    if thread.is_inner_call(ctx) {
        count(Counter::InnerCalls);
        return false;
    }
    count(Counter::AllocCalls);
    if cookie::is_windowed(probe_cookie(ctx)) {
        return on_windowed_allocation(ctx, thread, (size, align), pending);
    }
    let wanted = count_down(ctx, thread, size, align, pending, 0).unwrap_or(false);
    thread.note_forwarder(ctx);
    wanted
}

/// A call inside a sampling window: its bytes count 2^window_shift times
/// (the event carries them as its window), and its thread notes jemalloc's
/// allocated-bytes counter, by which userspace weighs the window's samples.
/// A request above the copy's limit is left to the probe where jemalloc's
/// slow path takes it.
#[inline(always)]
fn on_windowed_allocation(
    ctx: &ProbeContext,
    thread: &Thread,
    (size, align): (u64, u64),
    pending: PendingCall,
) -> bool {
    let Some(counters) = counters(ctx, thread) else {
        return false;
    };
    let (config, allocated) = (counters.config, counters.allocated);
    if size > config.large_above {
        // The slow path samples it inside this call. A uretprobe here (no
        // uprobe sessions: before 6.13) replaces the caller's return
        // address with the kernel's trampoline before then: the sample
        // gets it back from this note.
        thread.note_resize_return(ctx);
        return false;
    }
    let state = thread.state;
    let usable = usable_size(size);
    // SAFETY: the entry belongs to this thread; only this thread writes it.
    unsafe {
        if (*state).window != config.window {
            (*state).window = config.window;
            (*state).window_first = allocated;
            (*state).window_sent_bytes = 0;
            (*state).window_lost_bytes = 0;
            (*state).window_thinned = 0;
        }
        (*state).window_end = allocated.wrapping_add(usable);
        (*state).counter_at = counters.at;
        (*state).counter_fsbase = counters.fsbase;
    }
    let window = if ring_crowded() {
        count(Counter::CrowdedCalls);
        (size >> CROWDED_SHIFT).max(1)
    } else {
        size.max(1) << window_shift(thread, config.window_shift)
    };
    let crossed = count_down(ctx, thread, size, align, pending, window);
    if let Some(sent) = crossed {
        let bytes = stands_for(usable, window);
        // SAFETY: as above.
        unsafe {
            if sent {
                (*state).window_sent_bytes = (*state).window_sent_bytes.wrapping_add(bytes);
            } else {
                (*state).window_lost_bytes = (*state).window_lost_bytes.wrapping_add(bytes);
            }
        }
    }
    thread.note_forwarder(ctx);
    crossed.unwrap_or(false)
}

/// A windowed call made while the ring buffer is three quarters full
/// counts 2^-CROWDED_SHIFT of its bytes: sampled that much sparser, each
/// sample standing for that much more, so that a burst memprobe cannot
/// unwind as fast as it comes (every call probed, just after the attach)
/// loses fewer samples, whose loss nothing makes up for in a window that
/// stays open.
const CROWDED_SHIFT: u64 = 3;

/// Whether the ring buffer is three quarters full.
#[inline(always)]
fn ring_crowded() -> bool {
    // SAFETY: a plain read of a global userspace set at load time.
    let busy_bytes = unsafe { core::ptr::read_volatile(&RING_BUSY_BYTES) };
    EVENTS.query(BPF_RB_AVAIL_DATA as u64) > three_quarters(busy_bytes)
}

/// Three quarters of the ring buffer, from its half (`busy_bytes`).
#[inline(always)]
fn three_quarters(busy_bytes: u64) -> u64 {
    busy_bytes + busy_bytes / 2
}

/// The bytes a sampled call of `usable` bytes, counted as `window`, stands
/// for: `usable` over the chance it was sampled, 1 - e^-x for x = window
/// over the interval, by 1/x + 1/2 + x/12 (within 3% up to x = 3), and 1
/// past that.
#[inline(always)]
fn stands_for(usable: u64, window: u64) -> u64 {
    // SAFETY: a plain read of a global userspace set at load time.
    let interval = unsafe { core::ptr::read_volatile(&SAMPLE_INTERVAL) };
    if window >= interval.wrapping_mul(3) {
        return usable;
    }
    // Checked: a division the compiler cannot prove safe would panic,
    // which the verifier refuses.
    let by_window = |bytes: u64| bytes.checked_div(window).unwrap_or(0);
    let by_interval = |bytes: u64| bytes.checked_div(interval.wrapping_mul(12)).unwrap_or(0);
    by_window(usable * interval) + usable / 2 + by_interval(usable * window)
}

/// How much denser than an entry probe this windowed call is sampled, as
/// a power of two: the window's, or none from the time the ring buffer is
/// over half full (where samples' stack copies shrink) to the window's end.
/// A window's calls trap, and where a program allocates fast its dense
/// samples came faster than memprobe unwinds: the ring filled, and the
/// frees and returns behind them waited or were lost. Each record carries
/// the bytes its call was counted as, so its weight stays right. For the
/// rest of the window, not only while the ring is full: densely again
/// after each drain, a window's samples were mostly the first call to
/// cross after one, which is not every call's fair share.
#[inline(always)]
fn window_shift(thread: &Thread, wanted: u64) -> u64 {
    // SAFETY: the entry belongs to this thread; only this thread writes it.
    if wanted == 0 || unsafe { (*thread.state).window_thinned } != 0 {
        return 0;
    }
    // SAFETY: a plain read of a global userspace set at load time.
    let busy_bytes = unsafe { core::ptr::read_volatile(&RING_BUSY_BYTES) };
    if EVENTS.query(BPF_RB_AVAIL_DATA as u64) > busy_bytes {
        count(Counter::WindowsThinned);
        // SAFETY: as above.
        unsafe { (*thread.state).window_thinned = 1 };
        return 0;
    }
    wanted.min(MAX_WINDOW_SHIFT)
}

/// Counts `counted` bytes (the call's, or its window's) down on this
/// thread: `None` if the countdown did not cross, else whether the call
/// was recorded (and its return half is needed).
#[inline(always)]
fn count_down(
    ctx: &ProbeContext,
    thread: &Thread,
    size: u64,
    align: u64,
    pending: PendingCall,
    window: u64,
) -> Option<bool> {
    // A window's bytes are what is counted down, the call's size otherwise.
    let counted = if window > 0 { window } else { size };
    let size_counted = if counted > i64::MAX as u64 {
        i64::MAX
    } else {
        counted as i64
    };
    let state = thread.state;
    // SAFETY: the entry belongs to this thread; only this thread writes it.
    unsafe {
        let remaining = (*state).bytes_until_sample - size_counted;
        if remaining > 0 {
            (*state).bytes_until_sample = remaining;
            return None;
        }
        (*state).bytes_until_sample = draw_countdown();
    }
    let recorded = record_allocation(ctx, thread, size, align, pending, window);
    if recorded {
        thread.expect_return(ctx);
    }
    Some(recorded)
}

/// Sends a sampled call and leaves `pending` for its return half; whether
/// it was sent. Its caller knows whether a return half follows.
#[inline(always)]
pub(crate) fn record_allocation(
    ctx: &ProbeContext,
    thread: &Thread,
    size: u64,
    align: u64,
    pending: PendingCall,
    window: u64,
) -> bool {
    count(Counter::SampledCalls);
    let id = thread.id;
    if PENDING.insert(id, pending, 0).is_err() {
        count(Counter::PendingFull);
        return false;
    }
    // SAFETY: plain reads of globals userspace set at load time.
    let (copy, busy_bytes) = unsafe {
        (
            core::ptr::read_volatile(&COPY_STACK) != 0,
            core::ptr::read_volatile(&RING_BUSY_BYTES),
        )
    };
    // Sent first, and stamped as the call's record: userspace meets the
    // thread's Python frames before the call they belong to.
    let stamp = now();
    python::send_python_stack(id, stamp, cookie::probe_index(probe_cookie(ctx)));
    let call = (size, align, window, stamp);
    let sent = send_alloc(ctx, thread, call, (copy, busy_bytes));
    if !sent {
        let _ = PENDING.remove(id);
    }
    sent
}

/// Sends a sampled call's record: with a stack copy where wanted and the
/// ring has room, without one otherwise; false if nothing could be sent.
#[inline(always)]
fn send_alloc(
    ctx: &ProbeContext,
    thread: &Thread,
    call: (u64, u64, u64, u64),
    (copy, busy_bytes): (bool, u64),
) -> bool {
    if copy && (thread.past_entry || !frame_pointers_suffice(thread.id)) {
        let queued = EVENTS.query(BPF_RB_AVAIL_DATA as u64);
        if queued <= busy_bytes && send_with_stack::<STACK_COPY_BYTES>(ctx, thread, call) {
            return true;
        }
        // Busy: a small copy still unwinds the frames nearest the call,
        // until the ring is three quarters full. A call sampled past its
        // entry (the slow path's big requests) takes one while the ring
        // has room: its frame-pointer walk starts inside an allocator
        // built without them and names no caller, and such calls are few.
        if (thread.past_entry || queued <= three_quarters(busy_bytes))
            && send_with_stack::<SMALL_STACK_COPY_BYTES>(ctx, thread, call)
        {
            count(Counter::SmallStackCopies);
            return true;
        }
        count(Counter::StackCopiesSkipped);
    }
    let Some(mut entry) = EVENTS.reserve::<AllocEvent>(0) else {
        count(Counter::RingBufferFull);
        return false;
    };
    let event = entry.as_mut_ptr();
    // SAFETY: `entry` is reserved ring-buffer memory for an `AllocEvent`.
    unsafe {
        fill_alloc(ctx, thread, call, EventKind::Alloc, event);
        addr_of_mut!((*event).send_nanos).write(since(call.3));
    }
    ring::submit(entry);
    true
}

/// Sends a sampled call with `N` bytes of its stack (the whole copy, or the
/// small one); false if the ring buffer had no room.
#[inline(always)]
fn send_with_stack<const N: usize>(
    ctx: &ProbeContext,
    thread: &Thread,
    call: (u64, u64, u64, u64),
) -> bool {
    let Some(mut entry) = EVENTS.reserve::<AllocStackEvent<N>>(0) else {
        return false;
    };
    let kind = if N == STACK_COPY_BYTES {
        EventKind::AllocWithStack
    } else {
        EventKind::AllocWithSmallStack
    };
    let event = entry.as_mut_ptr();
    // SAFETY: `event` points at reserved ring-buffer memory of the right
    // size; written in place, too big for the BPF stack.
    unsafe {
        let sp = (*ctx.regs).rsp;
        fill_alloc(ctx, thread, call, kind, addr_of_mut!((*event).alloc));
        let buffer = addr_of_mut!((*event).stack_copy) as *mut u8;
        let copied = if N == STACK_COPY_BYTES {
            copy_stack(buffer, sp)
        } else {
            copy_small_stack(buffer, sp)
        };
        addr_of_mut!((*event).stack_copy_bytes).write(copied);
        addr_of_mut!((*event).alloc.send_nanos).write(since(call.3));
    }
    ring::submit(entry);
    true
}

/// Nanoseconds from `stamp` (the sample's start) to now: each send path
/// writes its own just before it submits, so that the verifier walks no
/// join after them.
#[inline(always)]
fn since(stamp: u64) -> u64 {
    now().saturating_sub(stamp)
}

/// Whether this process's frame-pointer walks proved right (userspace
/// compared them with DWARF unwinds): then most samples skip the copy,
/// one in [`FP_CHECK_ONE_IN`] keeps it so that the check goes on.
#[inline(always)]
pub(crate) fn frame_pointers_suffice(id: u64) -> bool {
    let pid = (id >> 32) as u32;
    // SAFETY: a lookup in a map of plain values.
    if unsafe { FP_TRUSTED.get(pid) }.is_none() {
        return false;
    }
    // SAFETY: plain helper call.
    if unsafe { bpf_get_prandom_u32() } % FP_CHECK_ONE_IN == 0 {
        return false;
    }
    count(Counter::FramePointerFastPath);
    true
}

/// Writes a sampled call's record in place.
///
/// # Safety
/// `event` must point at writable memory for an `AllocEvent`.
#[inline(always)]
pub(crate) unsafe fn fill_alloc(
    ctx: &ProbeContext,
    thread: &Thread,
    (size, align, window, stamp): (u64, u64, u64, u64),
    kind: EventKind,
    event: *mut AllocEvent,
) {
    let cookie = probe_cookie(ctx);
    let args = Args::of(ctx);
    let return_address = args.stack_pointer + cookie::return_address_offset(cookie);
    // SAFETY: the caller guarantees `event`; helpers fault safely; the
    // thread's entry is only written by this thread.
    unsafe {
        addr_of_mut!((*event).hijacked_slot).write((*thread.state).resize_slot);
        addr_of_mut!((*event).hijacked_return).write((*thread.state).resize_return);
        let id = thread.id;
        let probe = cookie::probe_index(cookie);
        addr_of_mut!((*event).header).write(header_at(kind, id, probe, stamp));
        addr_of_mut!((*event).size).write(size);
        addr_of_mut!((*event).align).write(align);
        addr_of_mut!((*event).window).write(window);
        addr_of_mut!((*event).caller)
            .write(bpf_probe_read_user(return_address as *const u64).unwrap_or(0));
        let stack_bytes = bpf_get_stack(
            ctx.as_ptr(),
            addr_of_mut!((*event).stack) as *mut c_void,
            (MAX_STACK_DEPTH * size_of::<u64>()) as u32,
            BPF_F_USER_STACK as u64,
        );
        if stack_bytes < 0 {
            count(Counter::StackErrors);
        }
        addr_of_mut!((*event).stack_bytes).write(stack_bytes);
        let regs = &*ctx.regs;
        addr_of_mut!((*event).regs).write(UserRegs {
            ip: regs.rip,
            sp: regs.rsp,
            bp: regs.rbp,
        });
    }
}
/// Copies [`SMALL_STACK_COPY_BYTES`] of user stack from `sp` into `buffer`,
/// or, where the stack ends sooner, up to the page boundary. Returns how
/// many bytes were copied.
#[inline(always)]
fn copy_small_stack(buffer: *mut u8, sp: u64) -> u64 {
    const SMALL: u64 = SMALL_STACK_COPY_BYTES as u64;
    let read = |len: u64| {
        // SAFETY: `len` <= SMALL, the buffer's size; the helper faults safely.
        unsafe { bpf_probe_read_user_raw(buffer as *mut c_void, len as u32, sp as *const c_void) }
    };
    if read(SMALL) >= 0 {
        return SMALL;
    }
    let to_page_end = STACK_COPY_PAGE as u64 - (sp & (STACK_COPY_PAGE as u64 - 1));
    let first = to_page_end.min(SMALL);
    if read(first) >= 0 { first } else { 0 }
}

/// Copies the user stack from `sp` up into `buffer` (STACK_COPY_BYTES long):
/// up to the next page boundary, then whole pages, stopping at the first
/// page that cannot be read (the stack's end, or a page not resident).
/// Returns how many bytes were copied.
#[inline(always)]
pub(crate) fn copy_stack(buffer: *mut u8, sp: u64) -> u64 {
    const PAGE: u64 = STACK_COPY_PAGE as u64;
    let first = PAGE - (sp & (PAGE - 1));
    // SAFETY: `first` <= PAGE <= STACK_COPY_BYTES; the helper faults safely.
    if unsafe { bpf_probe_read_user_raw(buffer as *mut c_void, first as u32, sp as *const c_void) }
        < 0
    {
        return 0;
    }
    let mut copied = first;
    for _ in 1..STACK_COPY_PAGES {
        // Keeps the verifier's bound: a whole page still fits after `copied`.
        if copied > (STACK_COPY_BYTES as u64) - PAGE {
            break;
        }
        // SAFETY: `copied + PAGE` <= STACK_COPY_BYTES, checked just above.
        let read = unsafe {
            bpf_probe_read_user_raw(
                buffer.add(copied as usize) as *mut c_void,
                PAGE as u32,
                (sp + copied) as *const c_void,
            )
        };
        if read < 0 {
            break;
        }
        copied += PAGE;
    }
    copied
}
