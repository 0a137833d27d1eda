//! Entry points that pass their call on to another: wrappers (a
//! straight-line jump or call to another entry point, such as operator
//! new[] to operator new) are not probed, since the inner one sees the
//! call; allocating entry points that may call another on some path (glibc's
//! realloc calls malloc) are marked, so that one call is not counted twice.
use std::collections::HashMap;

use crate::binary::{
    code::{branch_targets, plt_stub_symbol, straight_line_exit},
    elf::FunctionSymbols,
};
use crate::discover::entry_points::EntryPoint;

/// Separates entry points whose straight-line path calls or jumps to another
/// entry point (directly or through the PLT) from those to probe.
pub(super) fn split_wrappers(
    symbols: &FunctionSymbols,
    data: &[u8],
    entry_points: Vec<EntryPoint>,
) -> (Vec<EntryPoint>, Vec<(String, String)>) {
    let by_address: HashMap<u64, String> = entry_points
        .iter()
        .filter_map(|e| Some((symbols.function(&e.symbol)?.address, e.symbol.clone())))
        .collect();
    let inner_of = |entry: &EntryPoint| -> Option<String> {
        let function = symbols.function(&entry.symbol)?;
        let code = symbols.code(data, function.address, function.size.max(64))?;
        let target = straight_line_exit(code, function.address)?;
        if let Some(inner) = by_address.get(&target) {
            return Some(inner.clone());
        }
        let via_plt = plt_stub_symbol(symbols, data, target)?;
        by_address
            .values()
            .any(|name| *name == via_plt)
            .then(|| via_plt.to_owned())
    };
    let mut probed = Vec::new();
    let mut wrappers = Vec::new();
    for entry in entry_points {
        match inner_of(&entry) {
            Some(inner) if inner != entry.symbol => wrappers.push((entry.symbol, inner)),
            _ => probed.push(entry),
        }
    }
    (probed, wrappers)
}

/// Most bytes of a helper without a symbol read when following a branch
/// into it (its end comes from the call frame information).
const HELPER_BYTES: u64 = 4096;

/// Whether an allocating entry point's code calls or jumps to another entry
/// point of the file, directly, through the PLT, or through one helper
/// (glibc's memalign jumps to `_mid_memalign`, which jumps to malloc).
pub(super) fn may_forward(
    symbols: &FunctionSymbols,
    data: &[u8],
    entry: &EntryPoint,
    entry_addresses: &[u64],
) -> bool {
    if !entry.shape.allocates() {
        return false;
    }
    let Some(function) = symbols.function(&entry.symbol) else {
        return false;
    };
    let is_entry = |target: u64| {
        target != function.address
            && (entry_addresses.contains(&target)
                || plt_stub_symbol(symbols, data, target)
                    .and_then(|name| symbols.function(name))
                    .is_some_and(|f| {
                        f.address != function.address && entry_addresses.contains(&f.address)
                    }))
    };
    let targets_of = |address: u64, len: u64| {
        symbols
            .code(data, address, len)
            .map(|code| branch_targets(code, address))
            .unwrap_or_default()
    };
    // A helper's extent ends where the next function starts; unknown
    // extents are not followed.
    let helper_targets = |address: u64| match symbols.next_function_start(address) {
        Some(next) if next > address => targets_of(address, (next - address).min(HELPER_BYTES)),
        _ => Vec::new(),
    };
    let end = function.address + function.size.max(16);
    targets_of(function.address, function.size.max(16))
        .into_iter()
        .filter(|&t| t < function.address || t >= end)
        .any(|target| {
            is_entry(target)
                || (!symbols.is_plt(target) && helper_targets(target).into_iter().any(&is_entry))
        })
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::discover::{AllocatorKind, allocators_in_file};

    #[test]
    fn wrappers_of_debians_libjemalloc_are_not_probed() {
        let path = Path::new("/usr/lib/x86_64-linux-gnu/libjemalloc.so.2");
        if !path.exists() {
            eprintln!("skipped: {} is not installed", path.display());
            return;
        }
        let allocator = allocators_in_file(path, None, &[AllocatorKind::Jemalloc])
            .unwrap()
            .pop()
            .expect("jemalloc found");
        let wrappers: HashMap<&str, &str> = allocator
            .wrappers
            .iter()
            .map(|(w, i)| (w.as_str(), i.as_str()))
            .collect();
        // operator new[] is `jmp operator new`.
        assert_eq!(wrappers.get("_Znam"), Some(&"_Znwm"));
        // Aligned operator new calls aligned_alloc through the PLT.
        assert_eq!(wrappers.get("_ZnwmSt11align_val_t"), Some(&"aligned_alloc"));
        let probed: Vec<&str> = allocator
            .entry_points
            .iter()
            .map(|e| e.symbol.as_str())
            .collect();
        for name in ["malloc", "_Znwm", "aligned_alloc", "free", "sdallocx"] {
            assert!(probed.contains(&name), "{name} not probed: {probed:?}");
        }
        assert!(!probed.contains(&"_Znam"));
    }

    /// glibc's realloc and memalign family call malloc; malloc and free
    /// call no other entry point.
    #[test]
    fn glibcs_forwarding_entry_points_are_found() {
        let path = Path::new("/lib/x86_64-linux-gnu/libc.so.6");
        let Some(allocator) = allocators_in_file(path, None, &[AllocatorKind::Glibc])
            .unwrap()
            .pop()
        else {
            eprintln!("skipped: no glibc at {}", path.display());
            return;
        };
        let forwards: HashMap<&str, bool> = allocator
            .entry_points
            .iter()
            .map(|e| (e.symbol.as_str(), e.forwards))
            .collect();
        for name in ["realloc", "posix_memalign", "aligned_alloc"] {
            assert_eq!(forwards.get(name), Some(&true), "{name}: {forwards:?}");
        }
        for name in ["malloc", "free", "calloc"] {
            assert_eq!(forwards.get(name), Some(&false), "{name}: {forwards:?}");
        }
    }
}
