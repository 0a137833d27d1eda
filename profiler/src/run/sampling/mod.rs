//! How a process's allocation calls are sampled beyond memprobe's own
//! byte countdown at every call: jemalloc's `malloc` in short windows
//! ([`windows`], the default), or through jemalloc's own profiler where it
//! runs ([`own_profiler`]).
pub(super) mod own_profiler;
pub mod windows;

use std::collections::BTreeMap;

use own_profiler::WatchedCopy;
use windows::Windows;

/// How one process's allocation calls are sampled beyond the byte
/// countdown at every call.
#[derive(Debug, Default)]
pub(in crate::run) struct ProcessSampling {
    /// Its jemalloc copies sampled in windows (the default).
    pub windows: Option<Windows>,
    /// Copies whose jemalloc has a profiler, watched in case it is
    /// switched on or off.
    pub watched: Vec<WatchedCopy>,
    /// How copies not in windows are sampled, and why (the profile's
    /// note): at entry, or by jemalloc's own profiler.
    pub notes: Vec<String>,
}

/// The sampling part: each process's.
#[derive(Debug, Default)]
pub(in crate::run) struct SamplingState {
    processes: BTreeMap<u32, ProcessSampling>,
}

impl SamplingState {
    pub fn of(&self, pid: u32) -> Option<&ProcessSampling> {
        self.processes.get(&pid)
    }

    pub fn of_mut(&mut self, pid: u32) -> &mut ProcessSampling {
        self.processes.entry(pid).or_default()
    }

    /// Forgets how `pid` was sampled (its allocators are no longer
    /// probed).
    pub fn forget(&mut self, pid: u32) {
        self.processes.remove(&pid);
    }

    pub fn windows(&self, pid: u32) -> Option<&Windows> {
        self.of(pid)?.windows.as_ref()
    }

    pub fn windows_mut(&mut self, pid: u32) -> Option<&mut Windows> {
        self.processes.get_mut(&pid)?.windows.as_mut()
    }
}
