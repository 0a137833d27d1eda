//! jemalloc's entry points, and which eBPF program watches each.
use std::collections::BTreeSet;

use iced_x86::Register;

use crate::discover::{elf::FunctionSymbols, placement::Placement};

pub use profiler_common::CallShape;

/// The argument registers the entry program of a shape reads.
pub fn registers_read(shape: CallShape) -> &'static [Register] {
    use Register::{RDI, RDX, RSI};
    match shape {
        CallShape::SizeArg0 | CallShape::Xallocx | CallShape::Free => &[RDI],
        CallShape::SizeArg1 | CallShape::Calloc | CallShape::Realloc | CallShape::Mallocx => {
            &[RDI, RSI]
        }
        CallShape::PosixMemalign | CallShape::Rallocx => &[RDI, RSI, RDX],
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

/// Functions only jemalloc defines, all three together: how an object is
/// recognised as jemalloc, whatever its prefix.
pub const SIGNATURE: [&str; 3] = ["mallocx", "rallocx", "sdallocx"];

/// An entry point found in a jemalloc instance.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EntryPoint {
    /// The symbol, with its prefix.
    pub symbol: String,
    pub shape: CallShape,
    /// File offset of the function's first instruction.
    pub file_offset: u64,
    /// Where in the function the probe goes.
    pub placement: Placement,
}

/// Finds jemalloc's entry points in `symbols`, with the prefix they carry.
pub fn find_entry_points(symbols: &FunctionSymbols) -> Option<(String, Vec<EntryPoint>)> {
    let prefix = detect_prefix(symbols)?;
    let mut entry_points: Vec<EntryPoint> = C_ENTRY_POINTS
        .iter()
        .map(|(name, shape)| (format!("{prefix}{name}"), *shape))
        .chain(CXX_ENTRY_POINTS.iter().map(|(n, s)| (n.to_string(), *s)))
        .filter_map(|(symbol, shape)| {
            let file_offset = symbols.offset(&symbol)?;
            Some(EntryPoint {
                symbol,
                shape,
                file_offset,
                placement: Placement::entry("not analysed"),
            })
        })
        .collect();
    // Aliases (free and sdallocx sharing code, say) must be probed once.
    let mut offsets = BTreeSet::new();
    entry_points.retain(|e| offsets.insert(e.file_offset));
    Some((prefix, entry_points))
}

/// The prefix under which all of jemalloc's signature functions exist.
fn detect_prefix(symbols: &FunctionSymbols) -> Option<String> {
    let mut candidates: Vec<String> = symbols
        .names()
        .filter_map(|name| name.strip_suffix(SIGNATURE[0]))
        .filter(|prefix| {
            SIGNATURE[1..]
                .iter()
                .all(|s| symbols.offset(&format!("{prefix}{s}")).is_some())
        })
        .map(str::to_owned)
        .collect();
    // Prefer the public names: the shortest prefix.
    candidates.sort_by_key(|p| (p.len(), p.clone()));
    candidates.into_iter().next()
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
}
