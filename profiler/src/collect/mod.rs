//! Turning sampled events into heap estimates: which sampled allocations are
//! still live, and per call stack the estimated objects and bytes in use and
//! allocated. Bounded: the live table and the stack table have caps, and what
//! did not fit is counted.
mod estimates;
mod input;
pub mod mappings;
pub mod sampling;
use std::collections::HashMap;

pub use input::{HeapEvent, Sample};

use crate::{
    collect::sampling::{sample_weight, window_weight},
    profile::{Drops, StackEstimate},
};

/// Caps of the userspace tables.
#[derive(Clone, Debug)]
pub struct CollectorOptions {
    /// `--track allocations`: a sampled call counts when it is made, and
    /// nothing is ever freed (in use = allocated). Default: no.
    pub allocations_only: bool,
    /// Live sampled allocations kept per process. Default: 1,000,000.
    pub max_live: usize,
    /// Distinct call stacks kept per process. Default: 200,000.
    pub max_stacks: usize,
}

impl Default for CollectorOptions {
    fn default() -> Self {
        Self {
            allocations_only: false,
            max_live: 1_000_000,
            max_stacks: 200_000,
        }
    }
}

#[derive(Clone, Copy, Debug)]
struct LiveAllocation {
    stack: u32,
    /// How many allocations this sample stands for.
    weight: f64,
    usable: u64,
    time_ns: u64,
    /// The allocator copy whose probe sampled it.
    copy: u16,
}

#[derive(Clone, Copy, Debug)]
struct PendingSample {
    stack: u32,
    /// How many allocations it stands for.
    weight: f64,
    usable: u64,
    copy: u16,
}

/// Threads whose last `realloc` freed a sampled allocation that is held
/// for a failure of the call; past this many the table starts over (one
/// entry a thread, left by every resize that did not fail).
const RESIZED_AWAY_CAP: usize = 4096;

/// The live set and per-stack estimates of one process.
#[derive(Debug)]
pub struct ProcessHeap {
    /// Mean bytes between samples: each sample's weight depends on it.
    sample_interval: u64,
    pub pid: u32,
    options: CollectorOptions,
    stacks: Vec<StackEstimate>,
    stack_ids: HashMap<Vec<u64>, u32>,
    live: HashMap<u64, LiveAllocation>,
    pending: HashMap<u32, PendingSample>,
    /// Per thread, the sampled allocation its last `realloc` or `rallocx`
    /// freed: live again if that call failed (`HeapEvent::Restored`).
    resized_away: HashMap<u32, (u64, LiveAllocation)>,
    pub samples: u64,
    pub drops: Drops,
}

impl ProcessHeap {
    /// A process sampled every `sample_interval` bytes on average.
    pub fn new(pid: u32, sample_interval: u64, options: CollectorOptions) -> Self {
        Self {
            pid,
            sample_interval,
            options,
            stacks: Vec::new(),
            stack_ids: HashMap::new(),
            live: HashMap::new(),
            pending: HashMap::new(),
            resized_away: HashMap::new(),
            samples: 0,
            drops: Drops::default(),
        }
    }

    pub fn apply(&mut self, event: HeapEvent) {
        match event {
            HeapEvent::Sampled(sample) => self.sampled(sample),
            HeapEvent::Returned {
                tid,
                time_ns,
                ptr,
                untracked,
            } => self.returned(tid, time_ns, ptr, untracked),
            HeapEvent::Freed {
                tid,
                ptr,
                in_resize,
            } => {
                if let Some(old) = self.live.remove(&ptr) {
                    self.release(old);
                    if in_resize {
                        self.hold_resized_away(tid, ptr, old);
                    }
                }
            }
            HeapEvent::Restored { tid, ptr } => self.restore(tid, ptr),
            HeapEvent::Resized { ptr, new_size } => {
                if let Some(live) = self.live.get_mut(&ptr) {
                    let stats = &mut self.stacks[live.stack as usize];
                    stats.inuse_bytes += live.weight * (new_size as f64 - live.usable as f64);
                    live.usable = new_size;
                }
            }
        }
    }

    /// A sampled call: weighed, and held for its pointer (counted at once
    /// where frees are not followed).
    fn sampled(&mut self, sample: Sample) {
        if sample.stack_error {
            self.drops.stack_errors += 1;
        }
        let (weight, usable) = self.weight(&sample);
        let stack = self.stack_id(sample.frames);
        if self.options.allocations_only {
            self.count_allocation(stack, weight, usable);
            return;
        }
        // A call whose return never came is replaced by the next one.
        self.pending.insert(
            sample.tid,
            PendingSample {
                stack,
                weight,
                usable,
                copy: sample.copy,
            },
        );
    }

    /// The bytes a sample stands for.
    pub fn estimated_bytes(&self, sample: &Sample) -> f64 {
        let (weight, usable) = self.weight(sample);
        weight * usable as f64
    }

    /// How many allocations a sample stands for, and its usable bytes.
    fn weight(&self, sample: &Sample) -> (f64, u64) {
        let usable = sample.allocator.usable_size(sample.size, sample.align);
        let interval = sample.interval.unwrap_or(self.sample_interval);
        let weight = match (sample.scale, sample.window) {
            // Sampled as though `window` bytes, in its thread's window.
            (Some(scale), window) => sample_weight(window, interval) * scale,
            (None, 0) => sample_weight(sample.size, interval),
            (None, window) => window_weight(usable, window, interval),
        };
        (weight, usable)
    }

