//! What the probes do: the byte countdown, and recording sampled calls.
use core::{ffi::c_void, mem::size_of, ptr::addr_of_mut};

use aya_ebpf::{
    EbpfContext,
    bindings::{BPF_F_USER_STACK, BPF_RB_AVAIL_DATA},
    helpers::{
        bpf_get_current_pid_tgid, bpf_ktime_get_ns, bpf_probe_read_user,
        generated::{
            bpf_get_attach_cookie, bpf_get_prandom_u32, bpf_get_stack,
            bpf_probe_read_user as bpf_probe_read_user_raw,
        },
    },
    programs::ProbeContext,
};
use profiler_common::{
    AllocEvent, AllocReturnEvent, AllocStackEvent, Counter, EventHeader, FP_CHECK_ONE_IN,
    FreeEvent, LiveKey, MAX_STACK_DEPTH, PendingCall, ResizeEvent, STACK_COPY_BYTES,
    STACK_COPY_PAGE, STACK_COPY_PAGES, ThreadState, UserRegs, cookie, event_kind, pending_kind,
    sampling,
};

use crate::maps::{
    COUNTERS, EVENTS, EXP_QUANTILES, FP_TRUSTED, PENDING, PROBE_HITS, SAMPLED, THREADS,
};

/// The registers a probe reads, copied once from the context.
pub struct Args {
    regs: [u64; 4],
    pub stack_pointer: u64,
}

impl Args {
    #[inline(always)]
    pub fn of(ctx: &ProbeContext) -> Self {
        // SAFETY: `regs` points at the probe's pt_regs, readable for its lifetime.
        let regs = unsafe { &*ctx.regs };
        Self {
            regs: [regs.rdi, regs.rsi, regs.rdx, regs.rcx],
            stack_pointer: regs.rsp,
        }
    }

    #[inline(always)]
    pub fn arg(&self, n: usize) -> u64 {
        match n {
            0 => self.regs[0],
            1 => self.regs[1],
            2 => self.regs[2],
            _ => self.regs[3],
        }
    }
}

/// `MALLOCX_LG_ALIGN(la)` stores lg(alignment) in the low 6 bits.
#[inline(always)]
pub fn mallocx_alignment(flags: u64) -> u64 {
    let lg = flags & 0x3f;
    if lg == 0 { 0 } else { 1u64 << lg }
}

/// Counts a hit of an entry point that does not allocate.
#[inline(always)]
pub fn count_entry(ctx: &ProbeContext) {
    count_hit(ctx);
}

/// One hit of the entry point this program was attached to.
#[inline(always)]
fn count_hit<C: EbpfContext>(ctx: &C) {
    let index = cookie::probe_index(probe_cookie(ctx));
    let index = if index < profiler_common::MAX_COUNTED_PROBES {
        index
    } else {
        profiler_common::MAX_COUNTED_PROBES - 1
    };
    if let Some(value) = PROBE_HITS.get_ptr_mut(index) {
        // SAFETY: per-CPU slot, no concurrent writer on this CPU.
        unsafe { *value += 1 };
    }
}

#[inline(always)]
fn count(counter: Counter) {
    if let Some(value) = COUNTERS.get_ptr_mut(counter as u32) {
        // SAFETY: per-CPU slot, no concurrent writer on this CPU.
        unsafe { *value += 1 };
    }
}

/// The next countdown: exponential with the mean baked into the table.
#[inline(always)]
fn draw_countdown() -> i64 {
    // SAFETY: plain helper call.
    let random = unsafe { bpf_get_prandom_u32() };
    let (zeros, index) = sampling::split_random(random);
    let ln2 = EXP_QUANTILES.get(sampling::LN2_INDEX).copied().unwrap_or(0);
    let quantile = EXP_QUANTILES.get(index).copied().unwrap_or(0);
    (zeros as u64 * ln2 + quantile) as i64
}

