//! Threads' ends, where their process is sampled in windows: libc's
//! `__call_tls_dtors`, which a thread calls as it returns or calls
//! `pthread_exit`, and `_exit`, which the process calls from `exit` or a
//! return from `main`, in its own address space with every thread's TLS
//! still there. The thread's counter, or that of each thread userspace
//! listed, is read then, which ends what the thread allocated after its
//! last window. It is noted in a map, not sent: userspace takes the map's
//! notes after draining the samples sent before them, and a ring buffer
//! full of samples cannot lose them.
use aya_ebpf::{
    bindings::BPF_NOEXIST,
    helpers::{bpf_get_current_pid_tgid, bpf_probe_read_user},
    macros::uprobe,
    programs::ProbeContext,
};
use profiler_common::{Counter, MAX_EXIT_THREADS};

use crate::{
    maps::{EXIT_COUNTERS, THREAD_EXITS, THREADS},
    sampling::count,
    slow_path::current_fsbase,
};

/// `-EEXIST`: the thread's own exit was noted before its process's.
const EXISTS: i32 = -17;

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
    // Another fs base: the address noted is another thread's, one that
    // had its id.
    if at == 0 || fsbase != state.counter_fsbase {
        return 0;
    }
    // SAFETY: reading user memory through the helper, which faults safely.
    let Ok(allocated) = (unsafe { bpf_probe_read_user(at as *const u64) }) else {
        return 0;
    };
    if THREAD_EXITS.insert(id, allocated, 0).is_err() {
        count(Counter::ExitsLost);
    }
    0
}

#[uprobe]
pub fn process_exit(_ctx: ProbeContext) -> u32 {
    let tgid = bpf_get_current_pid_tgid() >> 32;
    // SAFETY: a lookup in a map of plain values.
    let Some(listed) = (unsafe { EXIT_COUNTERS.get(tgid as u32) }) else {
        return 0;
    };
    let listed_count = (listed.count as usize).min(MAX_EXIT_THREADS);
    for i in 0..MAX_EXIT_THREADS {
        if i >= listed_count {
            break;
        }
        let (Some(&tid), Some(&at)) = (listed.tids.get(i), listed.addresses.get(i)) else {
            break;
        };
        // SAFETY: reading user memory through the helper, which faults safely.
        let allocated = unsafe { bpf_probe_read_user(at as *const u64) }.unwrap_or(0);
        // A thread that ended on its own was read then, in its own TLS.
        let key = (tgid << 32) | u64::from(tid);
        match THREAD_EXITS.insert(key, allocated, u64::from(BPF_NOEXIST)) {
            Ok(()) | Err(EXISTS) => {}
            Err(_) => count(Counter::ExitsLost),
        }
    }
    0
}
