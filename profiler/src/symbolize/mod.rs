//! Naming addresses of a profile with blazesym, from the binaries named in
//! its `MAPPED_LIBRARIES`, in memprobe's process: never in the target.
mod allocator_code;
mod frame;
pub mod perfmap;

pub use frame::Frame;
use std::{
    collections::HashMap,
    path::{Path, PathBuf},
};

use blazesym::symbolize::{Input, Symbolized, Symbolizer, source::Elf, source::Source};

use crate::{
    discover::debug_files::DebugFile,
    discover::entry_points::{C_ENTRY_POINTS, CXX_ENTRY_POINTS},
    proc::{Mapping, parse_maps},
    profile::PythonFrameName,
    symbolize::allocator_code::AllocatorCode,
};

/// Names addresses of one process's profile.
pub struct Namer {
    mappings: Vec<Mapping>,
    symbolizer: Symbolizer,
    /// Where to look for the binaries instead of `/` (jeprof's --lib_prefix).
    lib_prefix: Option<PathBuf>,
    /// The live process whose maps these are, if any.
    pid: Option<u32>,
    /// Names per address, innermost inlined function first.
    cache: HashMap<u64, Vec<Frame>>,
    /// JIT code (a JVM's perf map), for addresses outside mapped files.
    jit: Vec<crate::symbolize::perfmap::JitSymbol>,
    /// Per file: whether it holds a copy of jemalloc.
    holds_jemalloc: HashMap<String, AllocatorCode>,
    /// Per file: its separate debug file, if it has one.
    debug_files: HashMap<String, Option<DebugFile>>,
    /// A folder of debug files to look in first (`--debug-dir`).
    debug_dir: Option<PathBuf>,
}

impl Namer {
    /// For a running process: binaries are opened through
    /// `/proc/PID/map_files/`, the very files mapped, in containers too,
    /// without walking a path that could lead out of the target's root.
    pub fn for_process(pid: u32, mapped_libraries: &str) -> Self {
        let mut namer = Self::new(mapped_libraries, None);
        namer.pid = Some(pid);
        namer
    }

    pub fn new(mapped_libraries: &str, lib_prefix: Option<PathBuf>) -> Self {
        Self {
            pid: None,
            mappings: parse_maps(mapped_libraries)
                .into_iter()
                .filter(|m| m.is_executable() && m.is_file())
                .collect(),
            // No debug folders of blazesym's own: debug files are found by
            // `debug_files`, inside the target's root, and checked.
            symbolizer: Symbolizer::builder()
                .set_debug_dirs(Some::<[&Path; 0]>([]))
                .build(),
            lib_prefix,
            cache: HashMap::new(),
            jit: Vec::new(),
            holds_jemalloc: HashMap::new(),
            debug_files: HashMap::new(),
            debug_dir: None,
        }
    }

    /// Looks for debug files in `dir` first (`--debug-dir`).
    pub fn with_debug_dir(mut self, dir: Option<PathBuf>) -> Self {
        self.debug_dir = dir;
        self
    }

    /// Names known beforehand (a self-symbolized profile's), keyed by the
    /// address as looked up.
    pub fn with_symbols(mut self, symbols: &HashMap<u64, String>) -> Self {
        // jeprof's form: "outer--inlined--innermost".
        self.cache.extend(symbols.iter().map(|(a, n)| {
            let mut frames: Vec<Frame> = n.split("--").map(Frame::from_written).collect();
            frames.reverse();
            (*a, frames)
        }));
        self
    }

    /// Names the Python frames of a profile (keyed as looked up).
    pub fn with_python(mut self, frames: &[(u64, PythonFrameName)]) -> Self {
        self.add_python(frames);
        self
    }

    /// As [`with_python`](Self::with_python), for a namer kept between
    /// profiles: a Python frame's address names the same frame for the
    /// whole run.
    pub fn add_python(&mut self, frames: &[(u64, PythonFrameName)]) {
        let named = frames
            .iter()
            .map(|(a, f)| (*a, vec![Frame::Python(f.clone())]));
        self.cache.extend(named);
    }

    /// The functions at `address`, innermost inlined one first, the
    /// function that holds the code last.
    pub fn names(&mut self, address: u64) -> Vec<String> {
        self.frames(address).iter().map(Frame::name).collect()
    }

