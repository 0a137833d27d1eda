//! The memory part of a run: the anonymous memory each process maps, with
//! the stack that mapped it, kept as the kernel tells of it; and at each
//! snapshot, what the kernel says is resident, for the memory account.
use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use crate::{
    kernel::events::KernelMapping,
    proc::{
        read_maps,
        resident::{Pagemap, ResidentMapping, read_smaps, thread_stack_pointers},
    },
    profile::{MappedRange, MemoryReading},
    run::{
        Session,
        snapshots::writer::{Announce, Job},
    },
};

/// Most address space whose resident pages a snapshot reads from pagemap
/// (8 bytes read per 4 KiB page: 32 MiB read at most); past it, a
/// mapping's resident bytes are its share of its smaps entry's.
const PAGEMAP_MOST: u64 = 16 << 30;

/// The least time between two readings of a process's memory besides its
/// snapshots'.
const READ_EVERY: Duration = Duration::from_secs(5);

/// What those readings may cost memprobe, a share of one CPU: smaps walks
/// the process's page tables (0.2 s for 5 GiB resident here, which read
/// every 5 s came to most of memprobe's CPU beside a busy redis-server),
/// so a big process is read less often.
const READING_SHARE: f64 = 0.01;

impl Session<'_> {
    /// Anonymous memory `mapping.stack.header.pid` mapped: kept with its
    /// stack, unwound as a sample's.
    pub(super) fn mapped_memory(&mut self, mut mapping: KernelMapping) {
        let pid = mapping.stack.header.pid;
        let fast_path = self.probes.frame_pointer_fast_path();
        let Some(t) = self.tracked.get_mut(&pid) else {
            return;
        };
        if t.comes_from_unmapped_code(&mapping.stack.frames) {
            t.set_maps(read_maps(pid).ok());
        }
        let returns_to = mapping.stack.stack_copy.as_ref().map(|c| c.regs.ip);
        t.stacks
            .complete(&mut mapping.stack, fast_path, &mut t.heap.drops);
        // Unwound from `mmap`'s return, the caller's own place is the
        // registers', not a frame's.
        let frames = &mut mapping.stack.frames;
        if let Some(ip) = returns_to
            && frames.first() != Some(&ip)
        {
            frames.insert(0, ip);
        }
        // The kernel maps its return trampoline at a process's first
        // return probe: read the maps again to know where.
        if t.stacks.has_unplaced(frames, t.mappings()) {
            t.set_maps(read_maps(pid).ok());
        }
        let dropped = t.stacks.drop_trampoline_frames(&mut mapping.stack.frames);
        t.heap.drops.trampoline_callers += dropped as u64;
        let frames: Arc<[u64]> = mapping.stack.frames.into();
        let len = mapping.stack.size;
        t.mapped.map(mapping.addr, len, frames, mapping.shared);
    }

    pub(super) fn unmapped_memory(&mut self, pid: u32, addr: u64, len: u64) {
        if let Some(t) = self.tracked.get_mut(&pid) {
            t.mapped.unmap(addr, len);
        }
    }

    pub(super) fn remapped_memory(&mut self, pid: u32, old: (u64, u64), new: (u64, u64)) {
        if let Some(t) = self.tracked.get_mut(&pid) {
            t.mapped.remap(old, new);
        }
    }

    /// Reads the memory of every live process whose reading is due (every
    /// [`READ_EVERY`], or as rarely as [`READING_SHARE`] asks): its last
    /// snapshot, taken once it exited, has its memory as last read.
    pub(super) fn keep_memory_read(&mut self) {
        if !self.scope.watches_mapped_code() {
            return;
        }
        let now = Instant::now();
        let due: Vec<u32> = self
            .tracked
            .values()
            .filter(|t| !t.exited && t.memory_due <= now)
            .map(|t| t.pid)
            .collect();
        for pid in due {
            let started = Instant::now();
            self.read_memory(pid);
            if let Some(t) = self.tracked.get_mut(&pid) {
                t.memory_due = next_reading(started, started.elapsed());
            }
            if self.publishing.is_some() {
                self.account_for_endpoints(pid);
            }
        }
    }

    /// Has the writer account for `pid`'s memory as last read, writing no
    /// file: `/metrics` shows it.
    fn account_for_endpoints(&mut self, pid: u32) {
        let Some(t) = self.tracked.get(&pid) else {
            return;
        };
        if t.memory.is_none() || self.snapshots.writer.busy_with(pid) {
            return;
        }
        let mut profile = t.profile();
        profile.memory = t.memory.clone();
        self.snapshots.writer.submit(Job {
            pid,
            seq: 0,
            profile,
            formats: Vec::new(),
            jvm_perfmap: None,
            last: false,
            announce: Announce::Nothing,
        });
    }

    /// What the kernel says of `pid`'s memory now, with the mappings it
    /// made while profiled and their resident bytes, kept; once it is gone,
    /// as last read.
    pub(super) fn read_memory(&mut self, pid: u32) -> Option<MemoryReading> {
        let reading = self.memory_now(pid);
        let t = self.tracked.get_mut(&pid)?;
        if reading.is_some() {
            t.memory = reading;
        }
        t.memory.clone()
    }

    fn memory_now(&self, pid: u32) -> Option<MemoryReading> {
        let t = self.tracked.get(&pid)?;
        let resident = read_smaps(pid).ok().filter(|r| !r.is_empty())?;
        let pagemap = Pagemap::open(pid).ok();
        let mut pagemap_left = PAGEMAP_MOST;
        let mut ranges = Vec::with_capacity(t.mapped.len());
        for (start, mapping) in t.mapped.iter() {
            let end = start + mapping.len;
            // Only what is still the process's own anonymous memory: a file
            // mapped over part of it (a JVM's class archive over its
            // reservation) is the file's.
            let own = resident
                .iter()
                .filter(|m| m.is_private_anonymous() && m.start < end && start < m.end);
            let mut bytes = 0;
            for m in own {
                let (from, to) = (start.max(m.start), end.min(m.end));
                let read = match &pagemap {
                    Some(pagemap) if to - from <= pagemap_left => {
                        pagemap_left -= to - from;
                        pagemap.resident(from, to).ok()
                    }
                    _ => None,
                };
                bytes += read.unwrap_or_else(|| share_of(m, from, to));
            }
            ranges.push(MappedRange {
                start,
                len: mapping.len,
                frames: mapping.frames.to_vec(),
                shared: mapping.shared,
                resident: bytes,
            });
        }
        Some(MemoryReading {
            resident,
            mapped: ranges,
            mappings_dropped: t.mapped.dropped,
            since_start: self.scope.sees_every_mapping(),
            stack_pointers: thread_stack_pointers(pid),
        })
    }
}

/// When a process's memory is next read, for a reading that began at
/// `started` and took `took`.
fn next_reading(started: Instant, took: Duration) -> Instant {
    started + took.div_f64(READING_SHARE).max(READ_EVERY)
}

/// `[from, to)`'s share of `mapping`'s resident bytes, by length.
fn share_of(mapping: &ResidentMapping, from: u64, to: u64) -> u64 {
    (mapping.resident as f64 * (to - from) as f64 / mapping.len().max(1) as f64) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_big_process_is_read_less_often() {
        let now = Instant::now();
        // A small process: every 5 s.
        let small = next_reading(now, Duration::from_millis(2));
        assert_eq!(small - now, READ_EVERY);
        // 5 GiB resident, 0.2 s a reading: every 20 s, 1% of a CPU.
        let big = next_reading(now, Duration::from_millis(200));
        assert_eq!(big - now, Duration::from_secs(20));
    }
}
