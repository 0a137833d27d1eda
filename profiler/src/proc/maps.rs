//! A process's mappings, `/proc/PID/maps`: what is mapped where, from
//! which file.
use super::{ProcessError, proc_path, stat::stat_fields};

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

impl FileId {
    /// The identity of the file `meta` describes, encoded as in `/proc/PID/maps`.
    pub fn of(meta: &std::fs::Metadata) -> Self {
        use std::os::unix::fs::MetadataExt;
        Self {
            device: (u64::from(libc::major(meta.dev())) << 32) | u64::from(libc::minor(meta.dev())),
            inode: meta.ino(),
        }
    }
}

/// Addresses `[start, end)` of a process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AddressRange {
    pub start: u64,
    pub end: u64,
}

impl AddressRange {
    pub fn contains(self, address: u64) -> bool {
        address >= self.start && address < self.end
    }
}

impl Mapping {
    pub fn range(&self) -> AddressRange {
        AddressRange {
            start: self.start,
            end: self.end,
        }
    }

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

/// Where a process has address 0 of `path` (per its `maps` text), from
/// where it mapped `anchor`: a loadable segment's file offset and address.
/// What places the file's data and `.bss` by their addresses.
pub fn file_base(maps: &str, path: &str, (offset, address): (u64, u64)) -> Option<u64> {
    mapped_address(maps, path, offset, 1)?.checked_sub(address)
}

/// Where `pid` has byte `file_offset` of `path` mapped (per its `maps`
/// text), if one mapping holds `len` bytes from there.
pub fn mapped_address(maps: &str, path: &str, file_offset: u64, len: u64) -> Option<u64> {
    parse_maps(maps)
        .into_iter()
        .find(|m| {
            m.path.as_deref() == Some(path)
                && file_offset >= m.offset
                && file_offset + len <= m.offset + (m.end - m.start)
        })
        .map(|m| m.start + (file_offset - m.offset))
}

/// Reads `/proc/PID/maps`; a missing process is
/// [`ProcessError::NoSuchProcess`],
/// and so is one that has exited but not been reaped yet: a zombie's maps
/// read as empty, and taken as its maps they would leave every frame of
/// its last profile unnamed.
pub fn read_maps(pid: u32) -> Result<String, ProcessError> {
    let path = proc_path(pid, "maps");
    let maps = std::fs::read_to_string(&path).map_err(|cause| match cause.kind() {
        std::io::ErrorKind::NotFound => ProcessError::NoSuchProcess(pid),
        _ if !proc_path(pid, "").exists() => ProcessError::NoSuchProcess(pid),
        _ => ProcessError::Read { path, cause },
    })?;
    if maps.is_empty() {
        return Err(ProcessError::NoSuchProcess(pid));
    }
    Ok(maps)
}

/// What says whether a process's maps may have changed since a look: its
/// start time (a pid used again is another process) and its virtual size
/// (a library mapped or unmapped changes it). Read from `stat`, which
/// walks none of its mappings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MapsStamp {
    pub(super) started: u64,
    virtual_bytes: u64,
}

/// `pid`'s [`MapsStamp`] now; `None` once it is gone.
pub fn maps_stamp(pid: u32) -> Option<MapsStamp> {
    parse_maps_stamp(&std::fs::read_to_string(proc_path(pid, "stat")).ok()?)
}

/// starttime and vsize from a `stat` line: fields 22 and 23.
fn parse_maps_stamp(stat: &str) -> Option<MapsStamp> {
    let mut fields = stat_fields(stat)?.skip(19);
    Some(MapsStamp {
        started: fields.next()?.parse().ok()?,
        virtual_bytes: fields.next()?.parse().ok()?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_maps_stamp_is_read_past_a_command_with_spaces_and_parentheses() {
        let stat = "42 (a (b) c) S 1 42 42 0 -1 4194560 100 0 0 0 7 3 0 0 20 0 1 0 \
                    123456 987654321 500 18446744073709551615";
        let stamp = parse_maps_stamp(stat).unwrap();
        assert_eq!(stamp.started, 123456);
        assert_eq!(stamp.virtual_bytes, 987654321);
        let own = maps_stamp(std::process::id()).unwrap();
        assert!(own.virtual_bytes > 0, "{own:?}");
    }

    #[test]
    fn an_exited_process_has_no_maps() {
        let mut child = std::process::Command::new("true")
            .spawn()
            .expect("true runs");
        let pid = child.id();
        // Not reaped yet: a zombie, whose maps file reads as empty.
        let zombie = || {
            std::fs::read_to_string(proc_path(pid, "stat")).is_ok_and(|stat| {
                stat.rsplit(')')
                    .next()
                    .is_some_and(|s| s.trim_start().starts_with('Z'))
            })
        };
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while !zombie() && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert!(zombie(), "the child became a zombie");
        assert!(matches!(read_maps(pid), Err(ProcessError::NoSuchProcess(p)) if p == pid));
        child.wait().expect("reaped");
        assert!(read_maps(std::process::id()).is_ok_and(|maps| !maps.is_empty()));
    }

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
}
