//! What a run keeps per profiled process.
use std::{
    collections::HashSet,
    ops::Range,
    time::{Duration, Instant},
};

use crate::{
    collect::{CollectorOptions, ProcessHeap, mappings::Mappings},
    discover::AllocatorKind,
    proc::{FileId, Mapping, command_name, namespace_pid, parse_maps},
    profile::{HeapProfile, MemoryReading},
    python::{ProcessPython, PythonRuntime, runtime},
    stacks::ProcessStacks,
};

pub(super) struct Tracked {
    pub pid: u32,
    pub command: String,
    pub container_pid: Option<u32>,
    pub heap: ProcessHeap,
    /// `/proc/PID/maps` as last read: written with each profile.
    pub maps: String,
    /// `maps` parsed once: to notice samples from code mapped since (a
    /// library just loaded, a launched command just exec'd), and to place
    /// slow-path samples' frames by file offset.
    mappings: Vec<Mapping>,
    /// Unwinding, frame-pointer trust, the uretprobe trampoline.
    pub stacks: ProcessStacks,
    /// The anonymous memory it mapped while profiled, by stack.
    pub mapped: Mappings,
    /// What the kernel said of its memory when last read, and when it is
    /// next read besides its snapshots.
    pub memory: Option<MemoryReading>,
    pub memory_due: Instant,
    /// Allocators (per file) probed for this process (or whose attach
    /// failed: they are not tried again).
    pub attached_files: HashSet<(FileId, AllocatorKind)>,
    pub exited: bool,
    /// Whether memprobe said that no probed allocator of it was called.
    pub silence_reported: bool,
    /// Its allocators and their allocation calls, as of its last snapshot.
    pub allocator_calls: Vec<(String, Option<u64>)>,
    /// How allocator copies were found where no symbol named them.
    pub found_notes: Vec<String>,
    /// Its CPython, where it runs one: its samples' Python frames.
    pub python: Option<ProcessPython>,
    /// The files looked at for CPython.
    pub python_files_seen: HashSet<FileId>,
    /// When it was found, and its threads' time on a CPU then.
    pub found: (Instant, Option<u64>),
}

impl Tracked {
    pub fn new(pid: u32, maps: String, sample_interval: u64, collector: CollectorOptions) -> Self {
        let mut tracked = Self {
            pid,
            command: command_name(pid),
            container_pid: namespace_pid(pid),
            heap: ProcessHeap::new(pid, sample_interval, collector),
            maps: String::new(),
            mappings: Vec::new(),
            stacks: ProcessStacks::default(),
            mapped: Mappings::default(),
            memory: None,
            memory_due: Instant::now(),
            attached_files: HashSet::new(),
            exited: false,
            silence_reported: false,
            allocator_calls: Vec::new(),
            found_notes: Vec::new(),
            python: None,
            python_files_seen: HashSet::new(),
            found: (Instant::now(), crate::proc::run_nanos(pid)),
        };
        tracked.set_maps(Some(maps));
        tracked
    }

    /// The time its threads spent on a CPU since it was found, and how
    /// long ago that was.
    pub fn used_since_found(&self) -> Option<(Duration, Duration)> {
        let (at, before) = self.found;
        let used = crate::proc::run_nanos(self.pid)?.checked_sub(before?)?;
        Some((Duration::from_nanos(used), at.elapsed()))
    }

    /// Its heap profile now, with the names of the Python frames in it.
    pub fn profile(&self) -> HeapProfile {
        let mut profile = self.heap.snapshot(self.maps.clone());
        if let Some(python) = &self.python {
            let frames = profile.stacks.iter().flat_map(|s| &s.frames);
            profile.python_frames = python.names_in(frames);
            profile.notes.python = Some(python.note());
        }
        profile
    }

    /// The CPython in its mappings, looking only in files not looked in
    /// yet.
    pub fn find_python(&mut self) -> Option<PythonRuntime> {
        runtime::find(self.pid, &self.mappings, &mut self.python_files_seen)
    }

    /// Its mappings as last read.
    pub fn mappings(&self) -> &[Mapping] {
        &self.mappings
    }

    /// Keeps a fresh copy of the maps; a failed read keeps the last good one
    /// (the process may be gone).
    pub fn set_maps(&mut self, maps: Option<String>) {
        if let Some(maps) = maps {
            self.mappings = parse_maps(&maps);
            self.stacks.set_mappings(self.pid, &self.mappings);
            self.maps = maps;
        }
    }

    /// Drops the leading frames in `own_code` (file-offset extents of
    /// `path`: a jemalloc copy's own code between its slow path and the
    /// program). Only those: the same file may hold the program's code too
    /// (jemalloc linked into an executable or a JNI library).
    pub fn drop_allocator_frames(
        &self,
        path: &str,
        own_code: &[Range<u64>],
        frames: &mut Vec<u64>,
    ) {
        let inside = |address: u64| {
            self.mappings.iter().any(|m| {
                m.path.as_deref() == Some(path)
                    && m.range().contains(address)
                    && own_code
                        .iter()
                        .any(|r| r.contains(&(m.offset + address - m.start)))
            })
        };
        let own = frames.iter().take_while(|&&f| inside(f)).count();
        if own < frames.len() {
            frames.drain(..own);
        }
    }

    /// Whether a sample with `frames` comes from code mapped since the
    /// maps were read.
    pub fn comes_from_unmapped_code(&self, frames: &[u64]) -> bool {
        frames
            .first()
            .is_some_and(|&caller| !self.mappings.iter().any(|m| m.range().contains(caller)))
    }
}
