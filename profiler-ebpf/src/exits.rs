//! Threads' ends, where their process is sampled in windows: libc's
//! `__call_tls_dtors`, which a thread calls as it returns or calls
//! `pthread_exit`, and `_exit`, which the process calls from `exit` or a
//! return from `main`, in its own address space with every thread's TLS
//! still there. The thread's counter, or that of each thread userspace
//! listed, is read then, which ends what the thread allocated after its
//! last window.
use aya_ebpf::{
    helpers::{bpf_get_current_pid_tgid, bpf_probe_read_user},
    macros::uprobe,
    programs::ProbeContext,
};
use profiler_common::{Counter, EventKind, ExitCountersEvent, MAX_EXIT_THREADS};

use crate::{
    maps::{EVENTS, EXIT_COUNTERS, THREADS},
    sampling::{count, header_at, now},
    slow_path::current_fsbase,
};

/// How far from its fs base a thread's counter may lie (its static TLS):
/// farther, the address noted is another thread's, one that had its id.
const TLS_REACH: u64 = 1 << 20;

#[uprobe]
pub fn thread_exit(_ctx: ProbeContext) -> u32 {
    let id = bpf_get_current_pid_tgid();
    // SAFETY: a lookup in a map of plain values.
    let Some(state) = (unsafe { THREADS.get(id) }) else {
        return 0;
    };
    let at = state.counter_at;
    let Some(fsbase) = current_fsbase() else {
        return 0;
    };
    if at == 0 || fsbase.abs_diff(at) > TLS_REACH {
        return 0;
    }
    // SAFETY: reading user memory through the helper, which faults safely.
    let Ok(allocated) = (unsafe { bpf_probe_read_user(at as *const u64) }) else {
        return 0;
    };
    send_counters(id, |event| {
        // SAFETY: the record is ours until sent.
        unsafe {
            (*event).tids[0] = id as u32;
            (*event).allocated[0] = allocated;
        }
        1
    });
    0
}

#[uprobe]
pub fn process_exit(_ctx: ProbeContext) -> u32 {
    let id = bpf_get_current_pid_tgid();
    // SAFETY: a lookup in a map of plain values.
    let Some(listed) = (unsafe { EXIT_COUNTERS.get((id >> 32) as u32) }) else {
        return 0;
    };
    let listed_count = (listed.count as usize).min(MAX_EXIT_THREADS);
    send_counters(id, |event| {
        for i in 0..MAX_EXIT_THREADS {
            if i >= listed_count {
                break;
            }
            let (Some(&tid), Some(&at)) = (listed.tids.get(i), listed.addresses.get(i)) else {
                break;
            };
            // SAFETY: the record is ours until sent; reading user memory
            // through the helper, which faults safely.
            unsafe {
                (*event).tids[i] = tid;
                (*event).allocated[i] = bpf_probe_read_user(at as *const u64).unwrap_or(0);
            }
        }
        listed_count as u64
    });
    0
}

/// Sends a record of the threads `fill` writes in it, the first of its
/// slots, as many as it returns (in place: the record is too big for the
/// BPF stack); counted as lost where the ring is full.
#[inline(always)]
fn send_counters(id: u64, fill: impl FnOnce(*mut ExitCountersEvent) -> u64) {
    let Some(mut entry) = EVENTS.reserve::<ExitCountersEvent>(0) else {
        count(Counter::ExitsLost);
        return;
    };
    let event = entry.as_mut_ptr();
    let threads = fill(event);
    // SAFETY: the reserved record is ours until submitted; userspace reads
    // its first `count` threads, which `fill` wrote.
    unsafe {
        (*event).header = header_at(EventKind::ExitCounters, id, 0, now());
        (*event).count = threads;
    }
    entry.submit(0);
}