    /// As [`names`](Self::names), with source lines where debug info has
    /// them.
    pub fn frames(&mut self, address: u64) -> Vec<Frame> {
        if let Some(frames) = self.cache.get(&address) {
            return frames.clone();
        }
        let frames = self
            .lookup(address)
            .unwrap_or_else(|| vec![self.unknown(address)]);
        self.cache.insert(address, frames.clone());
        frames
    }

    /// An address nothing names, placed in its mapped file if it has one.
    fn unknown(&self, address: u64) -> Frame {
        let place = self
            .mappings
            .iter()
            .find(|m| m.range().contains(address))
            .and_then(|m| {
                let name = Path::new(m.path.as_deref()?).file_name()?;
                Some((
                    name.to_string_lossy().into_owned(),
                    address - m.start + m.offset,
                ))
            });
        Frame::Unknown { address, place }
    }

    /// The names of the JIT code among `addresses` (as looked up), to keep
    /// with the profile.
    pub fn jit_names(&self, addresses: impl Iterator<Item = u64>) -> Vec<(u64, String)> {
        let mut names: Vec<(u64, String)> = addresses
            .filter(|&a| !self.mappings.iter().any(|m| m.range().contains(a)))
            .filter_map(|a| {
                Some((
                    a,
                    crate::symbolize::perfmap::lookup(&self.jit, a)?
                        .name
                        .clone(),
                ))
            })
            .collect();
        names.sort();
        names.dedup();
        names
    }

    /// Names JIT code from a perf map; forgets names made before.
    pub fn set_jit(&mut self, symbols: Vec<crate::symbolize::perfmap::JitSymbol>) {
        self.jit = symbols;
        self.cache.clear();
    }

    fn lookup(&mut self, address: u64) -> Option<Vec<Frame>> {
        let Some(mapping) = self
            .mappings
            .iter()
            .find(|m| address >= m.start && address < m.end)
        else {
            return crate::symbolize::perfmap::lookup(&self.jit, address)
                .map(|s| vec![Frame::named(s.name.clone())]);
        };
        let path = PathBuf::from(mapping.path.as_deref()?);
        let live = self
            .pid
            .map(|pid| crate::discover::map_file(pid, mapping))
            .filter(|p| p.exists());
        let path = match (&self.lib_prefix, live) {
            (_, Some(live)) => live,
            (Some(prefix), None) => prefix.join(path.strip_prefix("/").unwrap_or(&path)),
            (None, None) => path,
        };
        let offset = address - mapping.start + mapping.offset;
        let name = mapping.path.clone().unwrap_or_default();
        let root = match (self.pid, &self.lib_prefix) {
            (Some(pid), _) => crate::proc::proc_path(pid, "root"),
            (None, Some(prefix)) => prefix.clone(),
            (None, None) => PathBuf::from("/"),
        };
        let debug = self.debug_files.entry(name.clone()).or_insert_with(|| {
            DebugFile::find(&path, Path::new(&name), &root, self.debug_dir.as_deref())
        });
        if let Some(debug) = debug
            && let Some(address) = debug.address_of(offset)
            && let Some(names) =
                symbolize(&self.symbolizer, &debug.path(), Input::VirtOffset(address))
        {
            return Some(names);
        }
        symbolize(&self.symbolizer, &path, Input::FileOffset(offset))
    }

    /// "leaf < caller < ..." for the first `depth` frames of a stack,
    /// allocator frames cut off first: jemalloc's own dumps start inside
    /// jemalloc.
    /// A stack that runs Python names its innermost Python frame too,
    /// after "…" where it lies deeper: the line of the program that asked.
    pub fn site(&mut self, frames: &[u64], depth: usize) -> String {
        let named = self.named_stack(frames);
        let python = named.iter().position(|f| matches!(f, Frame::Python(_)));
        let mut names: Vec<String> = named.iter().take(depth).map(Frame::name).collect();
        if let Some(at) = python.filter(|&at| at >= depth) {
            names.truncate(depth.saturating_sub(1));
            names.push("…".into());
            names.push(named[at].name());
        }
        names.join(" < ")
    }

    /// Names of a stack of return addresses, leaf first, each looked up at
    /// its call instruction (return address - 1), allocator frames cut off.
    pub fn stack(&mut self, frames: &[u64]) -> Vec<String> {
        self.named_stack(frames).iter().map(Frame::name).collect()
    }

