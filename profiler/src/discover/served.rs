//! The entry points jemalloc's fast path serves (`malloc`, `operator
//! new`), and a jemalloc copy split by them: as probed on its slow path,
//! and the part its sampling windows attach.
use crate::discover::{Allocator, by_code, entry_points::EntryPoint};

/// Entry points whose calls the fast path serves (or the slow path sees):
/// not probed when sampling on the slow path.
pub const SERVED: [&str; 5] = [
    "malloc",
    "_Znwm",
    "_Znam",
    "_ZnwmRKSt9nothrow_t",
    "_ZnamRKSt9nothrow_t",
];

/// Whether the entry point `symbol` is one the fast path serves: one of
/// [`SERVED`], bare or with `prefix`, or an `operator new` found by its code.
pub fn is_served(symbol: &str, prefix: &str) -> bool {
    symbol.starts_with(by_code::OPERATOR_NEW)
        || SERVED
            .iter()
            .any(|s| symbol == *s || symbol.strip_prefix(prefix) == Some(s))
}

impl Allocator {
    /// This jemalloc copy as probed on its slow path: `malloc` and
    /// `operator new` give way to it; `None` where the fast path was not
    /// recognised. With `large_requests` (the process's limit was read),
    /// probed where the slow path sends requests no thread cache holds,
    /// if that was found; else at the slow path's entry.
    pub fn on_slow_path(&self, large_requests: bool) -> Option<Allocator> {
        let slow = self.fast_path.clone()?;
        let served = |symbol: &str| is_served(symbol, &self.prefix);
        let mut entry_points: Vec<EntryPoint> = self
            .entry_points
            .iter()
            .filter(|e| !served(&e.symbol))
            .cloned()
            .collect();
        match slow.large_requests.as_ref().filter(|_| large_requests) {
            Some(large) => entry_points.push(EntryPoint {
                symbol: format!("{}malloc's large requests", self.prefix),
                shape: profiler_common::CallShape::LargeRequest,
                file_offset: large.file_offset,
                placement: large.placement.clone(),
                forwards: false,
            }),
            None => entry_points.push(EntryPoint {
                symbol: format!("{}malloc's slow path", self.prefix),
                shape: profiler_common::CallShape::SlowPath,
                file_offset: slow.fast.slow_path,
                placement: slow.placement.clone(),
                forwards: false,
            }),
        }
        Some(Allocator {
            kind: self.kind,
            prefix: self.prefix.clone(),
            entry_points,
            fast_path: Some(slow),
            wrappers: self
                .wrappers
                .iter()
                .filter(|(_, inner)| !served(inner))
                .cloned()
                .collect(),
            own_sampling: None,
            by_code: self.by_code.clone(),
        })
    }

    /// For sampling in windows: the entry points the slow path stands in
    /// for (`malloc`, `operator new`), which the windows attach.
    pub fn windowed_part(&self) -> Option<Allocator> {
        let slow = self.on_slow_path(false)?;
        let kept: Vec<&str> = slow
            .entry_points
            .iter()
            .map(|e| e.symbol.as_str())
            .collect();
        let served = self
            .entry_points
            .iter()
            .filter(|e| !kept.contains(&e.symbol.as_str()))
            .cloned()
            .collect();
        Some(Allocator {
            kind: self.kind,
            prefix: self.prefix.clone(),
            entry_points: served,
            fast_path: self.fast_path.clone(),
            wrappers: Vec::new(),
            own_sampling: None,
            by_code: self.by_code.clone(),
        })
    }
}
