//! Finding jemalloc in processes: which mapped files hold a copy, with which
//! prefix and entry points. Each file is read once per run (by identity, not
//! path), so rescans for `dlopen`ed libraries and `--all` stay cheap.
pub mod code;
pub mod elf;
pub mod entry_points;
pub mod placement;
use std::{
    collections::{BTreeSet, HashMap},
    path::{Path, PathBuf},
    sync::Arc,
};

use crate::{
    discover::code::{plt_stub_symbol, straight_line_exit},
    discover::elf::FunctionSymbols,
    discover::entry_points::{EntryPoint, find_entry_points},
    discover::placement::Placement,
    error::{Error, Result},
    proc::{FileId, Mapping, proc_path},
    symbolize::debug_files::DebugFile,
};

/// A copy of jemalloc inside one file.
#[derive(Debug)]
pub struct Allocator {
    /// `""`, `je_`, `_rjem_`...
    pub prefix: String,
    /// The entry points to probe.
    pub entry_points: Vec<EntryPoint>,
    /// Entry points left unprobed because every call to them passes through
    /// another probed entry point (`operator new[]` jumping to `operator
    /// new`, say): (wrapper, the entry point it passes to). Probing both
    /// would count such calls twice and hide the real caller.
    pub wrappers: Vec<(String, String)>,
}

/// What one file holds, for attaching and for saying what was found.
#[derive(Debug, Default)]
struct FileFacts {
    allocator: Option<Arc<Allocator>>,
    defines_malloc: bool,
    has_symbol_table: bool,
    /// jemalloc's message prefix is in the file: jemalloc is linked in,
    /// whether or not its entry points can be seen.
    mentions_jemalloc: bool,
}

/// A jemalloc copy found mapped in a process.
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

#[derive(Debug, Default)]
/// What each file holds, read once per file.
pub struct AllocatorCache {
    files: HashMap<FileId, FileFacts>,
    /// Debug files here too, for stripped files (`--debug-dir`).
    debug_dir: Option<PathBuf>,
}

impl AllocatorCache {
    pub fn new(debug_dir: Option<PathBuf>) -> Self {
        Self {
            files: HashMap::new(),
            debug_dir,
        }
    }

    /// Every jemalloc copy mapped in `pid`, per its `maps`.
    pub fn find(&mut self, pid: u32, maps: &[Mapping]) -> Vec<Found> {
        executable_files(maps)
            .into_iter()
            .filter_map(|mapping| {
                let open_path = map_file(pid, &mapping);
                let debug = DebugLookup {
                    name: Path::new(mapping.path.as_deref().unwrap_or_default()),
                    root: proc_path(pid, "root"),
                    extra_dir: self.debug_dir.as_deref(),
                };
                let facts = self
                    .files
                    .entry(mapping.file)
                    .or_insert_with(|| read_facts(&open_path, &debug));
                let allocator = facts.allocator.clone()?;
                Some(Found {
                    file: mapping.file,
                    path: mapping.path.clone().unwrap_or_default(),
                    open_path,
                    allocator,
                })
            })
            .collect()
    }

    /// Like [`find`](Self::find), but an error that says what was found
    /// instead when there is no jemalloc.
    pub fn require(&mut self, pid: u32, maps: &[Mapping], command: &str) -> Result<Vec<Found>> {
        let found = self.find(pid, maps);
        if !found.is_empty() {
            return Ok(found);
        }
        Err(Error::NoJemalloc {
            pid,
            command: command.to_owned(),
            found: self.describe_absence(maps),
        })
    }

    fn describe_absence(&self, maps: &[Mapping]) -> String {
        let files = executable_files(maps);
        let name = |m: &Mapping| {
            let path = m.path.as_deref().unwrap_or("?");
            Path::new(path)
                .file_name()
                .and_then(|n| n.to_str())
                .unwrap_or(path)
                .to_owned()
        };
        let facts = |m: &Mapping| self.files.get(&m.file);
        if let Some(hidden) = files
            .iter()
            .find(|m| facts(m).is_some_and(|f| f.mentions_jemalloc))
        {
            return format!(
                "{} contains jemalloc but exports none of its entry points (stripped, or \
                 built with hidden symbols) and no debug file of it was found: install its debug \
                 file (by build ID under /usr/lib/debug/.build-id, or by its debuglink name next \
                 to it), give its folder with --debug-dir, or profile a build that keeps its \
                 symbol table",
                name(hidden)
            );
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
        match providers.as_slice() {
            [] => format!("no mapped file defines malloc{stripped}"),
            [one] if one.starts_with("libc.so") || one.starts_with("libc-") => {
                format!("malloc comes from glibc only{stripped}")
            }
            many => format!("malloc comes from {}{stripped}", many.join(", ")),
        }
    }
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

fn read_facts(path: &Path, debug: &DebugLookup<'_>) -> FileFacts {
    let Ok(data) = std::fs::read(path) else {
        return FileFacts::default();
    };
    let mentions_jemalloc = memchr::memmem::find(&data, b"<jemalloc>").is_some();
    let Ok(mut symbols) = FunctionSymbols::parse(&data) else {
        return FileFacts {
            mentions_jemalloc,
            ..FileFacts::default()
        };
    };
    // A stripped file with jemalloc linked in: its debug file has the names.
    if mentions_jemalloc
        && !symbols.has_symbol_table
        && find_entry_points(&symbols).is_none()
        && let Some(debug_file) = DebugFile::find(path, debug.name, &debug.root, debug.extra_dir)
        && let Ok(debug_data) = debug_file.read()
    {
        let _ = symbols.adopt_debug_symbols(&debug_data);
    }
    FileFacts {
        allocator: find_entry_points(&symbols).map(|(prefix, entry_points)| {
            let (mut entry_points, wrappers) = split_wrappers(&symbols, &data, entry_points);
            for entry in &mut entry_points {
                entry.placement = place_probe(&symbols, &data, entry);
            }
            Arc::new(Allocator {
                prefix,
                entry_points,
                wrappers,
            })
        }),
        defines_malloc: symbols.offset("malloc").is_some(),
        has_symbol_table: symbols.has_symbol_table,
        mentions_jemalloc,
    }
}

/// Separates entry points whose straight-line path calls or jumps to another
/// entry point (directly or through the PLT) from those to probe.
fn split_wrappers(
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

/// jemalloc copies in a file that is not mapped yet (launch mode).
pub fn allocator_in_file(path: &Path, debug_dir: Option<&Path>) -> Option<Arc<Allocator>> {
    let debug = DebugLookup {
        name: path,
        root: PathBuf::from("/"),
        extra_dir: debug_dir,
    };
    read_facts(path, &debug).allocator
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wrappers_of_debians_libjemalloc_are_not_probed() {
        let path = Path::new("/usr/lib/x86_64-linux-gnu/libjemalloc.so.2");
        if !path.exists() {
            eprintln!("skipped: {} is not installed", path.display());
            return;
        }
        let allocator = allocator_in_file(path, None).expect("jemalloc found");
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
}
