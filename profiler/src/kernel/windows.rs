//! What the kernel keeps for windowed sampling: each thread's record of
//! its last sampling window, jemalloc's allocated-bytes counter at its
//! first windowed call there and after its last.
use aya::maps::HashMap;
use profiler_common::{ThreadState, maps};

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
        })
    }
}
