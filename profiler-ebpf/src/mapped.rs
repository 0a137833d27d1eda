//! Code mapped by a watched process (a `dlopen`ed library): an event, so
//! that userspace looks for a new allocator copy at once instead of at its
//! next rescan. The `mmap` syscall's tracepoints: its entry marks a call
//! that maps a file's code, its exit tells of it once it succeeded. A
//! process not watched costs one map lookup per `mmap`.
use aya_ebpf::{
    helpers::bpf_get_current_pid_tgid, macros::tracepoint, programs::TracePointContext,
};
use profiler_common::{EventHeader, EventKind};

use crate::{
    maps::{EVENTS, MAPPING_CODE, WATCHED},
    sampling::header,
};

const PROT_EXEC: u64 = 4;
/// A syscall's failure is a negative errno, at most this.
const MAX_ERRNO: u64 = 4095;
/// Field offsets in `syscalls/sys_enter_mmap` and `sys_exit_mmap` (their
/// `format` files): after the common fields and `__syscall_nr`.
const ENTER_PROT: usize = 32;
const ENTER_FD: usize = 48;
const EXIT_RET: usize = 16;

#[tracepoint]
pub fn mmap_enter(ctx: TracePointContext) -> u32 {
    let id = bpf_get_current_pid_tgid();
    // SAFETY: a map lookup.
    if unsafe { WATCHED.get((id >> 32) as u32) }.is_none() {
        return 0;
    }
    // SAFETY: offsets of the tracepoint's own fields.
    let (prot, fd) = unsafe {
        (
            ctx.read_at::<u64>(ENTER_PROT).unwrap_or(0),
            ctx.read_at::<u64>(ENTER_FD).unwrap_or(u64::MAX),
        )
    };
    if prot & PROT_EXEC != 0 && (fd as i64) >= 0 {
        let _ = MAPPING_CODE.insert(id, 1, 0);
    }
    0
}

#[tracepoint]
pub fn mmap_exit(ctx: TracePointContext) -> u32 {
    let id = bpf_get_current_pid_tgid();
    // SAFETY: a map lookup.
    if unsafe { MAPPING_CODE.get(id) }.is_none() {
        return 0;
    }
    let _ = MAPPING_CODE.remove(id);
    // SAFETY: the tracepoint's own field.
    let mapped = unsafe { ctx.read_at::<u64>(EXIT_RET) }.unwrap_or(u64::MAX);
    if mapped <= u64::MAX - MAX_ERRNO {
        let _ = EVENTS.output::<EventHeader>(header(EventKind::MappedCode, id, 0), 0);
    }
    0
}
