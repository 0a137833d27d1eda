//! Finding allocators in processes: which mapped files hold jemalloc,
//! glibc's malloc, mimalloc or tcmalloc, with which prefix and entry
//! points. Each file is read once per run (by identity, not path), so
//! rescans for `dlopen`ed libraries and `--all` stay cheap.
pub mod allocators;
pub mod by_code;
pub mod code;
pub mod elf;
pub mod entry_points;
pub mod fast_path;
mod forwarding;
pub mod own_sampling;
pub mod placement;
use std::{
    collections::{BTreeSet, HashMap},
    path::{Path, PathBuf},
    sync::Arc,
};

use crate::{
    discover::elf::FunctionSymbols,
    discover::entry_points::{EntryPoint, FoundEntryPoints, find_allocators},
    discover::forwarding::{may_forward, split_wrappers},
    discover::own_sampling::OwnSampling,
    discover::placement::Placement,
    error::{Error, Result},
    proc::{FileId, Mapping, proc_path},
    symbolize::debug_files::DebugFile,
};

pub use allocators::AllocatorKind;

/// A copy of an allocator inside one file.
#[derive(Clone, Debug)]
pub struct Allocator {
    pub kind: AllocatorKind,
    /// jemalloc's: `""`, `je_`, `_rjem_`...
    pub prefix: String,
    /// The entry points to probe.
    pub entry_points: Vec<EntryPoint>,
    /// jemalloc's inlined malloc fast path, where it is recognised
    /// (`--verbose` says), its addresses as file offsets.
    pub fast_path: Option<fast_path::SlowPath>,
    /// Entry points left unprobed because every call to them passes through
    /// another probed entry point (`operator new[]` jumping to `operator
    /// new`, say): (wrapper, the entry point it passes to). Probing both
    /// would count such calls twice and hide the real caller.
    pub wrappers: Vec<(String, String)>,
    /// jemalloc 5.3's own profiler's hooks, where the symbols name them.
    pub own_sampling: Option<own_sampling::OwnSampling>,
    /// How the entry points were found when no symbol named them: what
    /// their code showed, and the entry points whose calls go unseen.
    pub by_code: Option<by_code::FoundByCode>,
}

/// What one file holds, for attaching and for saying what was found.
#[derive(Debug, Default)]
struct FileFacts {
    allocators: Vec<Arc<Allocator>>,
    defines_malloc: bool,
    has_symbol_table: bool,
    /// jemalloc's message prefix is in the file: jemalloc is linked in,
    /// whether or not its entry points can be seen.
    mentions_jemalloc: bool,
    /// Why jemalloc's entry points could not be found by their code, when
    /// no symbol named them either.
    not_by_code: Option<String>,
}

impl FileFacts {
    /// Why jemalloc, linked in and `wanted`, cannot be probed here (its
    /// entry points named neither by symbols nor found by their code);
    /// `None` when it can, or is not here.
    fn hides_jemalloc(&self, wanted: &[AllocatorKind]) -> Option<&str> {
        let probed = self
            .allocators
            .iter()
            .any(|a| a.kind == AllocatorKind::Jemalloc);
        let hidden = wanted.contains(&AllocatorKind::Jemalloc) && self.mentions_jemalloc && !probed;
        hidden.then(|| self.not_by_code.as_deref().unwrap_or("not read"))
    }
}

/// An allocator copy found mapped in a process.
#[derive(Clone, Debug)]
pub struct Found {
    pub file: FileId,
    /// The file as the process sees it (inside its mount namespace).
    pub path: String,
    /// Where memprobe reads and attaches: `/proc/PID/map_files/START-END`,
    /// which the kernel resolves to the very file mapped, inside containers
    /// too and even when deleted, without walking a path the target could
    /// redirect out of its root.
    pub open_path: PathBuf,
    pub allocator: Arc<Allocator>,
}

impl Found {
    /// What a process's attached allocators are told apart by.
    pub fn key(&self) -> (FileId, AllocatorKind) {
        (self.file, self.allocator.kind)
    }
}

#[derive(Debug, Default)]
/// What each file holds, read once per file.
pub struct AllocatorCache {
    files: HashMap<FileId, FileFacts>,
    /// Debug files here too, for stripped files (`--debug-dir`).
    debug_dir: Option<PathBuf>,
    /// The allocators to probe (`--allocator`).
    wanted: Vec<AllocatorKind>,
}

impl AllocatorCache {
    pub fn new(debug_dir: Option<PathBuf>, wanted: Vec<AllocatorKind>) -> Self {
        Self {
            files: HashMap::new(),
            debug_dir,
            wanted,
        }
    }

    /// Every allocator copy mapped in `pid`, per its `maps`.
    pub fn find(&mut self, pid: u32, maps: &[Mapping]) -> Vec<Found> {
        let wanted = &self.wanted;
        executable_files(maps)
            .into_iter()
            .flat_map(|mapping| {
                let open_path = map_file(pid, &mapping);
                let debug = DebugLookup {
                    name: Path::new(mapping.path.as_deref().unwrap_or_default()),
                    root: proc_path(pid, "root"),
                    extra_dir: self.debug_dir.as_deref(),
                };
                let facts = self
                    .files
                    .entry(mapping.file)
                    .or_insert_with(|| read_facts(&open_path, &debug, wanted));
                facts
                    .allocators
                    .iter()
                    .map(|allocator| Found {
                        file: mapping.file,
                        path: mapping.path.clone().unwrap_or_default(),
                        open_path: open_path.clone(),
                        allocator: allocator.clone(),
                    })
                    .collect::<Vec<_>>()
            })
            .collect()
    }

