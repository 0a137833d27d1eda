//! Estimates out of a process's heap: totals, per call site, and the
//! whole profile with each stack's oldest live sample.
use std::collections::HashMap;

use crate::{
    clock::monotonic_ns,
    collect::ProcessHeap,
    profile::{HeapProfile, ProfileNotes, StackEstimate},
};

impl ProcessHeap {
    /// Estimated bytes in use now.
    pub fn inuse_bytes(&self) -> f64 {
        self.stacks.iter().map(|s| s.inuse_bytes).sum()
    }

    /// Estimated bytes allocated so far per call site (the immediate
    /// caller's return address).
    pub fn allocated_by_site(&self) -> HashMap<u64, f64> {
        let mut sites: HashMap<u64, f64> = HashMap::new();
        for stack in &self.stacks {
            let site = stack.frames.first().copied().unwrap_or(0);
            *sites.entry(site).or_default() += stack.alloc_bytes;
        }
        sites
    }

    /// Estimated bytes allocated since the probes were attached.
    pub fn alloc_bytes(&self) -> f64 {
        self.stacks.iter().map(|s| s.alloc_bytes).sum()
    }

    pub fn live_samples(&self) -> usize {
        self.live.len()
    }

    /// Age of the oldest live sample, for reports.
    pub fn oldest_live_ns(&self) -> Option<u64> {
        self.live.values().map(|l| l.time_ns).min()
    }

    /// A complete profile of the process now.
    pub fn snapshot(&self, mapped_libraries: String) -> HeapProfile {
        let now_ns = monotonic_ns();
        let mut oldest: HashMap<u32, u64> = HashMap::new();
        for live in self.live.values() {
            let entry = oldest.entry(live.stack).or_insert(live.time_ns);
            *entry = (*entry).min(live.time_ns);
        }
        let notes = ProfileNotes {
            samples: Some(self.samples),
            drops: self.drops,
            ..ProfileNotes::default()
        };
        HeapProfile {
            jit_symbols: Vec::new(),
            python_frames: Vec::new(),
            memory: None,
            account: None,
            pid: self.pid,
            sample_interval: self.sample_interval,
            stacks: self
                .stacks
                .iter()
                .enumerate()
                .filter(|(_, s)| s.alloc_objects > 0.0)
                .map(|(id, s)| StackEstimate {
                    oldest_live_s: oldest
                        .get(&(id as u32))
                        .map(|&t| now_ns.saturating_sub(t) as f64 / 1e9),
                    ..s.clone()
                })
                .collect(),
            mapped_libraries,
            notes,
        }
    }
}
