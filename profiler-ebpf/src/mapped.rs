//! What watched processes map, told by the syscalls' tracepoints (no
//! uprobe, so nothing traps): a file's code (a `dlopen`ed library, so that
//! userspace looks for a new allocator copy at once instead of at its next
//! rescan), anonymous memory with the stack that mapped it, and the ranges
//! unmapped or moved. A process not watched costs one map lookup per
//! `mmap`, `munmap` or `mremap`.
use core::{ffi::c_void, mem::size_of, ptr::addr_of_mut};

use aya_ebpf::{
    EbpfContext,
    bindings::{BPF_F_USER_STACK, BPF_RB_AVAIL_DATA, pt_regs},
    helpers::{
        bpf_get_current_pid_tgid, bpf_probe_read_kernel,
        generated::{bpf_get_current_task_btf, bpf_get_stack, bpf_task_pt_regs},
    },
    macros::tracepoint,
    programs::TracePointContext,
};
use profiler_common::{
    Counter, EventHeader, EventKind, MAP_CALL_ANONYMOUS, MAP_CALL_CODE, MAP_CALL_REMAP,
    MAX_STACK_DEPTH, MapCall, MappingEvent, RemapEvent, UserRegs,
};

use crate::{
    alloc::copy_stack,
    maps::{EVENTS, MAP_CALLS, RING_BUSY_BYTES, WATCHED},
    sampling::{count, header},
};

const PROT_EXEC: u64 = 4;
const MAP_ANONYMOUS: u64 = 0x20;
/// A syscall's failure is a negative errno, at most this.
const MAX_ERRNO: u64 = 4095;
/// Field offsets in the `syscalls/sys_enter_*` tracepoints (their `format`
/// files): the arguments follow the common fields and `__syscall_nr`, 8
/// bytes each; `sys_exit_*`'s return value is at the same place as the
/// first.
const ARG: [usize; 6] = [16, 24, 32, 40, 48, 56];
const EXIT_RET: usize = 16;

/// Whether the current process is watched; its pid_tgid.
#[inline(always)]
fn watched() -> Option<u64> {
    let id = bpf_get_current_pid_tgid();
    // SAFETY: a map lookup.
    unsafe { WATCHED.get((id >> 32) as u32) }.map(|_| id)
}

#[inline(always)]
fn arg(ctx: &TracePointContext, n: usize) -> u64 {
    // SAFETY: offsets of the tracepoint's own fields.
    unsafe { ctx.read_at::<u64>(ARG[n]) }.unwrap_or(u64::MAX)
}

#[tracepoint]
pub fn mmap_enter(ctx: TracePointContext) -> u32 {
    let Some(id) = watched() else {
        return 0;
    };
    let (len, prot, flags, fd) = (arg(&ctx, 1), arg(&ctx, 2), arg(&ctx, 3), arg(&ctx, 4));
    let what = if flags & MAP_ANONYMOUS != 0 {
        MAP_CALL_ANONYMOUS
    } else if prot & PROT_EXEC != 0 && (fd as i64) >= 0 {
        MAP_CALL_CODE
    } else {
        return 0;
    };
    let call = MapCall {
        what,
        flags_or_old: flags,
        len,
        new_len: 0,
    };
    let _ = MAP_CALLS.insert(id, call, 0);
    0
}

