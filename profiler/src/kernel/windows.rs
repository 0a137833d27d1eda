//! What the kernel keeps for windowed sampling: each thread's record of
//! its last sampling window, jemalloc's allocated-bytes counter at its
//! first windowed call there and after its last, and where that counter
//! is; each process's list of its threads' counters, read as it ends; and
//! the counters of the threads that ended.
use aya::maps::HashMap;
use profiler_common::{ExitCounters, MAX_EXIT_THREADS, ThreadState, maps};

use crate::kernel::KernelProbes;

/// One thread's last window, as its windowed calls noted it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ThreadWindow {
    /// The window's number (`FastPathConfig::window`).
    pub window: u64,
    /// jemalloc's allocated-bytes counter at its first call in the window.
    pub first: u64,
    /// The counter after its last call in the window.
    pub end: u64,
    /// The counter at its first call seen on the slow path (0: none yet):
    /// where the bytes its first window stands for start.
    pub base: u64,
    /// Where the counter is in the thread's TLS (0: not known).
    pub counter_at: u64,
    /// The window's bytes its sent samples stand for, and its lost ones
    /// (each its usable size over the chance its call was sampled).
    pub sent_bytes: u64,
    pub lost_bytes: u64,
}

impl KernelProbes {
    /// Thread `tid` of `pid`'s last window, if it made a windowed call.
    pub fn thread_window(&self, pid: u32, tid: u32) -> Option<ThreadWindow> {
        let map = self.ebpf.map(maps::THREADS)?;
        let threads = HashMap::<_, u64, ThreadState>::try_from(map).ok()?;
        let state = threads
            .get(&((u64::from(pid) << 32) | u64::from(tid)), 0)
            .ok()?;
        (state.window != 0).then_some(ThreadWindow {
            window: state.window,
            first: state.window_first,
            end: state.window_end,
            base: state.first_allocated,
            counter_at: state.counter_at,
            sent_bytes: state.window_sent_bytes,
            lost_bytes: state.window_lost_bytes,
        })
    }

    /// Lists where `pid`'s threads keep their counters (thread, address),
    /// the first [`MAX_EXIT_THREADS`] of them: each is read as the process
    /// calls `_exit`. Whether the kernel took the list.
    pub fn list_exit_counters(&mut self, pid: u32, threads: &[(u32, u64)]) -> bool {
        let mut listed = ExitCounters {
            count: 0,
            tids: [0; MAX_EXIT_THREADS],
            addresses: [0; MAX_EXIT_THREADS],
        };
        for (k, &(tid, at)) in threads.iter().take(MAX_EXIT_THREADS).enumerate() {
            listed.tids[k] = tid;
            listed.addresses[k] = at;
            listed.count += 1;
        }
        self.set_pid(maps::EXIT_COUNTERS, pid, Some(listed))
    }

    /// The threads that ended since the last call (pid, tid, jemalloc's
    /// counter then), taken out of the kernel's table: to be settled once
    /// the samples sent before them are drained.
    pub fn take_thread_exits(&mut self) -> Vec<(u32, u32, u64)> {
        let Some(map) = self.ebpf.map_mut(maps::THREAD_EXITS) else {
            return Vec::new();
        };
        let Ok(mut exits) = HashMap::<_, u64, u64>::try_from(map) else {
            return Vec::new();
        };
        let ended: Vec<(u64, u64)> = exits.iter().filter_map(Result::ok).collect();
        for (id, _) in &ended {
            let _ = exits.remove(id);
        }
        ended
            .into_iter()
            .map(|(id, allocated)| ((id >> 32) as u32, id as u32, allocated))
            .collect()
    }

    /// Forgets `pid`'s list (it exited, or is no longer sampled so).
    pub fn forget_exit_counters(&mut self, pid: u32) {
        self.set_pid::<ExitCounters>(maps::EXIT_COUNTERS, pid, None);
    }
}
