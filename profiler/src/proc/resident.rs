//! What of a process is resident, as the kernel counts it: each mapping's
//! resident bytes from `/proc/PID/smaps`, and the resident bytes of any
//! range from `/proc/PID/pagemap` (a range inside a mapping, which smaps
//! does not split: adjacent anonymous mappings are merged into one).
use std::{fs::File, io, os::unix::fs::FileExt};

use crate::proc::proc_path;

/// One mapping of `/proc/PID/smaps`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ResidentMapping {
    pub start: u64,
    pub end: u64,
    /// Mapped shared (`s` in its permissions).
    pub shared: bool,
    /// A file's path or a kernel name (`[heap]`, `[stack]`); `None` for
    /// anonymous memory.
    pub name: Option<String>,
    /// Its `Rss:` in bytes.
    pub resident: u64,
}

impl ResidentMapping {
    pub fn len(&self) -> u64 {
        self.end - self.start
    }

    /// Anonymous memory of the process's own: no file, no kernel name, not
    /// shared (`[anon:...]` names given by `prctl` count as anonymous).
    pub fn is_private_anonymous(&self) -> bool {
        !self.shared
            && self
                .name
                .as_deref()
                .is_none_or(|name| name.starts_with("[anon:"))
    }
}

/// Reads `/proc/PID/smaps`.
pub fn read_smaps(pid: u32) -> io::Result<Vec<ResidentMapping>> {
    Ok(parse_smaps(&std::fs::read_to_string(proc_path(
        pid, "smaps",
    ))?))
}

pub fn parse_smaps(text: &str) -> Vec<ResidentMapping> {
    let mut mappings: Vec<ResidentMapping> = Vec::new();
    for line in text.lines() {
        if let Some(kib) = line.strip_prefix("Rss:") {
            let kib = kib.trim().trim_end_matches("kB").trim();
            if let (Some(last), Ok(kib)) = (mappings.last_mut(), kib.parse::<u64>()) {
                last.resident = kib * 1024;
            }
            continue;
        }
        if let Some(mapping) = header(line) {
            mappings.push(mapping);
        }
    }
    mappings
}

/// A mapping's first line ("start-end perms offset dev inode name"), or
/// `None` for a field line.
fn header(line: &str) -> Option<ResidentMapping> {
    let mut fields = line.splitn(6, ' ');
    let (start, end) = fields.next()?.split_once('-')?;
    let start = u64::from_str_radix(start, 16).ok()?;
    let end = u64::from_str_radix(end, 16).ok()?;
    let perms = fields.next()?;
    let name = fields.nth(3).map(str::trim).filter(|n| !n.is_empty());
    Some(ResidentMapping {
        start,
        end,
        shared: perms.as_bytes().get(3) == Some(&b's'),
        name: name.map(str::to_owned),
        resident: 0,
    })
}

/// Where each of `pid`'s threads blocked in a system call has its stack
/// pointer (`/proc/PID/task/TID/syscall`, whose second-to-last field it
/// is; a running thread says `running` and is left out). Read without
/// stopping any thread.
pub fn thread_stack_pointers(pid: u32) -> Vec<u64> {
    crate::proc::thread_ids(pid)
        .into_iter()
        .filter_map(|tid| {
            let path = proc_path(pid, &format!("task/{tid}/syscall"));
            stack_pointer_of(&std::fs::read_to_string(path).ok()?)
        })
        .collect()
}

/// The stack pointer in a `syscall` file's line: `NR ARG1..ARG6 SP PC`.
fn stack_pointer_of(line: &str) -> Option<u64> {
    let fields: Vec<&str> = line.split_whitespace().collect();
    if fields.len() < 3 {
        return None;
    }
    let sp = fields[fields.len() - 2];
    u64::from_str_radix(sp.trim_start_matches("0x"), 16).ok()
}

const PAGE: u64 = 4096;
/// Pagemap entries read at a time.
const CHUNK_PAGES: u64 = 65536;
/// Bit 63 of a pagemap entry: the page is in memory.
const PRESENT: u64 = 1 << 63;

/// A process's pagemap, open for reading resident ranges.
pub struct Pagemap(File);

impl Pagemap {
    pub fn open(pid: u32) -> io::Result<Self> {
        File::open(proc_path(pid, "pagemap")).map(Self)
    }

