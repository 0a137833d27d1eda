//! The allocators memprobe knows, one module each behind [`Family`]: how
//! each is recognised in a file, the entry points it is probed at, and the
//! usable size it gives a request.
mod glibc;
mod jemalloc;
mod mimalloc;
mod tcmalloc;

use profiler_common::CallShape;

use crate::binary::elf::FunctionSymbols;
use crate::discover::entry_points::{C_ENTRY_POINTS, CXX_ENTRY_POINTS};

/// What memprobe knows of one allocator.
pub trait Family: Sync {
    /// Its name, as profiles and messages give it.
    fn name(&self) -> &'static str;

    /// Functions only it defines, all together: how it is recognised.
    fn signature(&self) -> &'static [&'static str];

    /// The prefix its entry points carry in `symbols`, where it is there
    /// (none for all but jemalloc, which may be built with one).
    fn recognise(&self, symbols: &FunctionSymbols) -> Option<String> {
        let all = self
            .signature()
            .iter()
            .all(|name| symbols.offset(name).is_some());
        all.then(String::new)
    }

    /// Its own API's entry points.
    fn own_entry_points(&self) -> &'static [(&'static str, CallShape)];

    /// Whether it is probed at the standard C and C++ names too.
    fn takes_standard_names(&self) -> bool {
        true
    }

    /// The usable size of a request of `size` bytes aligned to `alignment`
    /// (0 or 1 = none), on x86-64: what it holds for the request (its
    /// `malloc_usable_size`), so that estimates match what it and its users
    /// (Redis, Arrow) count.
    fn usable_size(&self, size: u64, alignment: u64) -> u64;
}

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

    /// What memprobe knows of this allocator.
    pub fn family(self) -> &'static dyn Family {
        match self {
            AllocatorKind::Jemalloc => &jemalloc::Jemalloc,
            AllocatorKind::Glibc => &glibc::Glibc,
            AllocatorKind::Mimalloc => &mimalloc::Mimalloc,
            AllocatorKind::Tcmalloc => &tcmalloc::Tcmalloc,
        }
    }

    pub fn name(self) -> &'static str {
        self.family().name()
    }

    /// The usable size of a request of `size` bytes aligned to `alignment`.
    pub fn usable_size(self, size: u64, alignment: u64) -> u64 {
        self.family().usable_size(size, alignment)
    }

    /// The entry points to look for, with `prefix` (jemalloc's) applied to
    /// the C names.
    pub(crate) fn entry_point_names(self, prefix: &str) -> Vec<(String, CallShape)> {
        let family = self.family();
        let own = family.own_entry_points();
        let (standard, cxx) = match family.takes_standard_names() {
            true => (C_ENTRY_POINTS, CXX_ENTRY_POINTS),
            false => (&[][..], &[][..]),
        };
        own.iter()
            .map(|(n, s)| (n.to_string(), *s))
            .chain(standard.iter().map(|(n, s)| (format!("{prefix}{n}"), *s)))
            .chain(cxx.iter().map(|(n, s)| (n.to_string(), *s)))
            .collect()
    }
}

impl std::fmt::Display for AllocatorKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

const PAGE: u64 = 4096;

fn round_up(value: u64, multiple: u64) -> u64 {
    value.div_ceil(multiple) * multiple
}

/// Four classes per doubling: spacing is a quarter of the lower power of two.
fn quarter_doubling(size: u64) -> u64 {
    let lg_floor = 63 - (size - 1).leading_zeros() as u64;
    round_up(size, 1u64 << (lg_floor - 2))
}

#[cfg(test)]
pub(super) mod tests {
    use super::Family;

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

    pub fn sizes(family: &dyn Family) -> Vec<u64> {
        REQUESTS.iter().map(|&s| family.usable_size(s, 0)).collect()
    }
}
