//! Finding allocators in processes: which mapped files hold jemalloc,
//! glibc's malloc, mimalloc or tcmalloc, with which prefix and entry
//! points. Each file is read once per run (by identity, not path), so
//! rescans for `dlopen`ed libraries and `--all` stay cheap.
pub mod allocators;
pub mod by_code;
pub mod debug_files;
pub mod entry_points;
mod error;
pub mod fast_path;
mod file_facts;
mod forwarding;
pub mod large_requests;
pub mod own_sampling;
pub mod served;
use std::{
    collections::{BTreeSet, HashMap},
    path::{Path, PathBuf},
    sync::Arc,
};

use crate::{
    discover::entry_points::EntryPoint,
    proc::{FileId, Mapping, proc_path},
};

pub use allocators::AllocatorKind;
pub use error::DiscoverError;
pub use file_facts::allocators_in_file;
pub(crate) use file_facts::place_probe;
use file_facts::{DebugLookup, FileFacts, read_facts};

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
    pub fn require(
        &mut self,
        pid: u32,
        maps: &[Mapping],
        command: &str,
    ) -> Result<Vec<Found>, DiscoverError> {
        let found = self.find(pid, maps);
        // jemalloc linked in but unreadable is the process's allocator:
        // profiling only the others would give an empty profile.
        let hidden = !self.unprobed_jemalloc(maps).is_empty();
        if !found.is_empty() && !hidden {
            return Ok(found);
        }
        Err(DiscoverError::NoAllocator {
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
pub(super) fn file_name(path: &str) -> String {
    Path::new(path)
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or(path)
        .to_owned()
}

/// What to say of a file with jemalloc linked in whose entry points could
/// be found neither by name nor by code (`why`).
pub(super) fn hidden_jemalloc(name: &str, why: &str) -> String {
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
