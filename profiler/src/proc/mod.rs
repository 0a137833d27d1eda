//! The processes to profile, as /proc shows them: maps, names, pids, roots.
mod cpus;
mod error;
mod maps;
mod memory;
pub mod resident;
pub mod rootfs;
mod stat;
use std::path::PathBuf;

pub use cpus::CpuSet;
pub use error::ProcessError;
pub use maps::{
    AddressRange, FileId, Mapping, MapsStamp, file_base, mapped_address, maps_stamp, parse_maps,
    read_maps,
};
pub use memory::ProcessMemory;
pub use stat::{
    age, cpu_busy_ticks, cpu_seconds, has_ended, main_thread_switches, resident_bytes, run_nanos,
};

pub fn proc_path(pid: u32, rest: &str) -> PathBuf {
    PathBuf::from(format!("/proc/{pid}/{rest}"))
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

/// Every pid in /proc.
pub fn all_pids() -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect()
}