    /// As [`stack`](Self::stack), the frames themselves.
    fn named_stack(&mut self, frames: &[u64]) -> Vec<Frame> {
        let named: Vec<(u64, Frame)> = frames
            .iter()
            .flat_map(|&f| {
                let address = f.saturating_sub(1);
                self.frames(address).into_iter().map(move |n| (address, n))
            })
            .collect();
        let skip = named
            .iter()
            .take_while(|(address, frame)| self.is_allocator_frame(*address, frame))
            .count();
        let skip = if skip == named.len() { 0 } else { skip };
        named.into_iter().skip(skip).map(|(_, f)| f).collect()
    }

    /// A frame of the allocator itself: named as one of its functions, or
    /// unnamed inside a file that holds jemalloc.
    fn is_allocator_frame(&mut self, address: u64, frame: &Frame) -> bool {
        const INTERNAL: [&str; 17] = [
            "je_",
            "_rjem_",
            "prof_",
            "imalloc",
            "malloc_default",
            "ialloc",
            "mi_",
            "_mi_",
            "tc_",
            "tcmalloc::",
            "__libc_malloc",
            "__libc_calloc",
            "__libc_realloc",
            "__libc_memalign",
            "_int_",
            "_mid_memalign",
            "__GI___libc_",
        ];
        let Frame::Function { name, .. } = frame else {
            return self.in_allocator_file(address);
        };
        let entry_point = C_ENTRY_POINTS.iter().any(|(n, _)| *n == name)
            || CXX_ENTRY_POINTS.iter().any(|(n, _)| *n == name)
            || name.starts_with("operator new")
            || name.starts_with("operator delete");
        entry_point || INTERNAL.iter().any(|p| name.starts_with(p))
    }

    /// Whether `address` is in a file that holds a copy of jemalloc,
    /// mimalloc or tcmalloc (glibc's file holds much else).
    fn in_allocator_file(&mut self, address: u64) -> bool {
        let Some(mapping) = self
            .mappings
            .iter()
            .find(|m| address >= m.start && address < m.end)
        else {
            return false;
        };
        let Some(path) = mapping.path.clone() else {
            return false;
        };
        let offset = address - mapping.start + mapping.offset;
        let code = self
            .holds_jemalloc
            .entry(path.clone())
            .or_insert_with(|| AllocatorCode::of(Path::new(&path)));
        code.holds(offset)
    }
}

/// The functions at `input` in the ELF file at `path`, innermost first.
fn symbolize(symbolizer: &Symbolizer, path: &Path, input: Input<u64>) -> Option<Vec<Frame>> {
    let source = Source::Elf(Elf::new(path));
    match symbolizer.symbolize_single(&source, input).ok()? {
        // blazesym lists inlined calls outermost first; each one's code
        // info is where the address is within that function.
        Symbolized::Sym(sym) => Some(
            sym.inlined
                .iter()
                .rev()
                .map(|f| Frame::at(&f.name, f.code_info.as_ref()))
                .chain([Frame::at(&sym.name, sym.code_info.as_deref())])
                .collect(),
        ),
        Symbolized::Unknown(_) => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_addresses_are_data_written_as_the_address() {
        let symbols = HashMap::from([
            (0x2000, "0x2000".to_owned()),
            (0x3000, "outer--inner".to_owned()),
        ]);
        let mut namer = Namer::new("", None).with_symbols(&symbols);
        let unknown = |address| Frame::Unknown {
            address,
            place: None,
        };
        assert_eq!(namer.frames(0x1000), vec![unknown(0x1000)]);
        assert_eq!(namer.frames(0x2000), vec![unknown(0x2000)]);
        assert_eq!(namer.names(0x3000), vec!["inner", "outer"]);
        // Looked up at the call instruction: return address - 1.
        assert_eq!(
            namer.stack(&[0x1001, 0x3001]),
            vec!["0x1000", "inner", "outer"]
        );
    }

    #[test]
    fn unknown_code_in_a_mapped_file_is_placed_by_file_offset() {
        let maps = "7f0000000000-7f0000010000 r-xp 00001000 08:01 12  /nonexistent/libz.so.1\n";
        let mut namer = Namer::new(maps, None);
        let frame = &namer.frames(0x7f0000000200)[0];
        assert!(frame.is_unknown());
        assert_eq!(frame.name(), "libz.so.1+0x1200");
        // Outside every mapping (JIT code without a perf map): the address.
        assert_eq!(namer.frames(0x1000)[0].name(), "0x1000");
    }
}
