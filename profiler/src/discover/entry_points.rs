//! Allocators' entry points, and which eBPF program watches each.
use std::collections::BTreeSet;

use iced_x86::Register;

use crate::binary::{elf::FunctionSymbols, placement::Placement};
use crate::discover::allocators::AllocatorKind;

pub use profiler_common::CallShape;

/// The argument registers the entry program of a shape reads.
pub fn registers_read(shape: CallShape) -> &'static [Register] {
    use Register::{RCX, RDI, RDX, RSI};
    match shape {
        CallShape::SizeArg0 | CallShape::Xallocx | CallShape::Free | CallShape::SlowPath => &[RDI],
        CallShape::SizeArg1
        | CallShape::Calloc
        | CallShape::Realloc
        | CallShape::Mallocx
        | CallShape::FreeInResize => &[RDI, RSI],
        CallShape::PosixMemalign | CallShape::Rallocx | CallShape::LargeRequest => &[RDI, RSI, RDX],
        CallShape::OwnSample => &[RSI, RCX],
    }
}

/// C entry points; jemalloc may be built with a prefix (`je_`, `_rjem_`).
pub const C_ENTRY_POINTS: &[(&str, CallShape)] = &[
    ("malloc", CallShape::SizeArg0),
    ("calloc", CallShape::Calloc),
    ("realloc", CallShape::Realloc),
    ("free", CallShape::Free),
    ("posix_memalign", CallShape::PosixMemalign),
    ("aligned_alloc", CallShape::SizeArg1),
    ("memalign", CallShape::SizeArg1),
    ("valloc", CallShape::SizeArg0),
    ("mallocx", CallShape::Mallocx),
    ("rallocx", CallShape::Rallocx),
    ("xallocx", CallShape::Xallocx),
    ("dallocx", CallShape::Free),
    ("sdallocx", CallShape::Free),
];

/// The C++ operators jemalloc provides (mangled, never prefixed).
pub const CXX_ENTRY_POINTS: &[(&str, CallShape)] = &[
    ("_Znwm", CallShape::SizeArg0),
    ("_Znam", CallShape::SizeArg0),
    ("_ZnwmRKSt9nothrow_t", CallShape::SizeArg0),
    ("_ZnamRKSt9nothrow_t", CallShape::SizeArg0),
    ("_ZnwmSt11align_val_t", CallShape::SizeArg0),
    ("_ZnamSt11align_val_t", CallShape::SizeArg0),
    ("_ZnwmSt11align_val_tRKSt9nothrow_t", CallShape::SizeArg0),
    ("_ZnamSt11align_val_tRKSt9nothrow_t", CallShape::SizeArg0),
    ("_ZdlPv", CallShape::Free),
    ("_ZdaPv", CallShape::Free),
    ("_ZdlPvm", CallShape::Free),
    ("_ZdaPvm", CallShape::Free),
    ("_ZdlPvRKSt9nothrow_t", CallShape::Free),
    ("_ZdaPvRKSt9nothrow_t", CallShape::Free),
    ("_ZdlPvSt11align_val_t", CallShape::Free),
    ("_ZdaPvSt11align_val_t", CallShape::Free),
    ("_ZdlPvmSt11align_val_t", CallShape::Free),
    ("_ZdaPvmSt11align_val_t", CallShape::Free),
    ("_ZdlPvSt11align_val_tRKSt9nothrow_t", CallShape::Free),
    ("_ZdaPvSt11align_val_tRKSt9nothrow_t", CallShape::Free),
];

/// An entry point found in an allocator.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EntryPoint {
    /// The symbol, with its prefix.
    pub symbol: String,
    pub shape: CallShape,
    /// File offset of the function's first instruction.
    pub file_offset: u64,
    /// Where in the function the probe goes.
    pub placement: Placement,
    /// Whether the function may pass its call on to another entry point of
    /// its allocator (glibc's realloc calling malloc): the kernel then does
    /// not count that inner call again.
    pub forwards: bool,
}

/// An allocator found in a file: its kind, prefix and entry points.
#[derive(Clone, Debug)]
pub struct FoundEntryPoints {
    pub kind: AllocatorKind,
    pub prefix: String,
    pub entry_points: Vec<EntryPoint>,
}

