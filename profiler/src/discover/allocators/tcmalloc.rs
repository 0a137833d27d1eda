//! gperftools' tcmalloc: `libtcmalloc.so.4`, with its `tc_*` API beside
//! the standard names.
use profiler_common::CallShape::{self, *};

use crate::discover::allocators::{Family, round_up};

pub struct Tcmalloc;

/// gperftools' `tc_*` API (its `malloc`... are aliases of these).
const TCMALLOC_ENTRY_POINTS: &[(&str, CallShape)] = &[
    ("tc_malloc", SizeArg0),
    ("tc_malloc_skip_new_handler", SizeArg0),
    ("tc_calloc", Calloc),
    ("tc_realloc", Realloc),
    ("tc_memalign", SizeArg1),
    ("tc_posix_memalign", PosixMemalign),
    ("tc_valloc", SizeArg0),
    ("tc_pvalloc", SizeArg0),
    ("tc_new", SizeArg0),
    ("tc_newarray", SizeArg0),
    ("tc_new_nothrow", SizeArg0),
    ("tc_newarray_nothrow", SizeArg0),
    ("tc_new_aligned", SizeArg0),
    ("tc_newarray_aligned", SizeArg0),
    ("tc_new_aligned_nothrow", SizeArg0),
    ("tc_newarray_aligned_nothrow", SizeArg0),
    ("tc_free", Free),
    ("tc_cfree", Free),
    ("tc_free_sized", Free),
    ("tc_delete", Free),
    ("tc_deletearray", Free),
    ("tc_delete_nothrow", Free),
    ("tc_deletearray_nothrow", Free),
    ("tc_delete_sized", Free),
    ("tc_deletearray_sized", Free),
    ("tc_delete_aligned", Free),
    ("tc_deletearray_aligned", Free),
    ("tc_delete_sized_aligned", Free),
    ("tc_deletearray_sized_aligned", Free),
    ("tc_delete_aligned_nothrow", Free),
    ("tc_deletearray_aligned_nothrow", Free),
];

impl Family for Tcmalloc {
    fn name(&self) -> &'static str {
        "tcmalloc"
    }

    fn signature(&self) -> &'static [&'static str] {
        &["tc_malloc", "tc_free", "tc_version"]
    }

    fn own_entry_points(&self) -> &'static [(&'static str, CallShape)] {
        TCMALLOC_ENTRY_POINTS
    }

    fn usable_size(&self, size: u64, alignment: u64) -> u64 {
        tcmalloc_usable_size(size.max(alignment))
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::discover::allocators::tests::sizes;

    #[test]
    fn tcmalloc_classes() {
        let expected = [
            8, 16, 32, 48, 48, 80, 112, 144, 208, 512, 576, 1024, 4096, 4608, 5120, 10240, 106_496,
            147_456, 204_800, 303_104, 1_048_576, 1_105_920, 5_005_312, 20_004_864,
        ];
        assert_eq!(sizes(&Tcmalloc), expected);
    }
}
