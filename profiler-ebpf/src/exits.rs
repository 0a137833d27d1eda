//! A process's end, where it is sampled in windows: libc's `_exit`, which
//! it calls from `exit` or a return from `main`, in its own address space
//! with every thread's TLS still there. The counter of each thread
//! userspace listed is read then, which ends what the thread allocated
//! after its last window.
use aya_ebpf::{
    helpers::{bpf_get_current_pid_tgid, bpf_probe_read_user},
    macros::uprobe,
    programs::ProbeContext,
};
use profiler_common::{Counter, EventKind, MAX_EXIT_THREADS, ProcessExitEvent};

use crate::{
    maps::{EVENTS, EXIT_COUNTERS},
    sampling::{count, header_at, now},
};

#[uprobe]
pub fn process_exit(_ctx: ProbeContext) -> u32 {
    let id = bpf_get_current_pid_tgid();
    // SAFETY: a lookup in a map of plain values.
    let Some(listed) = (unsafe { EXIT_COUNTERS.get((id >> 32) as u32) }) else {
        return 0;
    };
    let Some(mut entry) = EVENTS.reserve::<ProcessExitEvent>(0) else {
        count(Counter::ExitsLost);
        return 0;
    };
    let event = entry.as_mut_ptr();
    let listed_count = (listed.count as usize).min(MAX_EXIT_THREADS);
    // SAFETY: the reserved record is ours until submitted; userspace reads
    // its first `count` threads, all written.
    unsafe {
        (*event).header = header_at(EventKind::ProcessExit, id, 0, now());
        (*event).count = listed_count as u64;
        for i in 0..MAX_EXIT_THREADS {
            if i >= listed_count {
                break;
            }
            let (Some(&tid), Some(&at)) = (listed.tids.get(i), listed.addresses.get(i)) else {
                break;
            };
            (*event).tids[i] = tid;
            // Reading user memory through the helper, which faults safely.
            (*event).allocated[i] = bpf_probe_read_user(at as *const u64).unwrap_or(0);
        }
    }
    entry.submit(0);
    0
}
