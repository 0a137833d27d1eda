//! Tracking a process's allocations only: its frees unprobed, with
//! `--track allocations` (but for a while when asked) and as the step
//! `--max-overhead` takes before it detaches a process (frees are most of
//! what a busy jemalloc process's probes cost: its allocations are sampled
//! in windows, its frees all trap).
use aya::maps::HashMap;
use profiler_common::{LiveKey, maps};

use crate::kernel::{KernelProbes, Scope};

impl KernelProbes {
    /// Whether probes attached for `scope` leave out frees and resizes,
    /// and the return halves that only liveness needs.
    pub(super) fn allocations_only_in(&self, scope: Scope) -> bool {
        let followed = matches!(scope, Scope::Process(pid) if self.frees_followed.contains(&pid));
        (self.allocations_only && !followed)
            || matches!(scope, Scope::Process(pid) if self.frees_dropped.contains(&pid))
    }

    /// Under `--track allocations`, whether probes attached for `pid` from
    /// now on follow its frees too (asked for a while through the
    /// endpoints), or not again.
    pub fn follow_frees(&mut self, pid: u32, follow: bool) {
        if follow {
            self.frees_followed.insert(pid);
        } else {
            self.frees_followed.remove(&pid);
        }
    }

    /// Detaches `pid`'s probes on calls that only free (free, sdallocx,
    /// operator delete, xallocx, jemalloc's free slow paths), now and in
    /// any copy attached later; returns how many were detached (0: it had
    /// none, and nothing changed). Its allocations stay probed as they are.
    pub fn drop_frees(&mut self, pid: u32) -> usize {
        let frees: Vec<usize> = (0..self.attached.len())
            .filter(|&i| {
                let probe = &self.attached[i];
                probe.scope == Scope::Process(pid)
                    && !probe.shape.allocates()
                    && !self.links[i].is_empty()
            })
            .collect();
        if frees.is_empty() {
            return 0;
        }
        self.frees_dropped.insert(pid);
        self.detach_probes(&frees);
        frees.len()
    }

    /// Takes a sampled pointer of a process whose frees are dropped out of
    /// the kernel's set of sampled pointers, which no free will ever clear
    /// and which every process shares. Its slot stays counted: a lookup
    /// more for a free landing there, never one missed.
    pub fn forget_sampled(&mut self, pid: u32, instance: u16, ptr: u64) {
        let Some(map) = self.ebpf.map_mut(maps::SAMPLED) else {
            return;
        };
        if let Ok(mut set) = HashMap::<_, LiveKey, u8>::try_from(map) {
            let key = LiveKey {
                pid,
                instance: u32::from(instance),
                ptr,
            };
            let _ = set.remove(&key);
        }
    }
}
