//! The processes to profile: their maps, and where jemalloc lives in them.
use std::{collections::BTreeSet, path::PathBuf};

use crate::{
    elf::FunctionSymbols,
    entry_points::{C_ENTRY_POINTS, CXX_ENTRY_POINTS, CallShape, SIGNATURE},
    error::{Error, Result},
    placement::Placement,
};

/// One line of `/proc/PID/maps`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mapping {
    pub start: u64,
    pub end: u64,
    pub perms: String,
    pub offset: u64,
    /// Device and inode: which file this is, whatever its path.
    pub file: FileId,
    /// The file as the process sees it, or a pseudo name like `[heap]`.
    pub path: Option<String>,
}

/// A file's identity (device, inode) as `/proc/PID/maps` gives it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct FileId {
    pub device: u64,
    pub inode: u64,
}

impl Mapping {
    pub fn is_executable(&self) -> bool {
        self.perms.as_bytes().get(2) == Some(&b'x')
    }

    pub fn is_file(&self) -> bool {
        self.path.as_deref().is_some_and(|p| p.starts_with('/'))
    }
}

pub fn parse_maps(text: &str) -> Vec<Mapping> {
    text.lines()
        .filter_map(|line| {
            let mut fields = line.splitn(6, ' ');
            let (start, end) = fields.next()?.split_once('-')?;
            let perms = fields.next()?.to_owned();
            let offset = u64::from_str_radix(fields.next()?, 16).ok()?;
            let (major, minor) = fields.next()?.split_once(':')?;
            let device = (u64::from_str_radix(major, 16).ok()? << 32)
                | u64::from_str_radix(minor, 16).ok()?;
            let inode = fields.next()?.parse().ok()?;
            let path = fields
                .next()
                .map(str::trim_start)
                .filter(|p| !p.is_empty())
                .map(str::to_owned);
            Some(Mapping {
                start: u64::from_str_radix(start, 16).ok()?,
                end: u64::from_str_radix(end, 16).ok()?,
                perms,
                offset,
                file: FileId { device, inode },
                path,
            })
        })
        .collect()
}

pub fn proc_path(pid: u32, rest: &str) -> PathBuf {
    PathBuf::from(format!("/proc/{pid}/{rest}"))
}

/// Reads `/proc/PID/maps`; a missing process is [`Error::NoSuchProcess`].
pub fn read_maps(pid: u32) -> Result<String> {
    let path = proc_path(pid, "maps");
    std::fs::read_to_string(&path).map_err(|cause| match cause.kind() {
        std::io::ErrorKind::NotFound => Error::NoSuchProcess(pid),
        _ if !proc_path(pid, "").exists() => Error::NoSuchProcess(pid),
        _ => Error::Read { path, cause },
    })
}

pub fn command_name(pid: u32) -> String {
    std::fs::read_to_string(proc_path(pid, "comm"))
        .map(|c| c.trim_end().to_owned())
        .unwrap_or_else(|_| "?".into())
}

/// An entry point found in a jemalloc instance.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EntryPoint {
    /// The symbol, with its prefix.
    pub symbol: String,
    pub shape: CallShape,
    /// File offset of the function's first instruction.
    pub file_offset: u64,
    /// Where in the function the probe goes.
    pub placement: Placement,
}

/// The pid as the process's own pid namespace sees it (`NSpid`), when it
/// differs from ours: the pid inside its container.
pub fn namespace_pid(pid: u32) -> Option<u32> {
    let status = std::fs::read_to_string(proc_path(pid, "status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("NSpid:"))?;
    let inner: u32 = line.split_whitespace().last()?.parse().ok()?;
    (inner != pid).then_some(inner)
}

/// Every pid in /proc.
pub fn all_pids() -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect()
}

/// Finds jemalloc's entry points in `symbols`, with the prefix they carry.
pub fn find_entry_points(symbols: &FunctionSymbols) -> Option<(String, Vec<EntryPoint>)> {
    let prefix = detect_prefix(symbols)?;
    let mut entry_points: Vec<EntryPoint> = C_ENTRY_POINTS
        .iter()
        .map(|(name, shape)| (format!("{prefix}{name}"), *shape))
        .chain(CXX_ENTRY_POINTS.iter().map(|(n, s)| (n.to_string(), *s)))
        .filter_map(|(symbol, shape)| {
            let file_offset = symbols.offset(&symbol)?;
            Some(EntryPoint {
                symbol,
                shape,
                file_offset,
                placement: Placement::entry("not analysed"),
            })
        })
        .collect();
    // Aliases (free and sdallocx sharing code, say) must be probed once.
    let mut offsets = BTreeSet::new();
    entry_points.retain(|e| offsets.insert(e.file_offset));
    Some((prefix, entry_points))
}

/// The prefix under which all of jemalloc's signature functions exist.
fn detect_prefix(symbols: &FunctionSymbols) -> Option<String> {
    let mut candidates: Vec<String> = symbols
        .names()
        .filter_map(|name| name.strip_suffix(SIGNATURE[0]))
        .filter(|prefix| {
            SIGNATURE[1..]
                .iter()
                .all(|s| symbols.offset(&format!("{prefix}{s}")).is_some())
        })
        .map(str::to_owned)
        .collect();
    // Prefer the public names: the shortest prefix.
    candidates.sort_by_key(|p| (p.len(), p.clone()));
    candidates.into_iter().next()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_maps_lines() {
        let text = "55d0c0a00000-55d0c0a02000 r-xp 00001000 08:01 12                         /usr/bin/demo two\n\
                    7ffd1000-7ffd2000 rw-p 00000000 00:00 0                          [stack]\n\
                    7f0000000000-7f0000001000 rw-p 00000000 00:00 0\n";
        let maps = parse_maps(text);
        assert_eq!(maps.len(), 3);
        assert_eq!(maps[0].path.as_deref(), Some("/usr/bin/demo two"));
        assert!(maps[0].is_executable() && maps[0].is_file());
        assert_eq!(maps[0].offset, 0x1000);
        assert_eq!(maps[1].path.as_deref(), Some("[stack]"));
        assert!(!maps[1].is_file());
        assert_eq!(maps[2].path, None);
    }

    use std::path::Path;

    #[test]
    fn finds_debians_libjemalloc_entry_points() {
        // Installed by the test command (Debian's libjemalloc2).
        let path = Path::new("/usr/lib/x86_64-linux-gnu/libjemalloc.so.2");
        let symbols = FunctionSymbols::read(path).unwrap();
        let (prefix, entry_points) = find_entry_points(&symbols).unwrap();
        assert_eq!(prefix, "");
        let names: Vec<&str> = entry_points.iter().map(|e| e.symbol.as_str()).collect();
        for expected in ["malloc", "free", "mallocx", "sdallocx", "_Znwm", "_ZdlPvm"] {
            assert!(
                names.contains(&expected),
                "{expected} missing from {names:?}"
            );
        }
    }

    #[test]
    fn glibc_is_not_jemalloc() {
        let libc = Path::new("/lib/x86_64-linux-gnu/libc.so.6");
        let symbols = FunctionSymbols::read(libc).unwrap();
        assert!(symbols.offset("malloc").is_some());
        assert!(find_entry_points(&symbols).is_none());
    }
}
