//! What is at an address, as a profile names it.
use blazesym::symbolize::CodeInfo;

use crate::profile::PythonFrameName;

/// What is at an address: a function (with the source line the address is
/// at within it, where debug info says), or nothing anyone could name,
/// which is data too: written as `file+0xOFFSET` (the file offset, as
/// `perf` and pprof's mappings place code), or as the bare address outside
/// mapped files.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Frame {
    Function {
        name: String,
        file: Option<String>,
        line: Option<u32>,
    },
    Unknown {
        address: u64,
        /// The mapped file's name and the address's offset in it.
        place: Option<(String, u64)>,
    },
    /// A Python function, at a line of its file.
    Python(PythonFrameName),
}

impl Frame {
    /// A function blazesym named, where `code` places the address.
    pub(super) fn at(name: &str, code: Option<&CodeInfo<'_>>) -> Self {
        Self::Function {
            name: name.to_owned(),
            file: code.map(|c| c.to_path().display().to_string()),
            line: code.and_then(|c| c.line),
        }
    }

    pub(super) fn named(name: String) -> Self {
        Self::Function {
            name,
            file: None,
            line: None,
        }
    }

    /// A name from a self-symbolized profile: unknown ones were written as
    /// their address.
    pub(super) fn from_written(name: &str) -> Self {
        name.strip_prefix("0x")
            .and_then(|hex| u64::from_str_radix(hex, 16).ok())
            .map_or_else(
                || Self::named(name.into()),
                |address| Self::Unknown {
                    address,
                    place: None,
                },
            )
    }

    /// The name as written in every output: a Python frame's with its
    /// file's name and line first ("fixture.py:42 build_index"), as a
    /// traceback places it.
    pub fn name(&self) -> String {
        match self {
            Self::Function { name, .. } => name.clone(),
            Self::Python(frame) => {
                let file = frame.file.rsplit('/').next().unwrap_or(&frame.file);
                format!("{file}:{} {}", frame.line, frame.function)
            }
            Self::Unknown {
                place: Some((file, offset)),
                ..
            } => format!("{file}+{offset:#x}"),
            Self::Unknown { address, .. } => format!("{address:#x}"),
        }
    }

    /// The function alone, as pprof names it (its line is the location's).
    pub fn function(&self) -> String {
        match self {
            Self::Python(frame) => frame.function.clone(),
            _ => self.name(),
        }
    }

    pub fn file(&self) -> Option<&str> {
        match self {
            Self::Function { file, .. } => file.as_deref(),
            Self::Python(frame) => Some(&frame.file),
            Self::Unknown { .. } => None,
        }
    }

    pub fn line(&self) -> Option<u32> {
        match self {
            Self::Function { line, .. } => *line,
            Self::Python(frame) => Some(frame.line),
            Self::Unknown { .. } => None,
        }
    }

    pub fn is_unknown(&self) -> bool {
        matches!(self, Self::Unknown { .. })
    }
}
