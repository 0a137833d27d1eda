//! What one file holds: the allocators its symbols (or its debug file's)
//! name or its code shows, each described from the file's code (entry
//! points placed, wrappers told apart, jemalloc's fast path and own
//! profiler found).
use std::{
    path::{Path, PathBuf},
    sync::Arc,
};

use crate::{
    binary::{
        elf,
        elf::FunctionSymbols,
        placement::{self, Placement},
    },
    discover::debug_files::DebugFile,
    discover::{
        Allocator, AllocatorKind, DiscoverError, by_code,
        entry_points::{self, EntryPoint, FoundEntryPoints, find_allocators},
        fast_path, file_name,
        forwarding::{may_forward, split_wrappers},
        hidden_jemalloc,
        own_sampling::OwnSampling,
    },
};

/// What one file holds, for attaching and for saying what was found.
#[derive(Debug, Default)]
pub(super) struct FileFacts {
    pub allocators: Vec<Arc<Allocator>>,
    pub defines_malloc: bool,
    pub has_symbol_table: bool,
    /// jemalloc's message prefix is in the file: jemalloc is linked in,
    /// whether or not its entry points can be seen.
    pub mentions_jemalloc: bool,
    /// Why jemalloc's entry points could not be found by their code, when
    /// no symbol named them either.
    not_by_code: Option<String>,
}

impl FileFacts {
    /// Why jemalloc, linked in and `wanted`, cannot be probed here (its
    /// entry points named neither by symbols nor found by their code);
    /// `None` when it can, or is not here.
    pub fn hides_jemalloc(&self, wanted: &[AllocatorKind]) -> Option<&str> {
        let probed = self
            .allocators
            .iter()
            .any(|a| a.kind == AllocatorKind::Jemalloc);
        let hidden = wanted.contains(&AllocatorKind::Jemalloc) && self.mentions_jemalloc && !probed;
        hidden.then(|| self.not_by_code.as_deref().unwrap_or("not read"))
    }
}

/// Where a stripped file's debug file is looked for.
pub(super) struct DebugLookup<'a> {
    /// The file as the process names it.
    pub name: &'a Path,
    /// The process's root: debug files are looked up inside it.
    pub root: PathBuf,
    /// `--debug-dir`.
    pub extra_dir: Option<&'a Path>,
}

pub(super) fn read_facts(
    path: &Path,
    debug: &DebugLookup<'_>,
    wanted: &[AllocatorKind],
) -> FileFacts {
    let Some(data) = map_read_only(path) else {
        return FileFacts::default();
    };
    let mentions_jemalloc = elf::read_only_data(&data)
        .into_iter()
        .any(|strings| memchr::memmem::find(strings, b"<jemalloc>").is_some());
    let Ok(mut symbols) = FunctionSymbols::parse(&data) else {
        return FileFacts {
            mentions_jemalloc,
            ..FileFacts::default()
        };
    };
    let known_version = fast_path::version_in_file(&data).is_some_and(|v| v.starts_with("5.3."));
    let (mut found, debug_data) = find_named(
        &mut symbols,
        path,
        debug,
        wanted,
        (mentions_jemalloc, known_version),
    );
    let unnamed = mentions_jemalloc
        && wanted.contains(&AllocatorKind::Jemalloc)
        && !found.iter().any(|f| f.kind == AllocatorKind::Jemalloc);
    let (by_code, not_by_code) = match unnamed.then(|| by_code::find(&symbols, &data)) {
        Some(Ok(mut code)) => {
            found.push(code.entry_points(&mut symbols));
            (Some(code), None)
        }
        Some(Err(why)) => (None, Some(why.to_string())),
        None => (None, None),
    };
    let code = FileCode {
        symbols: &symbols,
        data: &data,
        symbol_file: debug_data.as_deref().unwrap_or(&data),
        known_version,
    };
    let entry_addresses: Vec<u64> = found
        .iter()
        .flat_map(|f| &f.entry_points)
        .filter_map(|e| Some(symbols.function(&e.symbol)?.address))
        .collect();
    FileFacts {
        allocators: found
            .into_iter()
            .map(|found| code.allocator(found, &entry_addresses, by_code.as_ref()))
            .collect(),
        defines_malloc: symbols.offset("malloc").is_some(),
        has_symbol_table: symbols.has_symbol_table,
        mentions_jemalloc,
        not_by_code,
    }
}

/// `path` mapped read-only and private (as the unwinder maps it): a data
/// engine's library can be 500 MB, so it is paged in as read, never
/// copied whole.
fn map_read_only(path: &Path) -> Option<memmap2::Mmap> {
    let file = std::fs::File::open(path).ok()?;
    // SAFETY: a read-only private mapping of a file the target maps.
    unsafe { memmap2::Mmap::map(&file) }.ok()
}

