//! Finding a process's CPython: the file that defines `_PyRuntime` (the
//! `python3.X` executable, or a `libpython3.X.so` an embedding program
//! loaded), its version, and where its eval loop's code is.
use std::collections::HashSet;

use object::{Object, ObjectSymbol};
use profiler_common::python::{
    PYTHON_3_11, PYTHON_3_11_CODE, PythonCodeLayout, PythonOffsets, PythonProcess,
};

use crate::{
    binary::elf::Segment,
    discover::map_file,
    proc::{AddressRange, FileId, Mapping},
    python::debug_offsets,
};

/// A CPython interpreter found in a process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PythonRuntime {
    /// "3.11.2".
    pub version: String,
    /// The file that holds it, as the process maps it.
    pub path: String,
    /// `_PyEval_EvalFrameDefault`'s code in the process: each native call
    /// of it runs a run of Python frames.
    pub eval: AddressRange,
    /// Where it is and how it is laid out; `None` for a version memprobe
    /// does not know the layout of.
    pub layout: Option<Layout>,
    pub markers: Markers,
}

/// A known interpreter's layout, placed in its process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    /// What the kernel reads to walk the frames.
    pub process: PythonProcess,
    /// What userspace reads of each code object.
    pub code: PythonCodeLayout,
}

/// How a frame's marker byte ([`PythonOffsets::frame_marker`]) tells
/// where a native eval-loop call started.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Markers {
    /// 3.11's `is_entry`: the call's first frame is marked.
    EntryFlag,
    /// 3.12 and later: the call pushes an entry frame of its own, which
    /// runs no code, owned by the C stack (`FRAME_OWNED_BY_CSTACK` in
    /// 3.12 and 3.13, `FRAME_OWNED_BY_INTERPRETER` since 3.14: 3 in all).
    CStackOwner,
}

impl Markers {
    /// `owner` of a 3.12+ entry frame.
    pub const OWNED_BY_CSTACK: u32 = 3;
}

/// The layouts of the versions memprobe reads, by (major, minor); from
/// 3.13 on, from the table at the start of `_PyRuntime` (`runtime`: its
/// bytes).
fn layouts(major: u8, minor: u8, runtime: &[u8]) -> Option<(PythonOffsets, PythonCodeLayout)> {
    match (major, minor) {
        (3, 11) => Some((PYTHON_3_11, PYTHON_3_11_CODE)),
        (3, 13..=15) => debug_offsets::read(runtime),
        _ => None,
    }
}

/// Whether the file at `path` may be CPython: its name says so. Other files
/// are not opened (a data engine's binary can be gigabytes).
fn may_be_python(path: &str) -> bool {
    let name = path.rsplit('/').next().unwrap_or(path);
    name.starts_with("python") || name.starts_with("libpython")
}

/// The interpreter in `pid`'s mappings, if one of its files is CPython;
/// files in `seen` are not read again (a launched program's maps are
/// looked at again once it has run `exec`), and those read join it.
pub fn find(pid: u32, mappings: &[Mapping], seen: &mut HashSet<FileId>) -> Option<PythonRuntime> {
    let candidates = mappings
        .iter()
        .filter(|m| m.is_executable() && m.path.as_deref().is_some_and(may_be_python));
    for mapping in candidates {
        if !seen.insert(mapping.file) {
            continue;
        }
        let Ok(data) = std::fs::read(map_file(pid, mapping)) else {
            continue;
        };
        if let Some(runtime) = read_file(&data, mapping, mappings) {
            return Some(runtime);
        }
    }
    None
}

/// The interpreter in one mapped file, placed where `mapping` (its code)
/// put it.
fn read_file(data: &[u8], code: &Mapping, mappings: &[Mapping]) -> Option<PythonRuntime> {
    let file = object::File::parse(data).ok()?;
    let symbol = |name: &str| {
        file.dynamic_symbols()
            .chain(file.symbols())
            .find(|s| s.name() == Ok(name) && !s.is_undefined())
    };
    let runtime = symbol("_PyRuntime")?;
    let eval = symbol("_PyEval_EvalFrameDefault")?;
    let segments = Segment::all(&file);
    // One bias places the whole file: found from the code mapping.
    let eval_offset = segments.iter().find_map(|s| s.offset_of(eval.address()))?;
    let eval_start = mappings
        .iter()
        .find(|m| {
            m.file == code.file
                && m.is_executable()
                && eval_offset >= m.offset
                && eval_offset < m.offset + (m.end - m.start)
        })
        .map(|m| m.start + (eval_offset - m.offset))?;
    let bias = eval_start.wrapping_sub(eval.address());
    // `Py_Version` (3.11 and later): PY_VERSION_HEX, 0xMMmmPP..
    let version = symbol("Py_Version")
        .and_then(|s| segments.iter().find_map(|seg| seg.offset_of(s.address())))
        .and_then(|offset| data.get(offset as usize..offset as usize + 4))
        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]));
    let (major, minor, micro) = match version {
        Some(hex) => ((hex >> 24) as u8, (hex >> 16) as u8, (hex >> 8) as u8),
        // Older than 3.11: its frames are laid out otherwise.
        None => (3, 0, 0),
    };
    let runtime_bytes = segments
        .iter()
        .find_map(|s| s.offset_of(runtime.address()))
        .and_then(|offset| data.get(offset as usize..))
        .unwrap_or_default();
    let known = layouts(major, minor, runtime_bytes);
    Some(PythonRuntime {
        version: match version {
            Some(_) => format!("{major}.{minor}.{micro}"),
            None => "before 3.11".into(),
        },
        path: code.path.clone().unwrap_or_default(),
        eval: AddressRange {
            start: eval_start,
            end: eval_start + eval.size().max(1),
        },
        layout: known.map(|(offsets, code)| Layout {
            process: PythonProcess {
                runtime: runtime.address().wrapping_add(bias),
                offsets,
            },
            code,
        }),
        markers: if minor == 11 {
            Markers::EntryFlag
        } else {
            Markers::CStackOwner
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proc::parse_maps;

    #[test]
    fn only_files_named_for_python_are_opened() {
        assert!(may_be_python("/usr/bin/python3.11"));
        assert!(may_be_python(
            "/usr/lib/x86_64-linux-gnu/libpython3.11.so.1.0"
        ));
        assert!(!may_be_python("/usr/bin/clickhouse"));
        assert!(!may_be_python("/opt/python3/lib/libarrow.so"));
    }

    #[test]
    fn this_test_process_runs_no_python() {
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
        let mut seen = HashSet::new();
        assert_eq!(
            find(std::process::id(), &parse_maps(&maps), &mut seen),
            None
        );
    }
}