    /// Resident bytes in `[start, end)`.
    pub fn resident(&self, start: u64, end: u64) -> io::Result<u64> {
        let (first, last) = (start / PAGE, end.div_ceil(PAGE));
        let mut buffer = vec![0u8; (CHUNK_PAGES.min(last.saturating_sub(first)) * 8) as usize];
        let mut resident = 0;
        let mut page = first;
        while page < last {
            let pages = CHUNK_PAGES.min(last - page);
            let bytes = &mut buffer[..(pages * 8) as usize];
            self.0.read_exact_at(bytes, page * 8)?;
            resident += bytes
                .chunks_exact(8)
                .filter(|entry| {
                    u64::from_le_bytes((*entry).try_into().unwrap_or_default()) & PRESENT != 0
                })
                .count() as u64;
            page += pages;
        }
        Ok(resident * PAGE)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SMAPS: &str = "\
55d0c0000000-55d0c0021000 rw-p 00000000 00:00 0                          [heap]
Size:                132 kB
Rss:                   8 kB
7f0000000000-7f0040000000 rw-p 00000000 00:00 0 
Size:            1048576 kB
Rss:               65540 kB
7f1000000000-7f1000001000 rw-s 00000000 00:01 1234                       /dev/shm/ring
Rss:                   4 kB
7f2000000000-7f2000010000 r-xp 00001000 08:01 99                         /usr/lib/libc.so.6
Rss:                  60 kB
";

    #[test]
    fn smaps_mappings_carry_their_resident_bytes_and_kind() {
        let mappings = parse_smaps(SMAPS);
        assert_eq!(mappings.len(), 4);
        assert_eq!(mappings[0].name.as_deref(), Some("[heap]"));
        assert_eq!(mappings[0].resident, 8 * 1024);
        assert!(mappings[1].is_private_anonymous());
        assert_eq!(mappings[1].len(), 1 << 30);
        assert_eq!(mappings[1].resident, 65540 * 1024);
        assert!(mappings[2].shared && !mappings[2].is_private_anonymous());
        assert_eq!(mappings[3].name.as_deref(), Some("/usr/lib/libc.so.6"));
    }

    #[test]
    fn a_blocked_thread_s_stack_pointer_is_read_and_a_running_one_is_not() {
        let blocked = "202 0x7f1c 0x80 0x2 0x0 0x0 0x0 0x7ffd4e3c1a28 0x7f1c5e2a1d3b\n";
        assert_eq!(stack_pointer_of(blocked), Some(0x7ffd4e3c1a28));
        assert_eq!(stack_pointer_of("running\n"), None);
        // A thread of this test's, blocked: its stack pointer is near a
        // local of its own.
        let (told, asked) = std::sync::mpsc::channel();
        let (release, wait) = std::sync::mpsc::channel::<()>();
        let helper = std::thread::spawn(move || {
            let local = 0u8;
            // SAFETY: gettid has no preconditions.
            let tid = unsafe { libc::gettid() } as u32;
            told.send((tid, &local as *const u8 as u64)).unwrap();
            let _ = wait.recv();
        });
        let (tid, local) = asked.recv().unwrap();
        let path = proc_path(std::process::id(), &format!("task/{tid}/syscall"));
        let mut sp = None;
        for _ in 0..100 {
            sp = std::fs::read_to_string(&path)
                .ok()
                .and_then(|l| stack_pointer_of(&l));
            if sp.is_some() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        release.send(()).unwrap();
        helper.join().unwrap();
        let sp = sp.expect("the helper blocked in a system call");
        assert!(sp.abs_diff(local) < 1 << 20, "{sp:#x} against {local:#x}");
    }

    #[test]
    fn pagemap_counts_the_pages_touched() {
        let len = 64 * PAGE as usize;
        let mut block = vec![0u8; len + PAGE as usize];
        let start = (block.as_ptr() as u64).div_ceil(PAGE) * PAGE;
        let offset = (start - block.as_ptr() as u64) as usize;
        for page in 0..64 {
            block[offset + page * PAGE as usize] = 1;
        }
        let pagemap = Pagemap::open(std::process::id()).unwrap();
        let resident = pagemap.resident(start, start + len as u64).unwrap();
        assert_eq!(resident, len as u64);
    }
}