/// The allocators `symbols` name, with the names of the file's debug file
/// adopted where they are needed (and its bytes): a stripped file with
/// jemalloc linked in has its names there, and Debian's stripped
/// jemalloc 5.3 its profiler's local hooks.
fn find_named(
    symbols: &mut FunctionSymbols,
    path: &Path,
    debug: &DebugLookup<'_>,
    wanted: &[AllocatorKind],
    (mentions_jemalloc, known_version): (bool, bool),
) -> (Vec<FoundEntryPoints>, Option<Vec<u8>>) {
    let stripped = mentions_jemalloc
        && !symbols.has_symbol_table
        && find_allocators(symbols, &[AllocatorKind::Jemalloc]).is_empty();
    let mut debug_data = stripped.then(|| adopt_debug_file(symbols, path, debug));
    let found = find_allocators(symbols, wanted);
    let lacks_hooks = |f: &FoundEntryPoints| {
        f.kind == AllocatorKind::Jemalloc && !OwnSampling::hooks_named(symbols, &f.prefix)
    };
    if known_version && !stripped && found.iter().any(lacks_hooks) {
        debug_data = Some(adopt_debug_file(symbols, path, debug));
    }
    (found, debug_data.flatten())
}

/// One file's code, as the allocators found in it are described.
struct FileCode<'a> {
    symbols: &'a FunctionSymbols,
    data: &'a [u8],
    /// Where its full symbol table is: its debug file's bytes, or its own.
    symbol_file: &'a [u8],
    /// Whether its jemalloc is 5.3, whose fast path and profiler hooks
    /// memprobe knows.
    known_version: bool,
}

impl FileCode<'_> {
    /// The allocator `found` names: its entry points placed, its wrappers
    /// told apart, jemalloc's fast path and own profiler found.
    fn allocator(
        &self,
        found: FoundEntryPoints,
        entry_addresses: &[u64],
        by_code: Option<&by_code::FoundByCode>,
    ) -> Arc<Allocator> {
        let (symbols, data) = (self.symbols, self.data);
        let (mut entry_points, wrappers) = split_wrappers(symbols, data, found.entry_points);
        for entry in &mut entry_points {
            entry.placement = place_probe(symbols, data, entry);
            entry.forwards = may_forward(symbols, data, entry, entry_addresses);
        }
        let known_jemalloc = found.kind == AllocatorKind::Jemalloc && self.known_version;
        let fast_path = known_jemalloc
            .then(|| symbols.function(&format!("{}malloc", found.prefix)))
            .flatten()
            .and_then(|malloc| fast_path::recognise(symbols, data, malloc.address))
            .and_then(|fast| fast_path::in_file_offsets(symbols, data, fast, &found.prefix));
        let own_sampling = known_jemalloc
            .then(|| OwnSampling::find(symbols, data, self.symbol_file, &found.prefix))
            .flatten();
        Arc::new(Allocator {
            kind: found.kind,
            prefix: found.prefix,
            entry_points,
            fast_path,
            wrappers,
            own_sampling,
            by_code: by_code
                .cloned()
                .filter(|_| found.kind == AllocatorKind::Jemalloc),
        })
    }
}

/// Adds the names of `path`'s debug file, if found, to `symbols`; its bytes.
fn adopt_debug_file(
    symbols: &mut FunctionSymbols,
    path: &Path,
    debug: &DebugLookup<'_>,
) -> Option<Vec<u8>> {
    let debug_file = DebugFile::find(path, debug.name, &debug.root, debug.extra_dir)?;
    let debug_data = debug_file.read().ok()?;
    symbols.adopt_debug_symbols(&debug_data).ok()?;
    Some(debug_data)
}

/// The probe's place in an entry point's code.
pub(crate) fn place_probe(symbols: &FunctionSymbols, data: &[u8], entry: &EntryPoint) -> Placement {
    let Some(function) = symbols.function(&entry.symbol) else {
        return Placement::entry("no symbol size");
    };
    let Some(code) = symbols.code(data, function.address, function.size.max(16)) else {
        return Placement::entry("code not in the file");
    };
    placement::place(
        code,
        function.address,
        entry_points::registers_read(entry.shape),
        entry.shape.needs_return(),
    )
}

/// Allocator copies in a file that is not mapped yet (launch mode); an
/// error when the file has jemalloc linked in but it cannot be probed:
/// profiling the other allocators alone would give a near-empty profile.
pub fn allocators_in_file(
    path: &Path,
    debug_dir: Option<&Path>,
    wanted: &[AllocatorKind],
) -> Result<Vec<Arc<Allocator>>, DiscoverError> {
    let debug = DebugLookup {
        name: path,
        root: PathBuf::from("/"),
        extra_dir: debug_dir,
    };
    let facts = read_facts(path, &debug, wanted);
    if let Some(why) = facts.hides_jemalloc(wanted) {
        return Err(DiscoverError::HiddenJemalloc {
            path: path.to_owned(),
            found: hidden_jemalloc(&file_name(&path.to_string_lossy()), why),
        });
    }
    Ok(facts.allocators)
}
