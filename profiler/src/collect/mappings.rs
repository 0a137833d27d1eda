//! The anonymous memory a process mapped while profiled, each mapping with
//! the stack that made it: kept as the kernel tells of `mmap`, `munmap`
//! and `mremap`, so that a snapshot can say whose its resident memory is.
//! Every mapping is kept (there are few, and they are large), up to a
//! bound past which new ones are counted as dropped.
use std::{collections::BTreeMap, sync::Arc};

/// Most mappings kept per process.
pub const MAX_MAPPINGS: usize = 1 << 16;

/// One anonymous mapping, or what is left of it.
#[derive(Clone, Debug, PartialEq)]
pub struct TrackedMapping {
    pub len: u64,
    /// The stack that mapped it, innermost first.
    pub frames: Arc<[u64]>,
    /// Mapped `MAP_SHARED`.
    pub shared: bool,
}

/// A process's mappings by start address, none overlapping.
#[derive(Clone, Debug, Default)]
pub struct Mappings {
    by_start: BTreeMap<u64, TrackedMapping>,
    /// Mappings not kept, the table being full.
    pub dropped: u64,
}

impl Mappings {
    /// `len` bytes mapped at `addr` (over whatever was there: `MAP_FIXED`).
    pub fn map(&mut self, addr: u64, len: u64, frames: Arc<[u64]>, shared: bool) {
        self.unmap(addr, len);
        if self.by_start.len() >= MAX_MAPPINGS {
            self.dropped += 1;
            return;
        }
        let mapping = TrackedMapping {
            len,
            frames,
            shared,
        };
        self.by_start.insert(addr, mapping);
    }

    /// `[addr, addr + len)` unmapped: the mappings it covers go, those it
    /// cuts keep what lies outside it.
    pub fn unmap(&mut self, addr: u64, len: u64) {
        let end = addr.saturating_add(len);
        let overlapping: Vec<u64> = self
            .by_start
            .range(..end)
            .rev()
            .take_while(|(start, m)| *start + m.len > addr)
            .map(|(start, _)| *start)
            .collect();
        for start in overlapping {
            let Some(mapping) = self.by_start.remove(&start) else {
                continue;
            };
            let mapping_end = start + mapping.len;
            if start < addr {
                let before = TrackedMapping {
                    len: addr - start,
                    ..mapping.clone()
                };
                self.by_start.insert(start, before);
            }
            if mapping_end > end {
                let after = TrackedMapping {
                    len: mapping_end - end,
                    ..mapping
                };
                self.by_start.insert(end, after);
            }
        }
    }

    /// `mremap`: the mapping at `addr` (its first `len` bytes) now lives at
    /// `new_addr`, `new_len` long, made by the same stack. One memprobe
    /// did not see mapped is left to the memory account's unexplained.
    pub fn remap(&mut self, (addr, len): (u64, u64), (new_addr, new_len): (u64, u64)) {
        let Some(mapping) = self.containing(addr).cloned() else {
            return;
        };
        self.unmap(addr, len);
        self.map(new_addr, new_len, mapping.frames, mapping.shared);
    }

    fn containing(&self, addr: u64) -> Option<&TrackedMapping> {
        let (start, mapping) = self.by_start.range(..=addr).next_back()?;
        (addr < start + mapping.len).then_some(mapping)
    }

    /// Each mapping with its start, in address order.
    pub fn iter(&self) -> impl Iterator<Item = (u64, &TrackedMapping)> {
        self.by_start.iter().map(|(start, m)| (*start, m))
    }

    pub fn len(&self) -> usize {
        self.by_start.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_start.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stack(n: u64) -> Arc<[u64]> {
        vec![n].into()
    }

    fn ranges(mappings: &Mappings) -> Vec<(u64, u64, u64)> {
        mappings
            .iter()
            .map(|(start, m)| (start, m.len, m.frames[0]))
            .collect()
    }

    #[test]
    fn an_unmap_in_the_middle_leaves_both_ends() {
        let mut mappings = Mappings::default();
        mappings.map(0x1000, 0x10000, stack(1), false);
        mappings.unmap(0x4000, 0x2000);
        assert_eq!(
            ranges(&mappings),
            vec![(0x1000, 0x3000, 1), (0x6000, 0xb000, 1)]
        );
        mappings.unmap(0, 0x100000);
        assert!(mappings.is_empty());
    }

    #[test]
    fn a_fixed_mapping_replaces_what_it_covers() {
        let mut mappings = Mappings::default();
        mappings.map(0x10000, 0x10000, stack(1), false);
        mappings.map(0x18000, 0x10000, stack(2), false);
        assert_eq!(
            ranges(&mappings),
            vec![(0x10000, 0x8000, 1), (0x18000, 0x10000, 2)]
        );
    }

    #[test]
    fn a_moved_mapping_keeps_its_stack() {
        let mut mappings = Mappings::default();
        mappings.map(0x10000, 0x1000, stack(7), false);
        mappings.remap((0x10000, 0x1000), (0x40000, 0x4000));
        assert_eq!(ranges(&mappings), vec![(0x40000, 0x4000, 7)]);
        // One never seen mapped stays unknown.
        mappings.remap((0x90000, 0x1000), (0xa0000, 0x2000));
        assert_eq!(mappings.len(), 1);
    }

    #[test]
    fn past_the_bound_mappings_are_counted_as_dropped() {
        let mut mappings = Mappings::default();
        for i in 0..MAX_MAPPINGS as u64 + 3 {
            mappings.map(i * 0x2000, 0x1000, stack(i), false);
        }
        assert_eq!(mappings.len(), MAX_MAPPINGS);
        assert_eq!(mappings.dropped, 3);
    }
}
