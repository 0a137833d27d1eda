//! glibc's malloc (ptmalloc), in `libc.so.6` or a static binary: the
//! family `man 3 malloc` lists.
use profiler_common::CallShape::{self, *};

use crate::discover::allocators::{Family, PAGE, round_up};

pub struct Glibc;

/// glibc's malloc family, as `man 3 malloc` lists it.
const GLIBC_ENTRY_POINTS: &[(&str, CallShape)] = &[
    ("malloc", SizeArg0),
    ("free", Free),
    ("calloc", Calloc),
    ("realloc", Realloc),
    ("posix_memalign", PosixMemalign),
    ("aligned_alloc", SizeArg1),
    ("memalign", SizeArg1),
    ("valloc", SizeArg0),
    ("pvalloc", SizeArg0),
];

impl Family for Glibc {
    fn name(&self) -> &'static str {
        "glibc"
    }

    /// (mimalloc and tcmalloc define `__libc_malloc` too, not these.)
    fn signature(&self) -> &'static [&'static str] {
        &["__libc_malloc", "__libc_mallopt", "malloc_trim"]
    }

    fn own_entry_points(&self) -> &'static [(&'static str, CallShape)] {
        GLIBC_ENTRY_POINTS
    }

    /// Its entry points are its own names alone (`malloc`... are them).
    fn takes_standard_names(&self) -> bool {
        false
    }

    /// (An aligned request's chunk is the size's: glibc carves the
    /// alignment's padding off as a chunk of its own.)
    fn usable_size(&self, size: u64, _alignment: u64) -> u64 {
        glibc_usable_size(size)
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::discover::allocators::tests::sizes;

    #[test]
    fn glibc_chunks() {
        let expected = [
            24, 24, 24, 40, 56, 72, 104, 136, 200, 504, 520, 1000, 4104, 4104, 5000, 10008,
            100_008, 143_344, 200_688, 303_088, 1_052_656, 1_101_808, 5_001_200, 20_000_752,
        ];
        assert_eq!(sizes(&Glibc), expected);
    }
}