#[inline(always)]
fn header(kind: u32, id: u64, probe: u32) -> EventHeader {
    EventHeader {
        kind,
        tid: id as u32,
        pid: (id >> 32) as u32,
        probe,
        // SAFETY: plain helper call.
        time_ns: unsafe { bpf_ktime_get_ns() },
    }
}

#[inline(always)]
fn probe_cookie<C: EbpfContext>(ctx: &C) -> u64 {
    // SAFETY: the context is the one this program was called with.
    unsafe { bpf_get_attach_cookie(ctx.as_ptr()) }
}

/// This thread's sampling state, created on its first allocation.
pub struct Thread {
    id: u64,
    state: *mut ThreadState,
}

impl Thread {
    #[inline(always)]
    pub fn current() -> Option<Self> {
        let id = bpf_get_current_pid_tgid();
        if let Some(state) = THREADS.get_ptr_mut(id) {
            return Some(Self { id, state });
        }
        let fresh = ThreadState {
            bytes_until_sample: draw_countdown(),
            return_sp: 0,
        };
        let _ = THREADS.insert(id, fresh, 0);
        let state = THREADS.get_ptr_mut(id)?;
        Some(Self { id, state })
    }

    /// Remembers where `rsp` will be when the call in flight returns.
    #[inline(always)]
    fn expect_return(&self, ctx: &ProbeContext) {
        let args = Args::of(ctx);
        let return_address = args.stack_pointer + cookie::return_address_offset(probe_cookie(ctx));
        // SAFETY: the entry belongs to this thread; only this thread writes it.
        unsafe { (*self.state).return_sp = return_address + 8 };
    }

    /// Whether `ctx` is the return of this thread's sampled call: after
    /// `ret`, `rsp` is one word above the return address's slot.
    #[inline(always)]
    fn is_return(&self, ctx: &ProbeContext) -> bool {
        let stack_pointer = Args::of(ctx).stack_pointer;
        // SAFETY: as above.
        unsafe {
            if (*self.state).return_sp != stack_pointer {
                return false;
            }
            (*self.state).return_sp = 0;
        }
        true
    }
}

/// The body of a uprobe-session program: the entry returns 0 to have its
/// return half run (sampled calls) and 1 to skip it (all others).
#[inline(always)]
pub fn session(ctx: &ProbeContext, entry: fn(&ProbeContext, &Thread) -> bool) -> u32 {
    let Some(thread) = Thread::current() else {
        return 1;
    };
    if thread.is_return(ctx) {
        // SAFETY: `regs` points at the probe's pt_regs.
        let returned = unsafe { (*ctx.regs).rax };
        on_return(ctx, returned);
        return 0;
    }
    if entry(ctx, &thread) { 0 } else { 1 }
}

/// Counts `size` bytes down on this thread; records the call if it crossed.
/// Returns whether the call's return half is needed.
#[inline(always)]
pub fn on_allocation(
    ctx: &ProbeContext,
    thread: &Thread,
    size: u64,
    align: u64,
    pending: PendingCall,
) -> bool {
    count(Counter::AllocCalls);
    count_hit(ctx);
    let size_counted = if size > i64::MAX as u64 {
        i64::MAX
    } else {
        size as i64
    };
    let state = thread.state;
    // SAFETY: the entry belongs to this thread; only this thread writes it.
    unsafe {
        let remaining = (*state).bytes_until_sample - size_counted;
        if remaining > 0 {
            (*state).bytes_until_sample = remaining;
            return false;
        }
        (*state).bytes_until_sample = draw_countdown();
    }
    record_allocation(ctx, thread, size, align, pending)
}