/// Finds the allocators of `wanted` kinds in `symbols`. A function is
/// claimed by one allocator only, in [`AllocatorKind::ALL`]'s order.
pub fn find_allocators(
    symbols: &FunctionSymbols,
    wanted: &[AllocatorKind],
) -> Vec<FoundEntryPoints> {
    let mut claimed = BTreeSet::new();
    let mut found = Vec::new();
    for kind in AllocatorKind::ALL
        .into_iter()
        .filter(|k| wanted.contains(k))
    {
        let Some(prefix) = kind.family().recognise(symbols) else {
            continue;
        };
        let entry_points: Vec<EntryPoint> = kind
            .entry_point_names(&prefix)
            .into_iter()
            .filter_map(|(symbol, shape)| {
                let file_offset = symbols.offset(&symbol)?;
                Some(EntryPoint {
                    symbol,
                    shape,
                    file_offset,
                    placement: Placement::entry("not analysed"),
                    forwards: false,
                })
            })
            // Aliases (free and sdallocx sharing code, say) are probed once.
            .filter(|e| claimed.insert(e.file_offset))
            .collect();
        if !entry_points.is_empty() {
            found.push(FoundEntryPoints {
                kind,
                prefix,
                entry_points,
            });
        }
    }
    found
}

/// Finds jemalloc's entry points in `symbols`, with the prefix they carry.
#[cfg(test)]
pub fn find_entry_points(symbols: &FunctionSymbols) -> Option<(String, Vec<EntryPoint>)> {
    find_allocators(symbols, &[AllocatorKind::Jemalloc])
        .pop()
        .map(|found| (found.prefix, found.entry_points))
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    /// The symbols of a system library, or `None` (with a message) where
    /// this machine has no such file: `cargo xtask test` installs them.
    fn symbols_of(path: &Path) -> Option<FunctionSymbols> {
        let Ok(data) = std::fs::read(path) else {
            eprintln!("skipped: {} is not installed", path.display());
            return None;
        };
        Some(FunctionSymbols::parse(&data).unwrap())
    }

    #[test]
    fn finds_debians_libjemalloc_entry_points() {
        // Debian's libjemalloc2.
        let path = Path::new("/usr/lib/x86_64-linux-gnu/libjemalloc.so.2");
        let Some(symbols) = symbols_of(path) else {
            return;
        };
        let (prefix, entry_points) = find_entry_points(&symbols).unwrap();
        assert_eq!(prefix, "");
        let names: Vec<&str> = entry_points.iter().map(|e| e.symbol.as_str()).collect();
        for expected in ["malloc", "free", "mallocx", "sdallocx", "_Znwm", "_ZdlPvm"] {
            assert!(
                names.contains(&expected),
                "{expected} missing from {names:?}"
            );
        }
    }

    #[test]
    fn glibc_is_not_jemalloc() {
        let Some(symbols) = symbols_of(Path::new("/lib/x86_64-linux-gnu/libc.so.6")) else {
            return;
        };
        assert!(symbols.offset("malloc").is_some());
        assert!(find_entry_points(&symbols).is_none());
    }

    /// Each library holds its own allocator and no other, though mimalloc
    /// and tcmalloc define `__libc_malloc` as glibc does.
    #[test]
    fn each_allocator_is_recognised_in_its_library() {
        let dir = Path::new("/usr/lib/x86_64-linux-gnu");
        let cases = [
            ("libc.so.6", AllocatorKind::Glibc, "malloc"),
            ("libjemalloc.so.2", AllocatorKind::Jemalloc, "malloc"),
            ("libmimalloc.so.2", AllocatorKind::Mimalloc, "mi_malloc"),
            ("libtcmalloc.so.4", AllocatorKind::Tcmalloc, "tc_malloc"),
        ];
        for (file, kind, first) in cases {
            let Some(symbols) = symbols_of(&dir.join(file)) else {
                continue;
            };
            let found = find_allocators(&symbols, &AllocatorKind::ALL);
            let kinds: Vec<AllocatorKind> = found.iter().map(|f| f.kind).collect();
            assert_eq!(kinds, [kind], "{file}");
            let names: Vec<&str> = found[0]
                .entry_points
                .iter()
                .map(|e| e.symbol.as_str())
                .collect();
            assert!(names.contains(&first), "{file}: {names:?}");
            // `malloc` aliases the allocator's own function: probed once.
            let malloc = symbols.offset("malloc").unwrap();
            let at_malloc = found[0]
                .entry_points
                .iter()
                .filter(|e| e.file_offset == malloc)
                .count();
            assert_eq!(at_malloc, 1, "{file}");
        }
    }
}
