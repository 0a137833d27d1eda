//! Names of JIT-compiled code: `/tmp/perf-<pid>.map` files, as HotSpot
//! writes them on `jcmd <pid> Compiler.perfmap` (with `0x` prefixes), read
//! inside the target's root even when it runs in a container.
use std::{
    io::Read,
    path::Path,
    process::{Command, Stdio},
    time::Duration,
};

/// One code blob: [start, start + size) is `name`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JitSymbol {
    pub start: u64,
    pub size: u64,
    pub name: String,
}

fn hex(text: &str) -> Option<u64> {
    u64::from_str_radix(text.trim_start_matches("0x"), 16).ok()
}

/// Parses `START SIZE name` lines (hex, `0x` optional), sorted by start.
pub fn parse(text: &str) -> Vec<JitSymbol> {
    let mut symbols: Vec<JitSymbol> = text
        .lines()
        .filter_map(|line| {
            let mut parts = line.trim().splitn(3, ' ');
            let start = hex(parts.next()?)?;
            let size = hex(parts.next()?)?;
            let name = parts.next()?.trim().to_owned();
            (size > 0 && !name.is_empty()).then_some(JitSymbol { start, size, name })
        })
        .collect();
    symbols.sort_by_key(|s| s.start);
    symbols
}

/// The symbol covering `address` in symbols sorted by start.
pub fn lookup(symbols: &[JitSymbol], address: u64) -> Option<&JitSymbol> {
    let index = symbols.partition_point(|s| s.start <= address);
    let candidate = symbols.get(index.checked_sub(1)?)?;
    (address < candidate.start + candidate.size).then_some(candidate)
}

/// Reads the perf map of `pid`: `/tmp/perf-<pid as the process sees it>.map`
/// inside its root. Bounded: at most 64 MiB are read.
pub fn read_for_process(pid: u32, namespace_pid: u32) -> Vec<JitSymbol> {
    let root = crate::proc::proc_path(pid, "root");
    let path = format!("/tmp/perf-{namespace_pid}.map");
    let Ok(file) = crate::proc::rootfs::open_in_root(&root, Path::new(&path)) else {
        return Vec::new();
    };
    let mut text = String::new();
    if file.take(64 << 20).read_to_string(&mut text).is_err() {
        return Vec::new();
    }
    parse(&text)
}

/// A perf map memprobe is about to have a JVM write: if none was there
/// before, memprobe made it and removes it once done with the process, in
/// the `/tmp` of the process's root that it opened while the process lived
/// (so a container's file goes too, even after the process exited; a link
/// planted there is removed as a link, never followed).
pub struct RequestedPerfMap {
    tmp: std::fs::File,
    name: std::ffi::CString,
    made_by_us: bool,
}

impl RequestedPerfMap {
    /// Notes, before the first request, whether the map exists.
    pub fn before_request(pid: u32, namespace_pid: u32) -> Option<Self> {
        let root = crate::proc::proc_path(pid, "root");
        let tmp = crate::proc::rootfs::open_dir_in_root(&root, Path::new("/tmp")).ok()?;
        let name = std::ffi::CString::new(format!("perf-{namespace_pid}.map")).ok()?;
        // SAFETY: a zeroed stat is valid; fstatat writes into it.
        let mut stat: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: a valid directory fd and NUL-terminated name.
        let exists = unsafe {
            libc::fstatat(
                std::os::fd::AsRawFd::as_raw_fd(&tmp),
                name.as_ptr(),
                &mut stat,
                libc::AT_SYMLINK_NOFOLLOW,
            )
        } == 0;
        Some(Self {
            tmp,
            name,
            made_by_us: !exists,
        })
    }

    /// Removes the map if memprobe made it.
    pub fn remove(self) {
        if self.made_by_us {
            // SAFETY: a valid directory fd and NUL-terminated name; unlinkat
            // removes a symlink itself, never its target.
            unsafe {
                libc::unlinkat(
                    std::os::fd::AsRawFd::as_raw_fd(&self.tmp),
                    self.name.as_ptr(),
                    0,
                )
            };
        }
    }
}

/// Asks a running HotSpot JVM to write its perf map (`jcmd PID
/// Compiler.perfmap`), waiting at most `timeout`. False if it could not.
pub fn request_from_hotspot(pid: u32, timeout: Duration) -> bool {
    let Ok(mut child) = Command::new("jcmd")
        .arg(pid.to_string())
        .arg("Compiler.perfmap")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
    else {
        return false;
    };
    let deadline = std::time::Instant::now() + timeout;
    loop {
        match child.try_wait() {
            Ok(Some(status)) => return status.success(),
            Ok(None) if std::time::Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(20));
            }
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                return false;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_hotspot_and_plain_lines() {
        let text = "0x00007f0001000000 0x0000000000000100 Interpreter\n\
                    7f0001000200 80 LHotAlloc;::allocate\n\
                    garbage\n\
                    0x1 0x0 empty\n";
        let symbols = parse(text);
        assert_eq!(symbols.len(), 2);
        assert_eq!(
            lookup(&symbols, 0x7f00010000ff).unwrap().name,
            "Interpreter"
        );
        assert_eq!(lookup(&symbols, 0x7f0001000100), None);
        assert_eq!(
            lookup(&symbols, 0x7f0001000210).unwrap().name,
            "LHotAlloc;::allocate"
        );
        assert_eq!(lookup(&symbols, 0x10), None);
    }
}
