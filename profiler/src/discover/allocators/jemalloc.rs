//! jemalloc: recognised by `mallocx`, `rallocx` and `sdallocx` under one
//! prefix (`je_`, `_rjem_`, or none), probed at the standard C and C++
//! names under that prefix; its size classes are 5.3's (4 KiB pages,
//! 16-byte quantum), exact.
use profiler_common::CallShape;

use crate::binary::elf::FunctionSymbols;
use crate::discover::allocators::{Family, PAGE, quarter_doubling, round_up};

pub struct Jemalloc;

impl Family for Jemalloc {
    fn name(&self) -> &'static str {
        "jemalloc"
    }

    fn signature(&self) -> &'static [&'static str] {
        &["mallocx", "rallocx", "sdallocx"]
    }

    /// The prefix under which all of its signature functions exist.
    fn recognise(&self, symbols: &FunctionSymbols) -> Option<String> {
        detect_prefix(symbols, self.signature())
    }

    fn own_entry_points(&self) -> &'static [(&'static str, CallShape)] {
        &[]
    }

    fn usable_size(&self, size: u64, alignment: u64) -> u64 {
        usable_size_aligned(size, alignment)
    }
}

/// The prefix under which all of jemalloc's signature functions exist.
fn detect_prefix(symbols: &FunctionSymbols, signature: &[&str]) -> Option<String> {
    let mut candidates: Vec<String> = symbols
        .names()
        .filter_map(|name| name.strip_suffix(signature[0]))
        .filter(|prefix| {
            signature[1..]
                .iter()
                .all(|s| symbols.offset(&format!("{prefix}{s}")).is_some())
        })
        .map(str::to_owned)
        .collect();
    // Prefer the public names: the shortest prefix.
    candidates.sort_by_key(|p| (p.len(), p.clone()));
    candidates.into_iter().next()
}

const SMALL_MAX_CLASS: u64 = 14 * 1024;
const LARGE_MIN_CLASS: u64 = 16 * 1024;
/// Largest class jemalloc serves; bigger requests fail.
const MAX_CLASS: u64 = 1 << 62;

/// `sz_s2u`: the size class of a request.
fn usable_size(size: u64) -> u64 {
    match size {
        0..=8 => 8,
        9..=16 => 16,
        17..=64 => round_up(size, 16),
        _ if size > MAX_CLASS => size,
        _ => quarter_doubling(size),
    }
}

/// `sz_sa2u`: the size class of an aligned request (alignment 0 or 1 = none).
fn usable_size_aligned(size: u64, alignment: u64) -> u64 {
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
