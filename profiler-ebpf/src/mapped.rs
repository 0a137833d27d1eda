//! What profiled processes map, told by uprobes in each of them alone (so
//! no other process is slowed: a syscall tracepoint would send every
//! system call on the host through the kernel's slow path): anonymous
//! memory through libc's `mmap`, with the stack that mapped it, the
//! ranges `munmap` gives back and `mremap` moves; and the dynamic loader's
//! `_dl_debug_state`, which it calls as it maps a library (`dlopen`), so
//! that userspace looks for a new allocator copy at once instead of at its
//! next rescan.
use core::{ffi::c_void, mem::size_of, ptr::addr_of_mut};

use aya_ebpf::{
    EbpfContext,
    bindings::{BPF_F_USER_STACK, BPF_RB_AVAIL_DATA},
    helpers::{bpf_get_current_pid_tgid, generated::bpf_get_stack},
    macros::{uprobe, uretprobe},
    programs::{ProbeContext, RetProbeContext},
};
use profiler_common::{
    Counter, EventHeader, EventKind, MAX_STACK_DEPTH, MapCall, MappingEvent, RemapEvent, UserRegs,
};

use crate::{
    alloc::copy_stack,
    maps::{EVENTS, MAP_CALLS, RING_BUSY_BYTES},
    ring,
    sampling::{Args, count, header},
};

const MAP_ANONYMOUS: u64 = 0x20;
/// A failed call returns `MAP_FAILED`, -1.
const MAP_FAILED: u64 = u64::MAX;

/// `mmap(addr, len, prot, flags, fd, offset)`: anonymous memory is told of
/// at the return, with the address.
#[uprobe]
pub fn mmap_call(ctx: ProbeContext) -> u32 {
    let args = Args::of(&ctx);
    let (len, flags) = (args.arg(1), args.arg(3));
    if flags & MAP_ANONYMOUS != 0 {
        let call = MapCall {
            flags_or_old: flags,
            len,
            new_len: 0,
        };
        let _ = MAP_CALLS.insert(bpf_get_current_pid_tgid(), call, 0);
    }
    0
}

#[uretprobe]
pub fn mmap_return(ctx: RetProbeContext) -> u32 {
    let Some(call) = take_call() else {
        return 0;
    };
    let mapped: u64 = ctx.ret();
    if mapped != MAP_FAILED {
        send_mapping(&ctx, (mapped, call.len, call.flags_or_old));
    }
    0
}

/// The thread's call in flight, taken out of [`MAP_CALLS`].
#[inline(always)]
fn take_call() -> Option<MapCall> {
    let id = bpf_get_current_pid_tgid();
    // SAFETY: a map lookup; the value is copied out before the removal.
    let call = unsafe { MAP_CALLS.get(id) }.copied()?;
    let _ = MAP_CALLS.remove(id);
    Some(call)
}

/// Sends anonymous memory mapped at `addr`, with the stack it returns to:
/// copied for DWARF unwinding unless the ring is busy.
#[inline(always)]
fn send_mapping(ctx: &RetProbeContext, (addr, len, flags): (u64, u64, u64)) {
    let Some(mut entry) = EVENTS.reserve::<MappingEvent>(0) else {
        count(Counter::MappingEventsLost);
        return;
    };
    // SAFETY: a plain read of a global userspace set at load time.
    let busy_bytes = unsafe { core::ptr::read_volatile(&RING_BUSY_BYTES) };
    let busy = EVENTS.query(BPF_RB_AVAIL_DATA as u64) > busy_bytes;
    let event = entry.as_mut_ptr();
    // SAFETY: `regs` points at the probe's pt_regs, readable for its
    // lifetime; `event` at reserved ring-buffer memory for a
    // `MappingEvent`, written in place (too big for the BPF stack); the
    // helpers fault safely.
    unsafe {
        let regs = &*ctx.regs;
        let user = UserRegs {
            ip: regs.rip,
            sp: regs.rsp,
            bp: regs.rbp,
        };
        let id = bpf_get_current_pid_tgid();
        addr_of_mut!((*event).header).write(header(EventKind::Mapped, id, 0));
        addr_of_mut!((*event).addr).write(addr);
        addr_of_mut!((*event).len).write(len);
        addr_of_mut!((*event).flags).write(flags);
        let stack_bytes = bpf_get_stack(
            ctx.as_ptr(),
            addr_of_mut!((*event).stack) as *mut c_void,
            (MAX_STACK_DEPTH * size_of::<u64>()) as u32,
            BPF_F_USER_STACK as u64,
        );
        addr_of_mut!((*event).stack_bytes).write(stack_bytes);
        addr_of_mut!((*event).regs).write(user);
        let copied = if busy {
            count(Counter::MappingStacksSkipped);
            0
        } else {
            copy_stack(addr_of_mut!((*event).stack_copy) as *mut u8, user.sp)
        };
        addr_of_mut!((*event).stack_copy_bytes).write(copied);
    }
    ring::submit(entry);
}

/// `munmap(addr, len)`, before it unmaps.
#[uprobe]
pub fn munmap_call(ctx: ProbeContext) -> u32 {
    let args = Args::of(&ctx);
    let id = bpf_get_current_pid_tgid();
    send_remap(id, EventKind::Unmapped, (args.arg(0), args.arg(1)), (0, 0));
    0
}

/// `mremap(old, old_len, new_len, flags, ...)`: told at its return, with
/// where the mapping now is.
#[uprobe]
pub fn mremap_call(ctx: ProbeContext) -> u32 {
    let args = Args::of(&ctx);
    let call = MapCall {
        flags_or_old: args.arg(0),
        len: args.arg(1),
        new_len: args.arg(2),
    };
    let _ = MAP_CALLS.insert(bpf_get_current_pid_tgid(), call, 0);
    0
}

#[uretprobe]
pub fn mremap_return(ctx: RetProbeContext) -> u32 {
    let Some(call) = take_call() else {
        return 0;
    };
    let moved_to: u64 = ctx.ret();
    if moved_to != MAP_FAILED {
        let id = bpf_get_current_pid_tgid();
        let old = (call.flags_or_old, call.len);
        send_remap(id, EventKind::Remapped, old, (moved_to, call.new_len));
    }
    0
}

#[inline(always)]
fn send_remap(id: u64, kind: EventKind, (addr, len): (u64, u64), (new_addr, new_len): (u64, u64)) {
    let event = RemapEvent {
        header: header(kind, id, 0),
        addr,
        len,
        new_addr,
        new_len,
    };
    if ring::output(&event).is_err() {
        count(Counter::MappingEventsLost);
    }
}

/// The dynamic loader's `_dl_debug_state`: a library was, or is about to
/// be, mapped.
#[uprobe]
pub fn library_loaded(_ctx: ProbeContext) -> u32 {
    let id = bpf_get_current_pid_tgid();
    let told = header(EventKind::MappedCode, id, 0);
    if EVENTS.output::<EventHeader>(&told, 0).is_err() {
        count(Counter::MappingEventsLost);
    }
    0
}
