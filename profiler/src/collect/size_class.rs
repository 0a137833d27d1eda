//! The usable size an allocation occupies, per allocator, on x86-64: what
//! the allocator holds for it (its `malloc_usable_size`), so that estimates
//! match what the allocator and its users (Redis, Arrow) count.
//! jemalloc 5.3's size classes (4 KiB pages, 16-byte quantum) are exact;
//! the others are checked against each allocator's `malloc_usable_size` in
//! the tests below (Debian 12's glibc 2.36, mimalloc 2.0.9, gperftools 2.10).
use crate::discover::AllocatorKind;

/// The usable size of a request of `size` bytes aligned to `alignment`
/// (0 or 1 = none) from `allocator`.
pub fn usable_size_of(allocator: AllocatorKind, size: u64, alignment: u64) -> u64 {
    match allocator {
        AllocatorKind::Jemalloc => usable_size_aligned(size, alignment),
        AllocatorKind::Glibc => glibc_usable_size(size),
        AllocatorKind::Mimalloc => mimalloc_usable_size(size.max(alignment)),
        AllocatorKind::Tcmalloc => tcmalloc_usable_size(size.max(alignment)),
    }
}

/// glibc: a chunk of the size plus its 8-byte header, 16-aligned, 32 at
/// least, of which all but the header is usable. From 128 KiB (glibc's
/// first mmap threshold; it rises as mmapped chunks are freed) a chunk is
/// mmapped: header and size rounded up to pages, less a 16-byte header.
fn glibc_usable_size(size: u64) -> u64 {
    const MMAP_THRESHOLD: u64 = 128 * 1024;
    let chunk = round_up(size + 8, 16).max(32);
    if size >= MMAP_THRESHOLD {
        return round_up(chunk + 8, PAGE) - 16;
    }
    chunk - 8
}

/// mimalloc 2.0: 16-byte steps up to 64 bytes (8 below 16), then four
/// bins per doubling up to 128 KiB; larger objects take whole 64 KiB
/// slices up to 512 KiB, then 512 KiB units up to 8 MiB, 1 MiB units up to
/// 32 MiB and 4 MiB units beyond.
fn mimalloc_usable_size(size: u64) -> u64 {
    const KIB: u64 = 1024;
    const MIB: u64 = 1024 * KIB;
    match size {
        0..=8 => 8,
        9..=64 => round_up(size, 16),
        _ if size <= 128 * KIB => quarter_doubling(size),
        _ if size <= 512 * KIB => round_up(size, 64 * KIB),
        _ if size <= 8 * MIB => round_up(size, 512 * KIB),
        _ if size <= 32 * MIB => round_up(size, MIB),
        _ => round_up(size, 4 * MIB),
    }
}

/// gperftools tcmalloc 2.10 (8 KiB pages): 8 bytes, then 16-byte steps
/// below 128, then eight classes per doubling (at most a page apart) up to
/// 256 KiB; larger objects take whole pages. It merges some classes at
/// start-up, which may make a few a step larger.
fn tcmalloc_usable_size(size: u64) -> u64 {
    const TC_PAGE: u64 = 8192;
    const MAX_SMALL: u64 = 256 * 1024;
    match size {
        0..=8 => 8,
        9..=127 => round_up(size, 16),
        _ if size > MAX_SMALL => round_up(size, TC_PAGE),
        _ => {
            let lg_floor = 63 - size.leading_zeros() as u64;
            round_up(size, ((1u64 << lg_floor) / 8).min(TC_PAGE))
        }
    }
}

/// Four classes per doubling: spacing is a quarter of the lower power of two.
fn quarter_doubling(size: u64) -> u64 {
    let lg_floor = 63 - (size - 1).leading_zeros() as u64;
    round_up(size, 1u64 << (lg_floor - 2))
}

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
        _ => quarter_doubling(size),
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

    /// Each allocator's `malloc_usable_size` for these requests, as printed
    /// on Debian 12 (see the module's comment).
    const REQUESTS: [u64; 24] = [
        1,
        9,
        17,
        33,
        48,
        65,
        100,
        129,
        200,
        500,
        513,
        1000,
        4096,
        4097,
        5000,
        10000,
        100_000,
        140_000,
        200_000,
        300_000,
        1 << 20,
        1_100_000,
        5_000_000,
        20_000_000,
    ];

    fn sizes(allocator: AllocatorKind) -> Vec<u64> {
        REQUESTS
            .iter()
            .map(|&s| usable_size_of(allocator, s, 0))
            .collect()
    }

    #[test]
    fn glibc_chunks() {
        let expected = [
            24, 24, 24, 40, 56, 72, 104, 136, 200, 504, 520, 1000, 4104, 4104, 5000, 10008,
            100_008, 143_344, 200_688, 303_088, 1_052_656, 1_101_808, 5_001_200, 20_000_752,
        ];
        assert_eq!(sizes(AllocatorKind::Glibc), expected);
    }

    #[test]
    fn mimalloc_bins() {
        let expected = [
            8, 16, 32, 48, 48, 80, 112, 160, 224, 512, 640, 1024, 4096, 5120, 5120, 10240, 114_688,
            196_608, 262_144, 327_680, 1_048_576, 1_572_864, 5_242_880, 20_971_520,
        ];
        assert_eq!(sizes(AllocatorKind::Mimalloc), expected);
    }

    #[test]
    fn tcmalloc_classes() {
        let expected = [
            8, 16, 32, 48, 48, 80, 112, 144, 208, 512, 576, 1024, 4096, 4608, 5120, 10240, 106_496,
            147_456, 204_800, 303_104, 1_048_576, 1_105_920, 5_005_312, 20_004_864,
        ];
        assert_eq!(sizes(AllocatorKind::Tcmalloc), expected);
    }

    #[test]
    fn aligned_classes() {
        assert_eq!(usable_size_aligned(100, 0), 112);
        assert_eq!(usable_size_aligned(100, 64), 128);
        assert_eq!(usable_size_aligned(4096, 4096), 4096);
        assert_eq!(usable_size_aligned(100, 8192), 16384);
    }
}
