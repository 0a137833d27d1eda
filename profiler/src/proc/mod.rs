//! The processes to profile, as /proc shows them: maps, names, pids, roots.
mod error;
pub mod resident;
pub mod rootfs;
use std::{path::PathBuf, time::Duration};

pub use error::ProcessError;

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

pub fn proc_path(pid: u32, rest: &str) -> PathBuf {
    PathBuf::from(format!("/proc/{pid}/{rest}"))
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

/// A process's memory, `/proc/PID/mem`: read, never written.
pub struct ProcessMemory(std::fs::File);

impl ProcessMemory {
    pub fn open(pid: u32) -> Option<Self> {
        std::fs::File::open(proc_path(pid, "mem")).ok().map(Self)
    }

    /// Fills `bytes` from `address`; `None` if that is not mapped.
    pub fn read(&self, address: u64, bytes: &mut [u8]) -> Option<()> {
        use std::os::unix::fs::FileExt;
        self.0.read_exact_at(bytes, address).ok()
    }

    /// The little-endian word at `address`; `None` if that is not mapped.
    pub fn read_word(&self, address: u64) -> Option<u64> {
        let mut word = [0u8; 8];
        self.read(address, &mut word)?;
        Some(u64::from_le_bytes(word))
    }
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

/// The ids of `pid`'s threads now (none if it is gone).
pub fn thread_ids(pid: u32) -> Vec<u32> {
    std::fs::read_dir(proc_path(pid, "task"))
        .map(|entries| {
            entries
                .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

pub fn command_name(pid: u32) -> String {
    std::fs::read_to_string(proc_path(pid, "comm"))
        .map(|c| c.trim_end().to_owned())
        .unwrap_or_else(|_| "?".into())
}

/// The pid as the process's own pid namespace sees it (`NSpid`), when it
/// differs from ours: the pid inside its container.
pub fn namespace_pid(pid: u32) -> Option<u32> {
    let status = std::fs::read_to_string(proc_path(pid, "status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("NSpid:"))?;
    let inner: u32 = line.split_whitespace().last()?.parse().ok()?;
    (inner != pid).then_some(inner)
}

/// How often the process's main thread (the task whose id is `pid`) has
/// been switched out, voluntarily or not; `None` once it is gone.
pub fn main_thread_switches(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(proc_path(pid, &format!("task/{pid}/status"))).ok()?;
    context_switches(&status)
}

/// `pid`'s resident bytes (`statm`: the kernel's counters, no walk of its
/// page tables); `None` once it is gone.
pub fn resident_bytes(pid: u32) -> Option<u64> {
    let statm = std::fs::read_to_string(proc_path(pid, "statm")).ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    Some(pages * page.max(1) as u64)
}

/// The CPU time `pid` has used so far, all its threads, user and system
/// (probe traps included: they run in its threads), in seconds.
pub fn cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(proc_path(pid, "stat")).ok()?;
    cpu_ticks(&stat).map(tick_seconds)
}

/// Clock ticks, the unit of `stat`'s times, in seconds.
fn tick_seconds(ticks: u64) -> f64 {
    // SAFETY: sysconf has no preconditions.
    let per_second = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    ticks as f64 / per_second.max(1) as f64
}

/// The time `pid`'s threads have spent on a CPU so far, in nanoseconds
/// (each thread's `schedstat`: precise where `stat` counts clock ticks, so
/// a span of a few milliseconds reads true); `None` once it is gone.
pub fn run_nanos(pid: u32) -> Option<u64> {
    let tasks = std::fs::read_dir(proc_path(pid, "task")).ok()?;
    let total = tasks
        .filter_map(|task| {
            let stat = std::fs::read_to_string(task.ok()?.path().join("schedstat")).ok()?;
            stat.split_whitespace().next()?.parse::<u64>().ok()
        })
        .sum();
    Some(total)
}

/// Each CPU's busy time so far, in clock ticks, by CPU number (`None`
/// where /proc/stat cannot be read).
pub fn cpu_busy_ticks() -> Option<Vec<(usize, u64)>> {
    std::fs::read_to_string("/proc/stat")
        .ok()
        .map(|stat| parse_cpu_busy(&stat))
}

/// The `cpuN` lines of /proc/stat: user, nice, system, idle, iowait, irq,
/// softirq, steal (then guest times, already within user and nice), busy
/// being all but idle and iowait (stolen time is a CPU not to be had).
fn parse_cpu_busy(stat: &str) -> Vec<(usize, u64)> {
    const IDLE: usize = 3;
    const IOWAIT: usize = 4;
    stat.lines()
        .filter_map(|line| {
            let mut fields = line.split_whitespace();
            let cpu = fields.next()?.strip_prefix("cpu")?.parse().ok()?;
            let mut busy = 0;
            for (index, field) in fields.take(8).enumerate() {
                let ticks: u64 = field.parse().ok()?;
                if index != IDLE && index != IOWAIT {
                    busy += ticks;
                }
            }
            Some((cpu, busy))
        })
        .collect()
}

/// How long ago `pid` started, to a clock tick (its `stat` start time
/// against the system's uptime); `None` once it is gone.
pub fn age(pid: u32) -> Option<Duration> {
    let stat = std::fs::read_to_string(proc_path(pid, "stat")).ok()?;
    let started = parse_maps_stamp(&stat)?.started;
    let uptime = std::fs::read_to_string("/proc/uptime").ok()?;
    let uptime: f64 = uptime.split_whitespace().next()?.parse().ok()?;
    let since = uptime - tick_seconds(started);
    Some(Duration::from_secs_f64(since.max(0.0)))
}

/// Whether `pid` has ended: gone, or a zombie (state `Z` or `X` in
/// `stat`), whose files and memory are no longer there to probe.
pub fn has_ended(pid: u32) -> bool {
    let Ok(stat) = std::fs::read_to_string(proc_path(pid, "stat")) else {
        return true;
    };
    let state = stat_fields(&stat).and_then(|mut fields| fields.next());
    matches!(state, None | Some("Z" | "X"))
}

/// A `stat` line's fields from the third (the state) on: those after the
/// command's closing parenthesis, since a command may hold spaces and ')'.
fn stat_fields(stat: &str) -> Option<std::str::SplitWhitespace<'_>> {
    Some(stat.rsplit_once(')')?.1.split_whitespace())
}

/// utime + stime from a `stat` line: fields 14 and 15.
fn cpu_ticks(stat: &str) -> Option<u64> {
    let mut fields = stat_fields(stat)?.skip(11);
    let utime: u64 = fields.next()?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    Some(utime + stime)
}

/// The sum of `voluntary_ctxt_switches` and `nonvoluntary_ctxt_switches`
/// in a task's `status` text.
fn context_switches(status: &str) -> Option<u64> {
    let count = |name: &str| -> Option<u64> {
        let line = status.lines().find(|l| l.starts_with(name))?;
        line[name.len()..].trim().parse().ok()
    };
    Some(count("voluntary_ctxt_switches:")? + count("nonvoluntary_ctxt_switches:")?)
}

/// What says whether a process's maps may have changed since a look: its
/// start time (a pid used again is another process) and its virtual size
/// (a library mapped or unmapped changes it). Read from `stat`, which
/// walks none of its mappings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MapsStamp {
    started: u64,
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

/// Every pid in /proc.
pub fn all_pids() -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect()
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
    fn cpu_ticks_are_read_past_a_command_with_spaces_and_parentheses() {
        let stat = "4242 (a b) c) S 1 4242 4242 0 -1 4194560 100 0 0 0 250 37 0 0 20 0 3";
        assert_eq!(cpu_ticks(stat), Some(287));
        assert!(cpu_seconds(std::process::id()).is_some());
    }

    #[test]
    fn a_cpu_is_busy_but_for_idle_and_iowait() {
        let stat = "cpu  10 1 5 100 7 2 3 4 0 0\n\
                    cpu0 6 1 3 50 7 1 2 4 9 0\n\
                    cpu1 4 0 2 50 0 1 1 0 0 0\n\
                    intr 12345 0 1\n";
        assert_eq!(parse_cpu_busy(stat), vec![(0, 17), (1, 8)]);
        let cpus = cpu_busy_ticks().unwrap();
        assert!(!cpus.is_empty(), "{cpus:?}");
    }

    #[test]
    fn a_process_s_age_counts_from_its_start() {
        let mut child = std::process::Command::new("sleep")
            .arg("5")
            .spawn()
            .unwrap();
        let young = age(child.id()).unwrap();
        let _ = child.kill();
        let _ = child.wait();
        // A clock tick's rounding either way.
        assert!(young < Duration::from_millis(500), "{young:?}");
        assert_eq!(age(u32::MAX), None);
    }

    #[test]
    fn a_zombie_or_a_reaped_process_has_ended() {
        assert!(!has_ended(std::process::id()));
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        // Not waited for yet: a zombie once it exits.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while !has_ended(pid) {
            assert!(std::time::Instant::now() < deadline, "{pid} never ended");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        child.wait().unwrap();
        assert!(has_ended(pid));
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

    #[test]
    fn context_switches_add_both_kinds() {
        let status = "Name:\tdemo\nvoluntary_ctxt_switches:\t120\nnonvoluntary_ctxt_switches:\t3\n";
        assert_eq!(context_switches(status), Some(123));
        assert_eq!(context_switches("Name:\tdemo\n"), None);
        let own = main_thread_switches(std::process::id());
        assert!(own.is_some(), "{own:?}");
    }
}
