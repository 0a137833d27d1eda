//! jemalloc 5.3's size classes on x86-64 (4 KiB pages, 16-byte quantum):
//! the usable size an allocation occupies, as jemalloc and Redis count bytes.

const PAGE: u64 = 4096;
const SMALL_MAX_CLASS: u64 = 14 * 1024;
const LARGE_MIN_CLASS: u64 = 16 * 1024;
/// Largest class jemalloc serves; bigger requests fail.
const MAX_CLASS: u64 = 1 << 62;

/// `sz_s2u`: the size class of a request.
pub fn usable_size(size: u64) -> u64 {
    match size {
        0..=8 => 8,
        9..=16 => 16,
        17..=64 => round_up(size, 16),
        _ if size > MAX_CLASS => size,
        _ => {
            // Four classes per doubling: spacing is a quarter of the lower power of two.
            let lg_floor = 63 - (size - 1).leading_zeros() as u64;
            let delta = 1u64 << (lg_floor - 2);
            round_up(size, delta)
        }
    }
}

/// `sz_sa2u`: the size class of an aligned request (alignment 0 or 1 = none).
pub fn usable_size_aligned(size: u64, alignment: u64) -> u64 {
    if alignment <= 16 {
        return usable_size(size);
    }
    if size <= SMALL_MAX_CLASS && alignment <= PAGE {
        let small = usable_size(round_up(size, alignment));
        if small < LARGE_MIN_CLASS {
            return small;
        }
    }
    // Large extents carry their alignment padding outside the usable size.
    usable_size(size.max(LARGE_MIN_CLASS))
}

fn round_up(value: u64, multiple: u64) -> u64 {
    value.div_ceil(multiple) * multiple
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_classes() {
        let classes: Vec<u64> = [1, 8, 9, 16, 17, 33, 48, 49, 64, 65, 80, 100, 128, 129, 160]
            .iter()
            .map(|&s| usable_size(s))
            .collect();
        assert_eq!(
            classes,
            [8, 8, 16, 16, 32, 48, 48, 64, 64, 80, 80, 112, 128, 160, 160]
        );
    }

    #[test]
    fn large_classes() {
        assert_eq!(usable_size(512), 512);
        assert_eq!(usable_size(513), 640);
        assert_eq!(usable_size(4096), 4096);
        assert_eq!(usable_size(4097), 5120);
        // The example from jemalloc's docs and formats.md.
        assert_eq!(usable_size(100_000), 114_688);
        assert_eq!(usable_size(1 << 20), 1 << 20);
        assert_eq!(usable_size((1 << 20) + 1), 1_310_720);
    }

    #[test]
    fn aligned_classes() {
        assert_eq!(usable_size_aligned(100, 0), 112);
        assert_eq!(usable_size_aligned(100, 64), 128);
        assert_eq!(usable_size_aligned(4096, 4096), 4096);
        assert_eq!(usable_size_aligned(100, 8192), 16384);
    }
}
