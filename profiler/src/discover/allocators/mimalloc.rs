//! Microsoft's mimalloc: `libmimalloc.so.2`, or linked into a library;
//! its own API beside the standard names.
use profiler_common::CallShape::{self, *};

use crate::discover::allocators::{Family, quarter_doubling, round_up};

pub struct Mimalloc;

/// mimalloc's own API (its `malloc`... overrides alias or wrap these).
/// Aligned variants take the size first, as `malloc` does: their
/// alignment only matters beyond mimalloc's size classes.
const MIMALLOC_ENTRY_POINTS: &[(&str, CallShape)] = &[
    ("mi_malloc", SizeArg0),
    ("mi_zalloc", SizeArg0),
    ("mi_malloc_small", SizeArg0),
    ("mi_zalloc_small", SizeArg0),
    ("mi_calloc", Calloc),
    ("mi_mallocn", Calloc),
    ("mi_realloc", Realloc),
    ("mi_reallocf", Realloc),
    ("mi_rezalloc", Realloc),
    ("mi_malloc_aligned", SizeArg0),
    ("mi_zalloc_aligned", SizeArg0),
    ("mi_calloc_aligned", Calloc),
    ("mi_realloc_aligned", Realloc),
    ("mi_rezalloc_aligned", Realloc),
    ("mi_posix_memalign", PosixMemalign),
    ("mi_memalign", SizeArg1),
    ("mi_aligned_alloc", SizeArg1),
    ("mi_valloc", SizeArg0),
    ("mi_pvalloc", SizeArg0),
    ("mi_new", SizeArg0),
    ("mi_new_aligned", SizeArg0),
    ("mi_new_nothrow", SizeArg0),
    ("mi_new_aligned_nothrow", SizeArg0),
    ("mi_free", Free),
    ("mi_cfree", Free),
    ("mi_free_size", Free),
    ("mi_free_aligned", Free),
    ("mi_free_size_aligned", Free),
];

impl Family for Mimalloc {
    fn name(&self) -> &'static str {
        "mimalloc"
    }

    fn signature(&self) -> &'static [&'static str] {
        &["mi_malloc", "mi_free", "mi_option_get"]
    }

    fn own_entry_points(&self) -> &'static [(&'static str, CallShape)] {
        MIMALLOC_ENTRY_POINTS
    }

    fn usable_size(&self, size: u64, alignment: u64) -> u64 {
        mimalloc_usable_size(size.max(alignment))
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::discover::allocators::tests::sizes;

    #[test]
    fn mimalloc_bins() {
        let expected = [
            8, 16, 32, 48, 48, 80, 112, 160, 224, 512, 640, 1024, 4096, 5120, 5120, 10240, 114_688,
            196_608, 262_144, 327_680, 1_048_576, 1_572_864, 5_242_880, 20_971_520,
        ];
        assert_eq!(sizes(&Mimalloc), expected);
    }
}
