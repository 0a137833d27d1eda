//! Every thread's fs base, for userspace to find where each thread of a
//! process keeps jemalloc's counters (its TLS) when that process's windows
//! begin: a task iterator, run on request, attached to no process.
use core::{ffi::c_void, ptr::read_volatile};

use aya_ebpf::{
    bindings::seq_file,
    helpers::{bpf_probe_read_kernel, generated::bpf_seq_write},
};
use profiler_common::ThreadBase;

use crate::maps::{TASK_FSBASE, TASK_PID, TASK_TGID};

/// The kernel's `struct bpf_iter_meta`.
#[repr(C)]
struct IterMeta {
    seq: *mut seq_file,
    session_id: u64,
    seq_num: u64,
}

/// The kernel's `struct bpf_iter__task`: the task is null once past the
/// last.
#[repr(C)]
struct IterTask {
    meta: *const IterMeta,
    task: *const c_void,
}

/// Writes one [`ThreadBase`] per user thread (one with an fs base).
#[unsafe(no_mangle)]
#[unsafe(link_section = "iter/task")]
pub fn thread_bases(ctx: *const c_void) -> i32 {
    let ctx = ctx.cast::<IterTask>();
    // SAFETY: plain reads of globals userspace set at load time.
    let (fsbase_at, pid_at, tgid_at) = unsafe {
        (
            read_volatile(&TASK_FSBASE),
            read_volatile(&TASK_PID),
            read_volatile(&TASK_TGID),
        )
    };
    if fsbase_at == 0 || pid_at == 0 || tgid_at == 0 {
        return 0;
    }
    // SAFETY: the context is the kernel's iterator record; the task pointer
    // is read through the helper, so that it is a plain number to add to,
    // and the task's fields are read through it too, which faults safely.
    unsafe {
        let Ok(task) = bpf_probe_read_kernel(&raw const (*ctx).task) else {
            return 0;
        };
        if task.is_null() {
            return 0;
        }
        let task = task as u64;
        let (Ok(fsbase), Ok(tid), Ok(tgid)) = (
            bpf_probe_read_kernel((task + fsbase_at) as *const u64),
            bpf_probe_read_kernel((task + pid_at) as *const u32),
            bpf_probe_read_kernel((task + tgid_at) as *const u32),
        ) else {
            return 0;
        };
        if fsbase == 0 {
            return 0;
        }
        let record = ThreadBase { tgid, tid, fsbase };
        let seq = (*(*ctx).meta).seq;
        bpf_seq_write(
            seq,
            (&raw const record).cast(),
            size_of::<ThreadBase>() as u32,
        );
    }
    0
}