    /// Like [`find`](Self::find), but an error that says what was found
    /// instead when there is no allocator to probe.
    pub fn require(&mut self, pid: u32, maps: &[Mapping], command: &str) -> Result<Vec<Found>> {
        let found = self.find(pid, maps);
        // jemalloc linked in but unreadable is the process's allocator:
        // profiling only the others would give an empty profile.
        let hidden = !self.unprobed_jemalloc(maps).is_empty();
        if !found.is_empty() && !hidden {
            return Ok(found);
        }
        Err(Error::NoAllocator {
            pid,
            command: command.to_owned(),
            found: self.describe_absence(maps),
        })
    }

    /// The mapped files (as [`find`](Self::find) read them) with jemalloc
    /// linked in that cannot be probed: (file, path, why). A library loaded
    /// after the start must not go unsaid.
    pub fn unprobed_jemalloc(&self, maps: &[Mapping]) -> Vec<(FileId, String, String)> {
        executable_files(maps)
            .into_iter()
            .filter_map(|m| {
                let why = self.files.get(&m.file)?.hides_jemalloc(&self.wanted)?;
                Some((m.file, m.path.clone().unwrap_or_default(), why.to_owned()))
            })
            .collect()
    }

    fn describe_absence(&self, maps: &[Mapping]) -> String {
        let files = executable_files(maps);
        let name = |m: &Mapping| file_name(m.path.as_deref().unwrap_or("?"));
        let facts = |m: &Mapping| self.files.get(&m.file);
        if let Some((_, path, why)) = self.unprobed_jemalloc(maps).into_iter().next() {
            return hidden_jemalloc(&file_name(&path), &why);
        }
        let providers: Vec<String> = files
            .iter()
            .filter(|m| facts(m).is_some_and(|f| f.defines_malloc))
            .map(name)
            .collect();
        let executable_stripped = files
            .first()
            .and_then(facts)
            .is_some_and(|f| !f.has_symbol_table);
        let stripped = if executable_stripped {
            format!(
                "; {} is stripped, so a static jemalloc in it could not be seen",
                files.first().map(name).unwrap_or_default()
            )
        } else {
            String::new()
        };
        let providers = providers.join(", ");
        if providers.is_empty() {
            return format!("no allocator memprobe knows: no mapped file defines malloc{stripped}");
        }
        if self.wanted.len() < AllocatorKind::ALL.len() {
            let chosen: Vec<&str> = self.wanted.iter().map(|k| k.name()).collect();
            return format!(
                "no allocator to probe: malloc comes from {providers}, which --allocator {} \
                 leaves out{stripped}",
                chosen.join(",")
            );
        }
        format!("no allocator memprobe knows: malloc comes from {providers}{stripped}")
    }
}

/// A path's last part.
fn file_name(path: &str) -> String {
    Path::new(path)
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or(path)
        .to_owned()
}

/// What to say of a file with jemalloc linked in whose entry points could
/// be found neither by name nor by code (`why`).
fn hidden_jemalloc(name: &str, why: &str) -> String {
    format!(
        "{name} contains jemalloc but names none of its entry points (stripped, or built with \
         hidden symbols), their code did not tell them for certain ({why}), and no debug file \
         of it was found: install its debug file (by build ID under /usr/lib/debug/.build-id, \
         or by its debuglink name next to it), give its folder with --debug-dir, or profile a \
         build that keeps its symbol table"
    )
}

/// `/proc/PID/map_files/START-END` of a mapping.
pub fn map_file(pid: u32, mapping: &Mapping) -> PathBuf {
    proc_path(
        pid,
        &format!("map_files/{:x}-{:x}", mapping.start, mapping.end),
    )
}

/// Each mapped file with code, once (by identity), in the order of the maps:
/// the executable comes first.
fn executable_files(maps: &[Mapping]) -> Vec<Mapping> {
    let mut seen = BTreeSet::new();
    maps.iter()
        .filter(|m| m.is_executable() && m.is_file())
        .filter(|m| seen.insert(m.file))
        .cloned()
        .collect()
}

/// Where a stripped file's debug file is looked for.
struct DebugLookup<'a> {
    /// The file as the process names it.
    name: &'a Path,
    /// The process's root: debug files are looked up inside it.
    root: PathBuf,
    /// `--debug-dir`.
    extra_dir: Option<&'a Path>,
}

fn read_facts(path: &Path, debug: &DebugLookup<'_>, wanted: &[AllocatorKind]) -> FileFacts {
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
    let mut by_code = None;
    let mut not_by_code = None;
    let unnamed = mentions_jemalloc
        && wanted.contains(&AllocatorKind::Jemalloc)
        && !found.iter().any(|f| f.kind == AllocatorKind::Jemalloc);
    if unnamed {
        match by_code::find(&symbols, &data) {
            Ok(mut code) => {
                found.push(code.entry_points(&mut symbols));
                by_code = Some(code);
            }
            Err(why) => not_by_code = Some(why.to_string()),
        }
    }
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
fn place_probe(symbols: &FunctionSymbols, data: &[u8], entry: &EntryPoint) -> Placement {
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
) -> Result<Vec<Arc<Allocator>>> {
    let debug = DebugLookup {
        name: path,
        root: PathBuf::from("/"),
        extra_dir: debug_dir,
    };
    let facts = read_facts(path, &debug, wanted);
    if let Some(why) = facts.hides_jemalloc(wanted) {
        return Err(Error::HiddenJemalloc {
            path: path.to_owned(),
            found: hidden_jemalloc(&file_name(&path.to_string_lossy()), why),
        });
    }
    Ok(facts.allocators)
}
