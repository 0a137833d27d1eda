//! jemalloc's own heap profiler, in targets that run it (`prof:true` with
//! `prof.active`): every allocation it samples passes through
//! `prof_malloc_sample_object(tsd, ptr, size, usize, tctx)`, and a sampled
//! object (promoted out of the small size classes, page aligned) always
//! leaves the inlined free fast path for `free_default` or
//! `sdallocx_default`. Probing those instead of every call costs a trap per
//! sample and per slow free, not one per call. Found by name, all local
//! symbols: in the file's symbol table (static Rust and C++ builds usually
//! keep it) or in its separate debug file (a stripped build, such as
//! Debian's libjemalloc.so.2 with its debug package installed).
use std::{ops::Range, sync::Arc};

use object::{Object, ObjectSymbol};
use profiler_common::CallShape;

use crate::binary::{
    elf::{FunctionSymbols, Segment},
    placement::Placement,
};
use crate::discover::{
    Allocator,
    entry_points::{C_ENTRY_POINTS, CXX_ENTRY_POINTS, EntryPoint},
    fast_path, place_probe,
};

/// Where a jemalloc copy keeps its profiler's switches. They live in
/// `.bss` and `.data`, so they are placed by address, from where the
/// file's first loadable segment is mapped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProfSwitches {
    /// The first loadable segment's file offset and address.
    pub anchor: (u64, u64),
    /// Addresses in the file of `opt_prof` (bool), `prof_active_state`
    /// (bool), `prof_thread_active_init` (bool: whether new threads
    /// sample) and `lg_prof_sample` (size_t: the mean interval's log2).
    pub opt_prof: u64,
    pub active: u64,
    pub thread_active_init: u64,
    pub lg_sample: u64,
}

/// What probing a jemalloc copy through its own profiler takes.
#[derive(Clone, Debug)]
pub struct OwnSampling {
    /// `prof_malloc_sample_object`.
    pub sample: EntryPoint,
    /// `free_default` and `sdallocx_default`, those the build kept.
    pub slow_frees: Vec<EntryPoint>,
    pub switches: ProfSwitches,
    /// File-offset extents of jemalloc's code between the sample's probe
    /// and the program: the allocating entry points and what they branch to.
    pub own_code: Arc<[Range<u64>]>,
}

/// Entry points that free a sampled object without passing the free slow
/// paths, probed as frees of their first argument: resizes that may move
/// (which free the old object inside, unless they fail: then the free is
/// undone at their return), and `dallocx`, which has no fast path. Not
/// `xallocx`: it often fails, and then the object stays (one it resized in
/// place and jemalloc sampled anew replaces the old sample; one not
/// sampled anew is freed through a slow path later).
const INNER_FREES: [(&str, CallShape); 3] = [
    ("realloc", CallShape::FreeInResize),
    ("rallocx", CallShape::FreeInResize),
    ("dallocx", CallShape::Free),
];

/// jemalloc's internal names: `je_` after the public prefix (tikv's
/// `_rjem_je_`), or `je_` alone.
fn internal_names(prefix: &str, name: &str) -> [String; 2] {
    [format!("{prefix}je_{name}"), format!("je_{name}")]
}

impl OwnSampling {
    /// Whether `symbols` name the hook every sample of jemalloc's profiler
    /// passes (a build without `config.prof`, or stripped, has none).
    pub(crate) fn hooks_named(symbols: &FunctionSymbols, prefix: &str) -> bool {
        internal_names(prefix, "prof_malloc_sample_object")
            .iter()
            .any(|name| symbols.function(name).is_some())
    }

    /// jemalloc 5.3's profiler hooks in a file (`data`), where symbols name
    /// them: functions in `symbols`, variables in `symbol_file`'s symbol
    /// table (the file itself, or its separate debug file).
    pub(crate) fn find(
        symbols: &FunctionSymbols,
        data: &[u8],
        symbol_file: &[u8],
        prefix: &str,
    ) -> Option<OwnSampling> {
        let file = object::File::parse(data).ok()?;
        let named = object::File::parse(symbol_file).ok()?;
        let names = |name: &str| internal_names(prefix, name);
        let address_of = |full: &str| {
            named
                .symbols()
                .find(|s| s.name() == Ok(full) && !s.is_undefined())
                .map(|s| s.address())
        };
        let variable = |name: &str| names(name).into_iter().find_map(|full| address_of(&full));
        let function = |name: &str, shape: CallShape| {
            let (symbol, function) = names(name)
                .into_iter()
                .find_map(|full| Some((full.clone(), symbols.function(&full)?)))?;
            let mut entry = EntryPoint {
                symbol,
                shape,
                file_offset: function.file_offset,
                placement: Placement::entry("not analysed"),
                forwards: false,
            };
            entry.placement = place_probe(symbols, data, &entry);
            Some(entry)
        };
        let first = Segment::all(&file).into_iter().next()?;
        let switches = ProfSwitches {
            anchor: (first.file_offset, first.address),
            opt_prof: variable("opt_prof")?,
            active: variable("prof_active_state")?,
            // A static: not renamed into jemalloc's namespace.
            thread_active_init: address_of("prof_thread_active_init")?,
            lg_sample: variable("lg_prof_sample")?,
        };
        let slow_frees: Vec<EntryPoint> = ["free_default", "sdallocx_default"]
            .into_iter()
            .filter_map(|name| function(name, CallShape::Free))
            .collect();
        if slow_frees.is_empty() {
            return None;
        }
        let allocating: Vec<&str> = C_ENTRY_POINTS
            .iter()
            .chain(CXX_ENTRY_POINTS)
            .filter(|(_, shape)| shape.allocates())
            .map(|(name, _)| *name)
            .collect();
        Some(OwnSampling {
            sample: function("prof_malloc_sample_object", CallShape::OwnSample)?,
            slow_frees,
            switches,
            own_code: fast_path::own_code(symbols, data, prefix, &allocating).into(),
        })
    }
}

impl Allocator {
    /// This copy as probed when its process runs jemalloc's profiler: its
    /// samples, the free slow paths, and the entry points that free inside
    /// (as frees); `None` where its hooks were not found.
    pub fn on_own_sampling(&self) -> Option<Allocator> {
        let own = self.own_sampling.clone()?;
        let mut entry_points: Vec<EntryPoint> = self
            .entry_points
            .iter()
            .filter_map(|e| {
                let bare = e.symbol.strip_prefix(&self.prefix).unwrap_or(&e.symbol);
                let (_, shape) = INNER_FREES.iter().find(|(name, _)| *name == bare)?;
                Some(EntryPoint {
                    shape: *shape,
                    ..e.clone()
                })
            })
            .collect();
        entry_points.push(own.sample.clone());
        entry_points.extend(own.slow_frees.iter().cloned());
        Some(Allocator {
            kind: self.kind,
            prefix: self.prefix.clone(),
            entry_points,
            fast_path: None,
            wrappers: Vec::new(),
            own_sampling: Some(own),
            by_code: self.by_code.clone(),
        })
    }
}