    /// What a thread allocated after its last window, in the shape of
    /// that window's `sample` (its scale the tail's): allocated, and in
    /// use only where frees are not followed (its pointers are unknown).
    pub fn count_tail(&mut self, sample: &Sample) {
        let (weight, usable) = self.weight(sample);
        let stack = self.stack_id(sample.frames.clone());
        if self.options.allocations_only {
            self.count_allocation(stack, weight, usable);
            return;
        }
        let stats = &mut self.stacks[stack as usize];
        stats.alloc_objects += weight;
        stats.alloc_bytes += weight * usable as f64;
    }

    /// A sampled call's pointer: the allocation is live from now on.
    fn returned(&mut self, tid: u32, time_ns: u64, ptr: u64, untracked: bool) {
        let Some(sample) = self.pending.remove(&tid) else {
            // Once frees are dropped a sample counts at its call, and its
            // return (through a probe attached before) brings nothing.
            if !self.options.allocations_only {
                self.drops.unmatched_returns += 1;
            }
            return;
        };
        if ptr == 0 {
            return; // the allocation failed
        }
        if self.options.allocations_only {
            // Its call came before frees were dropped, its return after.
            self.count_allocation(sample.stack, sample.weight, sample.usable);
            return;
        }
        self.samples += 1;
        let weight = sample.weight;
        let usable = sample.usable;
        let stats = &mut self.stacks[sample.stack as usize];
        stats.alloc_objects += weight;
        stats.alloc_bytes += weight * usable as f64;
        if untracked {
            self.drops.untracked_in_kernel += 1;
            return;
        }
        if self.live.len() >= self.options.max_live && !self.live.contains_key(&ptr) {
            self.drops.live_table_full += 1;
            return;
        }
        let allocation = LiveAllocation {
            stack: sample.stack,
            weight,
            usable,
            time_ns,
            copy: sample.copy,
        };
        self.track(ptr, allocation);
    }

    /// `allocation` is in use at `ptr` from now on.
    fn track(&mut self, ptr: u64, allocation: LiveAllocation) {
        let stats = &mut self.stacks[allocation.stack as usize];
        stats.inuse_objects += allocation.weight;
        stats.inuse_bytes += allocation.weight * allocation.usable as f64;
        // A free we missed: the old allocation is gone.
        if let Some(old) = self.live.insert(ptr, allocation) {
            self.release(old);
        }
    }

    fn hold_resized_away(&mut self, tid: u32, ptr: u64, allocation: LiveAllocation) {
        if self.resized_away.len() >= RESIZED_AWAY_CAP && !self.resized_away.contains_key(&tid) {
            self.resized_away.clear();
        }
        self.resized_away.insert(tid, (ptr, allocation));
    }

    /// The resize that freed `ptr` on thread `tid` failed: it was never
    /// freed, and is in use again as it was.
    fn restore(&mut self, tid: u32, ptr: u64) {
        let Some((held, allocation)) = self.resized_away.remove(&tid) else {
            return;
        };
        if held == ptr && !self.live.contains_key(&ptr) {
            self.track(ptr, allocation);
        }
    }

    /// An allocation that is never matched with a free: in use for good.
    fn count_allocation(&mut self, stack: u32, weight: f64, usable: u64) {
        self.samples += 1;
        let usable = usable as f64;
        let stats = &mut self.stacks[stack as usize];
        stats.alloc_objects += weight;
        stats.alloc_bytes += weight * usable;
        stats.inuse_objects += weight;
        stats.inuse_bytes += weight * usable;
    }

    /// From now on a sampled call counts as in use for good, as with
    /// `--track allocations`: the process's frees are no longer seen.
    /// What was live stays so.
    pub fn track_allocations_only(&mut self) {
        self.options.allocations_only = true;
    }

    /// Whether sampled calls count as in use for good now (frees not seen).
    pub fn allocations_only(&self) -> bool {
        self.options.allocations_only
    }

    /// From now on a sampled call waits for its pointer and is in use until
    /// its free, where frees are followed again (asked for a while under
    /// `--track allocations`). What was counted before stays in use.
    pub fn follow_frees(&mut self) {
        self.options.allocations_only = false;
    }

    /// Stops following the live allocations one allocator copy sampled
    /// (their frees will no longer be seen): no longer in use; how many.
    pub fn forget_copy(&mut self, copy: u16) -> usize {
        let gone: Vec<u64> = self
            .live
            .iter()
            .filter(|(_, live)| live.copy == copy)
            .map(|(&ptr, _)| ptr)
            .collect();
        for ptr in &gone {
            if let Some(live) = self.live.remove(ptr) {
                self.release(live);
            }
        }
        gone.len()
    }

    fn release(&mut self, allocation: LiveAllocation) {
        let stats = &mut self.stacks[allocation.stack as usize];
        stats.inuse_objects = (stats.inuse_objects - allocation.weight).max(0.0);
        stats.inuse_bytes =
            (stats.inuse_bytes - allocation.weight * allocation.usable as f64).max(0.0);
    }

    fn stack_id(&mut self, frames: Vec<u64>) -> u32 {
        let frames = if frames.is_empty() { vec![0] } else { frames };
        if let Some(&id) = self.stack_ids.get(&frames) {
            return id;
        }
        if self.stacks.len() >= self.options.max_stacks {
            self.drops.stack_table_full += 1;
            // The overflow stack: one unknown frame, so totals stay right.
            return *self.stack_ids.entry(vec![0]).or_insert_with(|| {
                self.stacks.push(StackEstimate {
                    frames: vec![0],
                    ..Default::default()
                });
                (self.stacks.len() - 1) as u32
            });
        }
        let id = self.stacks.len() as u32;
        self.stacks.push(StackEstimate {
            frames: frames.clone(),
            ..Default::default()
        });
        self.stack_ids.insert(frames, id);
        id
    }
}

#[cfg(test)]
mod tests;