#[inline(always)]
fn record_allocation(
    ctx: &ProbeContext,
    thread: &Thread,
    size: u64,
    align: u64,
    pending: PendingCall,
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
    if copy && !frame_pointers_suffice(id) {
        if EVENTS.query(BPF_RB_AVAIL_DATA as u64) <= busy_bytes
            && let Some(mut entry) = EVENTS.reserve::<AllocStackEvent>(0)
        {
            let event = entry.as_mut_ptr();
            // SAFETY: `event` points at reserved ring-buffer memory of the
            // right size; written in place, too big for the BPF stack.
            unsafe {
                let sp = (*ctx.regs).rsp;
                fill_alloc(
                    ctx,
                    id,
                    size,
                    align,
                    event_kind::ALLOC_WITH_STACK,
                    addr_of_mut!((*event).alloc),
                );
                let copied = copy_stack(addr_of_mut!((*event).stack_copy) as *mut u8, sp);
                addr_of_mut!((*event).stack_copy_bytes).write(copied);
            }
            entry.submit(0);
            thread.expect_return(ctx);
            return true;
        }
        count(Counter::StackCopiesSkipped);
    }
    let Some(mut entry) = EVENTS.reserve::<AllocEvent>(0) else {
        count(Counter::RingBufferFull);
        let _ = PENDING.remove(id);
        return false;
    };
    // SAFETY: as above.
    unsafe { fill_alloc(ctx, id, size, align, event_kind::ALLOC, entry.as_mut_ptr()) };
    entry.submit(0);
    thread.expect_return(ctx);
    true
}

/// Whether this process's frame-pointer walks proved right (userspace
/// compared them with DWARF unwinds): then most samples skip the copy,
/// one in [`FP_CHECK_ONE_IN`] keeps it so that the check goes on.
#[inline(always)]
fn frame_pointers_suffice(id: u64) -> bool {
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
unsafe fn fill_alloc(
    ctx: &ProbeContext,
    id: u64,
    size: u64,
    align: u64,
    kind: u32,
    event: *mut AllocEvent,
) {
    let cookie = probe_cookie(ctx);
    let args = Args::of(ctx);
    let return_address = args.stack_pointer + cookie::return_address_offset(cookie);
    // SAFETY: the caller guarantees `event`; helpers fault safely.
    unsafe {
        addr_of_mut!((*event).header).write(header(kind, id, cookie::probe_index(cookie)));
        addr_of_mut!((*event).size).write(size);
        addr_of_mut!((*event).align).write(align);
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

/// Set by userspace (`globals::COPY_STACK`): 0 when stacks are walked by
/// frame pointers alone (`--unwind fp`).
#[unsafe(no_mangle)]
static COPY_STACK: u8 = 1;

/// Set by userspace (`globals::RING_BUSY_BYTES`).
#[unsafe(no_mangle)]
static RING_BUSY_BYTES: u64 = 4 << 20;

/// Copies the user stack from `sp` up into `buffer` (STACK_COPY_BYTES long):
/// up to the next page boundary, then whole pages, stopping at the first
/// page that cannot be read (the stack's end, or a page not resident).
/// Returns how many bytes were copied.
#[inline(always)]
fn copy_stack(buffer: *mut u8, sp: u64) -> u64 {
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

#[inline(always)]
fn live_key(id: u64, cookie: u64, ptr: u64) -> LiveKey {
    LiveKey {
        pid: (id >> 32) as u32,
        instance: cookie::instance(cookie),
        ptr,
    }
}

/// A free: costs one lookup unless the pointer was sampled.
#[inline(always)]
pub fn on_free(ctx: &ProbeContext, ptr: u64) {
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
    let _ = SAMPLED.remove(key);
    let event = FreeEvent {
        header: header(event_kind::FREE, id, cookie::probe_index(probe_cookie)),
        ptr,
    };
    if EVENTS.output::<FreeEvent>(event, 0).is_err() {
        count(Counter::RingBufferFull);
    }
}

/// xallocx of a sampled pointer: its new size comes at return. Returns
/// whether the return half is needed.
#[inline(always)]
pub fn on_resize_entry(ctx: &ProbeContext, thread: &Thread, ptr: u64) -> bool {
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
pub fn on_return<C: EbpfContext>(ctx: &C, returned: u64) {
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
fn finish_allocation(id: u64, probe_cookie: u64, ptr: u64) {
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
