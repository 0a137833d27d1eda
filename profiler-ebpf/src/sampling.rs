//! The entry side of every probe: the registers it reads, the hit and
//! event counters, and each thread's byte countdown.
use aya_ebpf::{
    EbpfContext,
    helpers::{
        bpf_get_current_pid_tgid, bpf_ktime_get_ns, bpf_probe_read_user,
        generated::{bpf_get_attach_cookie, bpf_get_prandom_u32},
    },
    programs::ProbeContext,
};
use profiler_common::{
    Counter, EventHeader, EventKind, FORWARD_WINDOW, Forwarder, ThreadState, cookie, sampling,
};

use crate::{
    maps::{COUNTERS, EXP_QUANTILES, OWN_TGID, PROBE_HITS, THREADS},
    release::on_return,
};

/// The registers a probe reads, copied once from the context.
pub(crate) struct Args {
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
pub(crate) fn mallocx_alignment(flags: u64) -> u64 {
    let lg = flags & 0x3f;
    if lg == 0 { 0 } else { 1u64 << lg }
}

/// Counts a hit of an entry point that does not allocate.
#[inline(always)]
pub(crate) fn count_entry(ctx: &ProbeContext) {
    count_hit(ctx);
}

/// One hit of the entry point this program was attached to.
#[inline(always)]
pub(crate) fn count_hit<C: EbpfContext>(ctx: &C) {
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
pub(crate) fn count(counter: Counter) {
    if let Some(value) = COUNTERS.get_ptr_mut(counter as u32) {
        // SAFETY: per-CPU slot, no concurrent writer on this CPU.
        unsafe { *value += 1 };
    }
}

/// The next countdown: exponential with the mean baked into the table.
#[inline(always)]
pub(crate) fn draw_countdown() -> i64 {
    // SAFETY: plain helper call.
    let random = unsafe { bpf_get_prandom_u32() };
    let (zeros, index) = sampling::split_random(random);
    let ln2 = EXP_QUANTILES.get(sampling::LN2_INDEX).copied().unwrap_or(0);
    let quantile = EXP_QUANTILES.get(index).copied().unwrap_or(0);
    (zeros as u64 * ln2 + quantile) as i64
}

#[inline(always)]
pub(crate) fn header(kind: EventKind, id: u64, probe: u32) -> EventHeader {
    header_at(kind, id, probe, now())
}

/// A header stamped `time_ns` (records that userspace pairs by it).
#[inline(always)]
pub(crate) fn header_at(kind: EventKind, id: u64, probe: u32, time_ns: u64) -> EventHeader {
    EventHeader {
        kind: kind as u32,
        tid: id as u32,
        pid: (id >> 32) as u32,
        probe,
        time_ns,
    }
}

/// `bpf_ktime_get_ns()`: CLOCK_MONOTONIC.
#[inline(always)]
pub(crate) fn now() -> u64 {
    // SAFETY: plain helper call.
    unsafe { bpf_ktime_get_ns() }
}

#[inline(always)]
pub(crate) fn probe_cookie<C: EbpfContext>(ctx: &C) -> u64 {
    // SAFETY: the context is the one this program was called with.
    unsafe { bpf_get_attach_cookie(ctx.as_ptr()) }
}

/// This thread's sampling state, created on its first allocation.
#[derive(Clone, Copy)]
pub(crate) struct Thread {
    pub(crate) id: u64,
    pub(crate) state: *mut ThreadState,
    /// Whether the probe is past the entry of the call the program made
    /// (jemalloc's slow path or its own sampler, inside `malloc` or
    /// `operator new`): the program's last frame is then not at the
    /// stack's top, and frame pointers, which a call's entry leaves for
    /// its caller, miss it. Such samples always want a stack copy.
    pub(crate) past_entry: bool,
}

impl Thread {
    /// This thread's state; `None` in memprobe's own process.
    #[inline(always)]
    pub fn current() -> Option<Self> {
        let id = bpf_get_current_pid_tgid();
        // SAFETY: a plain read of a global userspace set at load time.
        if (id >> 32) as u32 == unsafe { core::ptr::read_volatile(&OWN_TGID) } {
            return None;
        }
        if let Some(state) = THREADS.get_ptr_mut(id) {
            return Some(Self {
                id,
                state,
                past_entry: false,
            });
        }
        let fresh = ThreadState {
            bytes_until_sample: draw_countdown(),
            return_sp: 0,
            resize_slot: 0,
            resize_return: 0,
            forwarder: Forwarder::default(),
            first_allocated: 0,
            window: 0,
            window_first: 0,
            window_end: 0,
            counter_at: 0,
            counter_fsbase: 0,
            window_sent_bytes: 0,
            window_lost_bytes: 0,
            window_thinned: 0,
        };
        let _ = THREADS.insert(id, fresh, 0);
        let state = THREADS.get_ptr_mut(id)?;
        Some(Self {
            id,
            state,
            past_entry: false,
        })
    }

    /// Remembers where `rsp` will be when the call in flight returns.
    #[inline(always)]
    pub(crate) fn expect_return(&self, ctx: &ProbeContext) {
        let args = Args::of(ctx);
        let return_address = args.stack_pointer + cookie::return_address_offset(probe_cookie(ctx));
        // SAFETY: the entry belongs to this thread; only this thread writes it.
        unsafe { (*self.state).return_sp = return_address + 8 };
    }

    /// Remembers where the call in flight (a `realloc` inside which
    /// jemalloc takes its samples, a windowed `malloc` whose slow path
    /// samples it) keeps its return address, and that address, before any
    /// return half replaces it.
    #[inline(always)]
    pub(crate) fn note_resize_return(&self, ctx: &ProbeContext) {
        let slot = Args::of(ctx).stack_pointer + cookie::return_address_offset(probe_cookie(ctx));
        // SAFETY: reading user memory through the helper, which faults
        // safely; the entry belongs to this thread.
        unsafe {
            let original = bpf_probe_read_user(slot as *const u64).unwrap_or(0);
            (*self.state).resize_slot = if original != 0 { slot } else { 0 };
            (*self.state).resize_return = original;
        }
    }

    /// Whether this allocation call was made by the thread's last
    /// forwarding call (see [`Forwarder`]); forgets that call either way.
    #[inline(always)]
    pub(crate) fn is_inner_call(&self, ctx: &ProbeContext) -> bool {
        // SAFETY: the entry belongs to this thread; only this thread writes it.
        let outer = unsafe { (*self.state).forwarder };
        if outer.slot == 0 {
            return false;
        }
        // SAFETY: as above.
        unsafe { (*self.state).forwarder.slot = 0 };
        let cookie = probe_cookie(ctx);
        if outer.probe == cookie::probe_index(cookie) as u64 {
            return false;
        }
        let slot = Args::of(ctx).stack_pointer + cookie::return_address_offset(cookie);
        // SAFETY: reading user memory through the helper, which faults safely.
        let Ok(return_address) = (unsafe { bpf_probe_read_user(slot as *const u64) }) else {
            return false;
        };
        let tail_call = slot == outer.slot && return_address == outer.return_address;
        let called_from_it =
            slot < outer.slot && return_address.wrapping_sub(outer.ip) < FORWARD_WINDOW;
        tail_call || called_from_it
    }

    /// Remembers this call if its entry point may forward it to another.
    #[inline(always)]
    pub(crate) fn note_forwarder(&self, ctx: &ProbeContext) {
        let cookie = probe_cookie(ctx);
        if !cookie::forwards(cookie) {
            return;
        }
        // SAFETY: `regs` points at the probe's pt_regs.
        let ip = unsafe { (*ctx.regs).rip };
        let slot = Args::of(ctx).stack_pointer + cookie::return_address_offset(cookie);
        // SAFETY: reading user memory through the helper, which faults safely.
        let return_address = unsafe { bpf_probe_read_user(slot as *const u64) }.unwrap_or(0);
        let forwarder = Forwarder {
            slot,
            return_address,
            ip,
            probe: cookie::probe_index(cookie) as u64,
        };
        // SAFETY: the entry belongs to this thread; only this thread writes it.
        unsafe { (*self.state).forwarder = forwarder };
    }

    /// Whether `ctx` is the return of this thread's sampled call: after
    /// `ret`, `rsp` is one word above the return address's slot.
    #[inline(always)]
    pub(crate) fn is_return(&self, ctx: &ProbeContext) -> bool {
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
pub(crate) fn session(ctx: &ProbeContext, entry: fn(&ProbeContext, &Thread) -> bool) -> u32 {
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
