//! The allocators memprobe knows: how each is recognised in a file, and
//! the entry points it is probed at.
use crate::discover::{
    elf::FunctionSymbols,
    entry_points::{C_ENTRY_POINTS, CXX_ENTRY_POINTS},
};
use profiler_common::CallShape;

/// A family of allocator, each with its entry points and size classes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum AllocatorKind {
    Jemalloc,
    /// glibc's malloc (ptmalloc), in `libc.so.6` or a static binary.
    Glibc,
    /// Microsoft's mimalloc: `libmimalloc.so.2`, or linked into a library.
    Mimalloc,
    /// gperftools' tcmalloc: `libtcmalloc.so.4`.
    Tcmalloc,
}

use CallShape::{Calloc, Free, PosixMemalign, Realloc, SizeArg0, SizeArg1};

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

impl AllocatorKind {
    /// The order in which a file's entry points are claimed: an allocator
    /// with its own API first, so that `malloc` aliasing `mi_malloc` goes
    /// to mimalloc.
    pub const ALL: [AllocatorKind; 4] = [
        AllocatorKind::Mimalloc,
        AllocatorKind::Tcmalloc,
        AllocatorKind::Jemalloc,
        AllocatorKind::Glibc,
    ];

    pub fn name(self) -> &'static str {
        match self {
            AllocatorKind::Jemalloc => "jemalloc",
            AllocatorKind::Glibc => "glibc",
            AllocatorKind::Mimalloc => "mimalloc",
            AllocatorKind::Tcmalloc => "tcmalloc",
        }
    }

    /// Functions only this allocator defines, all together: how it is
    /// recognised (jemalloc's may carry a prefix, see `entry_points`).
    pub(crate) fn signature(self) -> &'static [&'static str] {
        match self {
            AllocatorKind::Jemalloc => &["mallocx", "rallocx", "sdallocx"],
            // mimalloc and tcmalloc define `__libc_malloc` too, not these.
            AllocatorKind::Glibc => &["__libc_malloc", "__libc_mallopt", "malloc_trim"],
            AllocatorKind::Mimalloc => &["mi_malloc", "mi_free", "mi_option_get"],
            AllocatorKind::Tcmalloc => &["tc_malloc", "tc_free", "tc_version"],
        }
    }

    /// The entry points to look for, with `prefix` (jemalloc's) applied to
    /// the C names.
    pub(crate) fn entry_point_names(self, prefix: &str) -> Vec<(String, CallShape)> {
        let own: &[(&str, CallShape)] = match self {
            AllocatorKind::Jemalloc => &[],
            AllocatorKind::Glibc => GLIBC_ENTRY_POINTS,
            AllocatorKind::Mimalloc => MIMALLOC_ENTRY_POINTS,
            AllocatorKind::Tcmalloc => TCMALLOC_ENTRY_POINTS,
        };
        let standard: &[(&str, CallShape)] = match self {
            AllocatorKind::Glibc => &[],
            _ => C_ENTRY_POINTS,
        };
        let cxx: &[(&str, CallShape)] = match self {
            AllocatorKind::Glibc => &[],
            _ => CXX_ENTRY_POINTS,
        };
        own.iter()
            .map(|(n, s)| (n.to_string(), *s))
            .chain(standard.iter().map(|(n, s)| (format!("{prefix}{n}"), *s)))
            .chain(cxx.iter().map(|(n, s)| (n.to_string(), *s)))
            .collect()
    }

    /// Whether `symbols` hold this allocator (other than jemalloc, whose
    /// prefix is found by `entry_points::detect_prefix`).
    pub(crate) fn is_in(self, symbols: &FunctionSymbols) -> bool {
        self.signature()
            .iter()
            .all(|name| symbols.offset(name).is_some())
    }
}

impl std::fmt::Display for AllocatorKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}
