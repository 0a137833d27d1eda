//! Slots of [`crate::maps::SAMPLED_SLOTS`]: a count of the sampled pointers
//! whose address hashes to each. A free whose slot counts 0 was not
//! sampled, and skips the lookup in the set of sampled pointers (a hash of
//! the key and a bucket in a table of megabytes: about half of what a free's
//! program costs).

/// log2 of the slot count: 32,768 u64 counts (BPF has no 32-bit atomics
/// in Rust), 256 KiB. At 2,000 sampled pointers in use (1 GiB at the
/// default interval) 6% of the slots count any; a full set of sampled
/// pointers leaves none at 0, and every free looks up as before.
pub const SLOT_BITS: u32 = 15;
pub const SLOTS: u32 = 1 << SLOT_BITS;

/// The slot of `ptr`. Allocations are 16-byte aligned at least: the bits
/// below go, the rest are spread by a multiplicative (Fibonacci) hash.
pub const fn slot(ptr: u64) -> u32 {
    ((ptr >> 4).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> (64 - SLOT_BITS)) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn neighbouring_regions_take_different_slots() {
        // 4,096 regions of a size class side by side, as in a slab.
        let base = 0x7f3a_1c40_0000u64;
        for size in [16u64, 48, 4096] {
            let mut taken = [false; SLOTS as usize];
            let mut distinct = 0;
            for i in 0..4096 {
                let slot = slot(base + i * size) as usize;
                assert!(slot < SLOTS as usize);
                distinct += usize::from(!taken[slot]);
                taken[slot] = true;
            }
            assert!(distinct > 3800, "{size}-byte regions: {distinct} slots");
        }
    }
}
