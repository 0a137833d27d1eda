//! Which of a file's unnamed frames are its allocator's own, and so not
//! the program's: the leading frames a sample drops.
use std::path::Path;

use crate::discover::{AllocatorKind, allocators_in_file};

/// Which unnamed frames of a file are its allocator's own.
#[derive(Debug)]
pub(super) enum AllocatorCode {
    /// It holds none of jemalloc, mimalloc or tcmalloc.
    None,
    /// Every unnamed frame: its allocator's functions are named.
    Whole,
    /// Only frames in the entry points found by their code, and what they
    /// branch to (file offsets): nothing else in the file is named, the
    /// program's own functions neither.
    Ranges(Vec<std::ops::Range<u64>>),
}

impl AllocatorCode {
    /// Whether the frame at file `offset` is the allocator's.
    pub(super) fn holds(&self, offset: u64) -> bool {
        match self {
            AllocatorCode::None => false,
            AllocatorCode::Whole => true,
            AllocatorCode::Ranges(ranges) => ranges.iter().any(|r| r.contains(&offset)),
        }
    }

    pub(super) fn of(path: &Path) -> Self {
        let kinds = [
            AllocatorKind::Jemalloc,
            AllocatorKind::Mimalloc,
            AllocatorKind::Tcmalloc,
        ];
        let Ok(allocators) = allocators_in_file(path, None, &kinds) else {
            return AllocatorCode::Whole;
        };
        let by_code = allocators
            .iter()
            .find_map(|a| Some((a.by_code.as_ref()?, a)));
        match by_code {
            _ if allocators.is_empty() => AllocatorCode::None,
            None => AllocatorCode::Whole,
            Some((found, allocator)) => {
                let own = allocator.fast_path.iter().flat_map(|f| f.own_code.iter());
                AllocatorCode::Ranges(found.extents.iter().chain(own).cloned().collect())
            }
        }
    }
}
