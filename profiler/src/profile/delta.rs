//! A profile less an earlier one of the same process: what changed in
//! between, per stack. A delta asked of the endpoint, and the one written
//! after frees were followed on a process's resident growth.
use std::collections::HashMap;

use crate::profile::{HeapProfile, StackEstimate};

impl HeapProfile {
    /// This profile less `before`, taken `seconds` earlier, per identical
    /// stack; a stack gone since had all of its in use freed.
    pub fn since(mut self, before: &HeapProfile, seconds: u64) -> HeapProfile {
        let mut earlier: HashMap<&[u64], &StackEstimate> = before
            .stacks
            .iter()
            .map(|s| (s.frames.as_slice(), s))
            .collect();
        for stack in &mut self.stacks {
            if let Some(old) = earlier.remove(stack.frames.as_slice()) {
                stack.inuse_objects -= old.inuse_objects;
                stack.inuse_bytes -= old.inuse_bytes;
                stack.alloc_objects -= old.alloc_objects;
                stack.alloc_bytes -= old.alloc_bytes;
            }
        }
        self.stacks
            .extend(earlier.into_values().map(|old| StackEstimate {
                frames: old.frames.clone(),
                inuse_objects: -old.inuse_objects,
                inuse_bytes: -old.inuse_bytes,
                alloc_objects: 0.0,
                alloc_bytes: 0.0,
                oldest_live_s: None,
            }));
        self.stacks.retain(|s| {
            s.inuse_objects != 0.0
                || s.inuse_bytes != 0.0
                || s.alloc_objects != 0.0
                || s.alloc_bytes != 0.0
        });
        self.notes.delta_seconds = Some(seconds);
        self
    }

    /// Only what grew: each count that fell left at 0 (a `.heap` file holds
    /// no negative count), and the stacks with nothing left dropped.
    pub fn growth_only(mut self) -> HeapProfile {
        for s in &mut self.stacks {
            s.inuse_objects = s.inuse_objects.max(0.0);
            s.inuse_bytes = s.inuse_bytes.max(0.0);
            s.alloc_objects = s.alloc_objects.max(0.0);
            s.alloc_bytes = s.alloc_bytes.max(0.0);
        }
        self.stacks
            .retain(|s| s.inuse_bytes > 0.0 || s.alloc_bytes > 0.0);
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stack(frames: &[u64], inuse: f64, alloc: f64) -> StackEstimate {
        StackEstimate {
            frames: frames.to_vec(),
            inuse_objects: inuse,
            inuse_bytes: inuse * 64.0,
            alloc_objects: alloc,
            alloc_bytes: alloc * 64.0,
            oldest_live_s: None,
        }
    }

    #[test]
    fn a_delta_is_the_change_per_stack() {
        let before = HeapProfile {
            stacks: vec![stack(&[1, 2], 10.0, 10.0), stack(&[3], 5.0, 5.0)],
            ..HeapProfile::default()
        };
        let after = HeapProfile {
            stacks: vec![stack(&[1, 2], 12.0, 20.0), stack(&[4], 1.0, 1.0)],
            ..HeapProfile::default()
        };
        let change = after.since(&before, 30);
        let of = |frames: &[u64]| change.stacks.iter().find(|s| s.frames == frames).unwrap();
        assert_eq!(
            (of(&[1, 2]).inuse_objects, of(&[1, 2]).alloc_objects),
            (2.0, 10.0)
        );
        assert_eq!(
            (of(&[3]).inuse_objects, of(&[3]).alloc_objects),
            (-5.0, 0.0)
        );
        assert_eq!(of(&[4]).inuse_objects, 1.0);
        assert_eq!(change.notes.delta_seconds, Some(30));
        let grown = change.growth_only();
        let frames: Vec<&[u64]> = grown.stacks.iter().map(|s| s.frames.as_slice()).collect();
        assert_eq!(frames.len(), 2, "{frames:?}");
        assert!(!frames.contains(&&[3u64][..]), "{frames:?}");
    }
}
