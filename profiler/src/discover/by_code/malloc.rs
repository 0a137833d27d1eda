//! The one `malloc` among the functions of its shape.
use std::collections::BTreeSet;

use crate::binary::{code::branch_targets, elf::FunctionSymbols};
use crate::discover::{by_code::Refusal, fast_path::FastPath};

/// What `malloc`'s shape told.
pub(super) struct Malloc {
    pub address: u64,
    pub fast: FastPath,
    /// The size class tables its fast path reads.
    pub tables: BTreeSet<u64>,
    /// The `operator new`s: the same fast path, another fallback.
    pub news: Vec<u64>,
}

/// The one `malloc` among the malloc-shaped functions: they all lead to
/// one slow path, `malloc` directly, `operator new` through a fallback
/// that branches to it.
pub(super) fn find_malloc(
    symbols: &FunctionSymbols,
    data: &[u8],
    shaped: Vec<(u64, FastPath, BTreeSet<u64>)>,
) -> Result<Malloc, Refusal> {
    let Some(&(_, first, _)) = shaped.first() else {
        return Err(Refusal::NoMalloc);
    };
    let same_counters = |f: &FastPath| f.tls == first.tls && f.allocated == first.allocated;
    if !shaped.iter().all(|(_, f, _)| same_counters(f)) {
        return Err(Refusal::CountersDiffer);
    }
    let targets: BTreeSet<u64> = shaped.iter().map(|(_, f, _)| f.slow_path).collect();
    let reaches = |from: u64, to: u64| {
        let end = symbols.next_function_start(from).unwrap_or(from + 4096);
        let len = end.saturating_sub(from).min(4096);
        symbols
            .code(data, from, len)
            .is_some_and(|code| branch_targets(code, from).contains(&to))
    };
    let roots: Vec<u64> = targets
        .iter()
        .copied()
        .filter(|&root| targets.iter().all(|&t| t == root || reaches(t, root)))
        .collect();
    let [slow_path] = roots[..] else {
        return Err(Refusal::NoSlowPath);
    };
    let (mallocs, news): (Vec<_>, Vec<_>) = shaped
        .into_iter()
        .partition(|(_, f, _)| f.slow_path == slow_path);
    let count = mallocs.len();
    let Ok([(address, fast, tables)]) = <[_; 1]>::try_from(mallocs) else {
        return Err(Refusal::Mallocs(count));
    };
    Ok(Malloc {
        address,
        fast,
        tables,
        news: news.into_iter().map(|n| n.0).collect(),
    })
}
