//! Separate debug information, found as gdb finds it: by build ID under
//! `/usr/lib/debug/.build-id/`, then by the `.gnu_debuglink` name next to
//! the binary, in its `.debug/` folder and under `/usr/lib/debug/`. Every
//! candidate is opened inside the root the binary belongs to (the target's
//! `/proc/PID/root`, or `--lib-prefix` offline) and checked against the
//! binary (same build ID, or the debuglink's CRC) before it is used.
use std::{
    fs::File,
    os::fd::AsRawFd,
    path::{Path, PathBuf},
};

use memmap2::Mmap;
use object::Object;

use crate::{binary::elf::Segment, proc::rootfs::open_in_root_following};

const DEBUG_ROOT: &str = "/usr/lib/debug";

/// A binary's debug file, kept open; blazesym reads it through
/// `/proc/self/fd/N`, which names this very file whatever its path.
pub struct DebugFile {
    file: File,
    /// The binary's segments, to turn file offsets into the addresses both
    /// files share.
    segments: Vec<Segment>,
}

impl DebugFile {
    /// Finds the debug file of `binary` (readable at `binary`, named `name`
    /// in the process's root `root`), first in `extra_dir` (`--debug-dir`,
    /// a folder the user named) if given. None when it has no separate one.
    pub fn find(binary: &Path, name: &Path, root: &Path, extra_dir: Option<&Path>) -> Option<Self> {
        let file = File::open(binary).ok()?;
        // SAFETY: read-only private mapping of a file the target maps.
        let data = unsafe { Mmap::map(&file) }.ok()?;
        let elf = object::File::parse(&data[..]).ok()?;
        let segments = Segment::all(&elf);
        let build_id = elf.build_id().ok().flatten().map(<[u8]>::to_vec);
        let debuglink = elf
            .gnu_debuglink()
            .ok()
            .flatten()
            .map(|(name, crc)| (String::from_utf8_lossy(name).into_owned(), crc));
        let in_extra = extra_dir.and_then(|dir| {
            let by_id = build_id.as_deref().and_then(|id| by_build_id(id, dir, ""));
            by_id.or_else(|| {
                let (link, crc) = debuglink.as_ref()?;
                by_name_in(dir, link, *crc)
            })
        });
        let found = in_extra
            .or_else(|| {
                build_id
                    .as_deref()
                    .and_then(|id| by_build_id(id, root, DEBUG_ROOT))
            })
            .or_else(|| {
                let (link, crc) = debuglink?;
                by_debuglink(&link, crc, name, root)
            })?;
        Some(Self {
            file: found,
            segments,
        })
    }

    /// The debug file's bytes.
    pub fn read(&self) -> std::io::Result<Vec<u8>> {
        use std::io::{Read, Seek};
        let mut file = &self.file;
        file.rewind()?;
        let mut data = Vec::new();
        file.read_to_end(&mut data)?;
        Ok(data)
    }

    /// The path blazesym opens.
    pub fn path(&self) -> PathBuf {
        PathBuf::from(format!("/proc/self/fd/{}", self.file.as_raw_fd()))
    }

    /// The address of the binary's byte at `offset`.
    pub fn address_of(&self, offset: u64) -> Option<u64> {
        self.segments.iter().find_map(|s| s.address_of(offset))
    }
}

/// `<base>/.build-id/xx/rest.debug` inside `root`, checked by build ID.
fn by_build_id(id: &[u8], root: &Path, base: &str) -> Option<File> {
    let hex: String = id.iter().map(|b| format!("{b:02x}")).collect();
    if hex.len() < 3 {
        return None;
    }
    let path = format!("{base}/.build-id/{}/{}.debug", &hex[..2], &hex[2..]);
    let file = open_in_root_following(root, Path::new(&path)).ok()?;
    // SAFETY: read-only private mapping.
    let data = unsafe { Mmap::map(&file) }.ok()?;
    let elf = object::File::parse(&data[..]).ok()?;
    (elf.build_id().ok().flatten() == Some(id)).then_some(file)
}

/// The debuglink name directly in `dir`, checked by CRC.
fn by_name_in(dir: &Path, link: &str, crc: u32) -> Option<File> {
    if link.is_empty() || link.contains('/') {
        return None;
    }
    let file = open_in_root_following(dir, Path::new(link)).ok()?;
    // SAFETY: read-only private mapping.
    let data = unsafe { Mmap::map(&file) }.ok()?;
    (crc32fast::hash(&data) == crc).then_some(file)
}

fn by_debuglink(link: &str, crc: u32, binary: &Path, root: &Path) -> Option<File> {
    // A name, not a path: a link with slashes could point anywhere.
    if link.is_empty() || link.contains('/') {
        return None;
    }
    let dir = binary.parent()?;
    let under_debug_root = Path::new(DEBUG_ROOT).join(dir.strip_prefix("/").unwrap_or(dir));
    [
        dir.join(link),
        dir.join(".debug").join(link),
        under_debug_root.join(link),
    ]
    .into_iter()
    .filter_map(|candidate| open_in_root_following(root, &candidate).ok())
    .find(|file| {
        // SAFETY: read-only private mapping.
        unsafe { Mmap::map(file) }.is_ok_and(|data| crc32fast::hash(&data) == crc)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A debuglink is a file name: one with a slash could name any file.
    #[test]
    fn a_debuglink_with_a_path_is_refused() {
        let root = std::env::temp_dir().join(format!("memprobe-debug-{}", std::process::id()));
        std::fs::create_dir_all(root.join("usr/bin")).unwrap();
        std::fs::write(root.join("usr/secret"), b"x").unwrap();
        let crc = crc32fast::hash(b"x");
        let binary = Path::new("/usr/bin/app");
        assert!(by_debuglink("../secret", crc, binary, &root).is_none());
        assert!(by_debuglink("", crc, binary, &root).is_none());
        // The same file by a plain name next to the binary is found...
        std::fs::write(root.join("usr/bin/app.debug"), b"x").unwrap();
        assert!(by_debuglink("app.debug", crc, binary, &root).is_some());
        // ...but not with another CRC.
        assert!(by_debuglink("app.debug", crc ^ 1, binary, &root).is_none());
        let _ = std::fs::remove_dir_all(&root);
    }
}
