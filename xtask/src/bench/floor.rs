//! The two-trap floor: counting uprobe perf events, with no BPF program,
//! at the very instructions memprobe probes in `malloc` and `free`. Every
//! malloc+free pair then pays two traps and nothing else: what any design
//! that traps on both calls costs at least, measured in the same run as
//! memprobe.
use std::{
    ffi::CString,
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
    path::Path,
    process::{Command, Stdio},
};

use anyhow::{Context, Result, bail};

use super::{line_with, start_memprobe, stop};

/// `struct perf_event_attr` up to `config2` (`PERF_ATTR_SIZE_VER1`).
#[repr(C)]
#[derive(Default)]
struct PerfEventAttr {
    kind: u32,
    size: u32,
    config: u64,
    sample_period: u64,
    sample_type: u64,
    read_format: u64,
    flags: u64,
    wakeup_events: u32,
    bp_type: u32,
    /// For the uprobe PMU: a pointer to the file's path.
    config1: u64,
    /// For the uprobe PMU: the probe's file offset.
    config2: u64,
}

/// `perf_event_open`'s flag for a close-on-exec descriptor.
const PERF_FLAG_FD_CLOEXEC: libc::c_ulong = 1 << 3;

/// A probed instruction: the file and the offset in it.
pub(super) type Place = (String, u64);

/// Probes that count their hits and nothing else: the floors. A floor that
/// counted none measured nothing.
pub(super) trait CountsHits {
    /// Hits counted so far.
    fn hits(&self) -> Result<u64>;
}

/// Counting uprobe events on one process; removed when dropped.
pub(super) struct Floor {
    events: Vec<OwnedFd>,
}

impl Floor {
    pub(super) fn attach(pid: u32, places: &[Place]) -> Result<Self> {
        let kind: u32 = std::fs::read_to_string("/sys/bus/event_source/devices/uprobe/type")
            .context("no uprobe PMU in /sys/bus/event_source/devices")?
            .trim()
            .parse()?;
        let mut events = Vec::new();
        for (path, offset) in places {
            let path = CString::new(path.as_str())?;
            let attr = PerfEventAttr {
                kind,
                size: std::mem::size_of::<PerfEventAttr>() as u32,
                config1: path.as_ptr() as u64,
                config2: *offset,
                ..Default::default()
            };
            // SAFETY: attr outlives the call; the kernel copies the path.
            let fd = unsafe {
                libc::syscall(
                    libc::SYS_perf_event_open,
                    &attr as *const PerfEventAttr,
                    pid as libc::pid_t,
                    -1,
                    -1,
                    PERF_FLAG_FD_CLOEXEC,
                )
            };
            if fd < 0 {
                bail!(
                    "perf_event_open of a uprobe at {path:?}+{offset:#x}: {}",
                    std::io::Error::last_os_error()
                );
            }
            // SAFETY: a new descriptor that nothing else owns.
            events.push(unsafe { OwnedFd::from_raw_fd(fd as i32) });
        }
        Ok(Self { events })
    }
}

impl CountsHits for Floor {
    /// Hits counted so far, all places together.
    fn hits(&self) -> Result<u64> {
        let mut total = 0;
        for event in &self.events {
            let mut count = 0u64;
            // SAFETY: reads 8 bytes into a u64 of ours.
            let read = unsafe { libc::read(event.as_raw_fd(), (&raw mut count).cast(), 8) };
            if read != 8 {
                bail!(
                    "reading a uprobe counter: {}",
                    std::io::Error::last_os_error()
                );
            }
            total += count;
        }
        Ok(total)
    }
}

/// Where memprobe places its `malloc` (at entry sampling) and `free`
/// probes in `library`, as its `--verbose` lines say (`malloc at PATH+0xFUNC+0xOFFSET ...`), read
/// from a run attached to a short loop.
pub(super) fn memprobe_places(
    memprobe: &Path,
    malloc_loop: &Path,
    library: &str,
) -> Result<[Place; 2]> {
    // Long enough to outlast memprobe's start (its cost calibration can
    // take seconds on a busy host: a 2 s loop once exited first), stopped
    // once the places are read.
    let mut target = Command::new(malloc_loop)
        .args(["0", "60"])
        .stdout(Stdio::null())
        .spawn()?;
    let pid = target.id().to_string();
    let args = [
        "--pid",
        &pid,
        "--verbose",
        "--sampling",
        "entry",
        "-o",
        "/tmp",
        "--format",
        "heap",
    ];
    let started = start_memprobe(memprobe, &args);
    let _ = target.kill();
    let _ = target.wait();
    let (mut probe, stderr) = started?;
    stop(&mut probe);
    let place = |symbol: &str| -> Result<Place> {
        let key = format!(": {symbol} at {library}+");
        let line = line_with(&stderr, &key)
            .with_context(|| format!("memprobe --verbose named no {symbol} in {library}"))?;
        let rest = &line[line.find(&key).unwrap_or(0) + key.len()..];
        let mut offsets = rest.split(['+', ' ']).take(2).map(|hex| {
            u64::from_str_radix(hex.trim_start_matches("0x"), 16)
                .with_context(|| format!("no offset in {line:?}"))
        });
        let (function, within) = (
            offsets.next().context("offset")??,
            offsets.next().context("offset")??,
        );
        Ok((library.to_owned(), function + within))
    };
    Ok([place("malloc")?, place("free")?])
}