#[tracepoint]
pub fn mmap_exit(ctx: TracePointContext) -> u32 {
    let Some(call) = take_call() else {
        return 0;
    };
    let id = bpf_get_current_pid_tgid();
    // SAFETY: the tracepoint's own field.
    let mapped = unsafe { ctx.read_at::<u64>(EXIT_RET) }.unwrap_or(u64::MAX);
    if mapped > u64::MAX - MAX_ERRNO {
        return 0;
    }
    match call.what {
        MAP_CALL_CODE => {
            if EVENTS
                .output::<EventHeader>(header(EventKind::MappedCode, id, 0), 0)
                .is_err()
            {
                count(Counter::MappingEventsLost);
            }
        }
        MAP_CALL_ANONYMOUS => send_mapping(&ctx, id, mapped, &call),
        _ => {}
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

/// Sends anonymous memory mapped at `addr`, with its stack: copied for
/// DWARF unwinding unless the ring is busy.
#[inline(always)]
fn send_mapping(ctx: &TracePointContext, id: u64, addr: u64, call: &MapCall) {
    let Some(mut entry) = EVENTS.reserve::<MappingEvent>(0) else {
        count(Counter::MappingEventsLost);
        return;
    };
    // SAFETY: a plain read of a global userspace set at load time.
    let busy_bytes = unsafe { core::ptr::read_volatile(&RING_BUSY_BYTES) };
    let busy = EVENTS.query(BPF_RB_AVAIL_DATA as u64) > busy_bytes;
    let event = entry.as_mut_ptr();
    // SAFETY: `event` points at reserved ring-buffer memory for a
    // `MappingEvent`, written in place (too big for the BPF stack); the
    // helpers fault safely.
    unsafe {
        addr_of_mut!((*event).header).write(header(EventKind::Mapped, id, 0));
        addr_of_mut!((*event).addr).write(addr);
        addr_of_mut!((*event).len).write(call.len);
        addr_of_mut!((*event).flags).write(call.flags_or_old);
        let stack_bytes = bpf_get_stack(
            ctx.as_ptr(),
            addr_of_mut!((*event).stack) as *mut c_void,
            (MAX_STACK_DEPTH * size_of::<u64>()) as u32,
            BPF_F_USER_STACK as u64,
        );
        addr_of_mut!((*event).stack_bytes).write(stack_bytes);
        let regs = user_regs();
        addr_of_mut!((*event).regs).write(regs);
        let copied = if busy || regs.sp == 0 {
            count(Counter::MappingStacksSkipped);
            0
        } else {
            copy_stack(addr_of_mut!((*event).stack_copy) as *mut u8, regs.sp)
        };
        addr_of_mut!((*event).stack_copy_bytes).write(copied);
    }
    entry.submit(0);
}

/// The thread's user registers as the system call left them (zeros where
/// they cannot be read).
#[inline(always)]
fn user_regs() -> UserRegs {
    // SAFETY: plain helper calls; `bpf_task_pt_regs` takes the task the
    // kernel gave, and its result is only read through a helper that
    // faults safely.
    let regs = unsafe {
        let task = bpf_get_current_task_btf();
        let regs = bpf_task_pt_regs(task) as *const pt_regs;
        bpf_probe_read_kernel(regs)
    };
    match regs {
        Ok(regs) => UserRegs {
            ip: regs.rip,
            sp: regs.rsp,
            bp: regs.rbp,
        },
        Err(_) => UserRegs::default(),
    }
}

#[tracepoint]
pub fn munmap_enter(ctx: TracePointContext) -> u32 {
    let Some(id) = watched() else {
        return 0;
    };
    send_remap(
        id,
        EventKind::Unmapped,
        (arg(&ctx, 0), arg(&ctx, 1)),
        (0, 0),
    );
    0
}

#[tracepoint]
pub fn mremap_enter(ctx: TracePointContext) -> u32 {
    let Some(id) = watched() else {
        return 0;
    };
    let call = MapCall {
        what: MAP_CALL_REMAP,
        flags_or_old: arg(&ctx, 0),
        len: arg(&ctx, 1),
        new_len: arg(&ctx, 2),
    };
    let _ = MAP_CALLS.insert(id, call, 0);
    0
}

#[tracepoint]
pub fn mremap_exit(ctx: TracePointContext) -> u32 {
    let Some(call) = take_call() else {
        return 0;
    };
    // SAFETY: the tracepoint's own field.
    let moved_to = unsafe { ctx.read_at::<u64>(EXIT_RET) }.unwrap_or(u64::MAX);
    if call.what != MAP_CALL_REMAP || moved_to > u64::MAX - MAX_ERRNO {
        return 0;
    }
    let id = bpf_get_current_pid_tgid();
    send_remap(
        id,
        EventKind::Remapped,
        (call.flags_or_old, call.len),
        (moved_to, call.new_len),
    );
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
    if EVENTS.output::<RemapEvent>(&event, 0).is_err() {
        count(Counter::MappingEventsLost);
    }
}
