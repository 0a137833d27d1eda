//! Snapshots are named and written on a thread of their own: asking a JVM
//! for its perf map (`jcmd`, seconds on a loaded host), naming frames with
//! blazesym in a big binary, and fsync never hold up the loop that drains
//! the ring buffer. The loop hands over an owned profile and hears back
//! which files were written.
use std::{
    collections::HashMap,
    path::PathBuf,
    sync::mpsc::{self, Receiver, Sender},
    thread::JoinHandle,
    time::Duration,
};

use crate::{
    account,
    error::Result,
    output::WriteError,
    output::{self, Format, files::OutputDir, files::file_name},
    profile::{HeapProfile, MemoryAccount},
    symbolize::{
        Namer,
        perfmap::{self, RequestedPerfMap},
    },
};

/// Snapshots of one process that may wait for the writer; past them,
/// periodic ones are skipped (and counted), so a slow writer costs a bounded
/// amount of memory. The first snapshot of a process builds its namer,
/// which can take longer than a short `--interval`.
const MAX_PENDING: usize = 4;

/// One snapshot to write.
pub(in crate::run) struct Job {
    pub pid: u32,
    pub seq: u64,
    pub profile: HeapProfile,
    pub formats: Vec<Format>,
    /// Ask HotSpot for a perf map first, reading it as this pid (the one
    /// inside the process's container) sees it.
    pub jvm_perfmap: Option<u32>,
    /// The process's last snapshot: its namer can go afterwards.
    pub last: bool,
    /// What the loop says once the files are there.
    pub announce: Announce,
}

/// The line a finished snapshot is announced with.
pub(in crate::run) enum Announce {
    Nothing,
    Exited,
    Growth(String),
    /// Detached for costing it more than `--max-overhead`: why.
    Detached(String),
}

/// A finished snapshot.
pub(in crate::run) struct Done {
    pub pid: u32,
    pub announce: Announce,
    /// The files written, in the order of the formats.
    pub files: Result<Vec<(Format, PathBuf)>>,
    /// The process's memory accounted for, where it was read.
    pub account: Option<MemoryAccount>,
}

pub(in crate::run) struct SnapshotWriter {
    jobs: Option<Sender<Job>>,
    done: Receiver<Done>,
    thread: Option<JoinHandle<()>>,
    /// Jobs handed over and not yet done, per pid.
    pending: HashMap<u32, usize>,
}

impl SnapshotWriter {
    /// Starts the thread; namers also look for debug files in `debug_dir`.
    pub fn start(output: OutputDir, debug_dir: Option<PathBuf>) -> Self {
        let (jobs, job_rx) = mpsc::channel::<Job>();
        let (done_tx, done) = mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("memprobe-writer".into())
            .spawn(move || {
                let mut state = WriterState {
                    debug_dir,
                    ..WriterState::default()
                };
                for job in job_rx {
                    let (pid, last) = (job.pid, job.last);
                    let done = write(&output, &mut state, job);
                    if last {
                        state.forget(pid);
                    }
                    if done_tx.send(done).is_err() {
                        break;
                    }
                }
                state.forget_all();
            })
            .ok();
        Self {
            jobs: Some(jobs),
            done,
            thread,
            pending: HashMap::new(),
        }
    }

    pub fn is_idle(&self) -> bool {
        self.pending.values().all(|&n| n == 0)
    }

    /// Whether [`MAX_PENDING`] snapshots of `pid` are still to be written:
    /// a periodic one is then skipped rather than queued behind them.
    pub fn busy_with(&self, pid: u32) -> bool {
        self.pending.get(&pid).is_some_and(|&n| n >= MAX_PENDING)
    }

    pub fn submit(&mut self, job: Job) {
        *self.pending.entry(job.pid).or_default() += 1;
        if let Some(jobs) = &self.jobs {
            let _ = jobs.send(job);
        }
    }

    /// Snapshots finished since the last call, without waiting.
    pub fn finished(&mut self) -> Vec<Done> {
        let done: Vec<Done> = self.done.try_iter().collect();
        self.count_done(&done);
        done
    }

    /// Waits for every snapshot handed over; the writer stops.
    pub fn finish(&mut self) -> Vec<Done> {
        drop(self.jobs.take());
        let done: Vec<Done> = self.done.iter().collect();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        self.count_done(&done);
        done
    }

    fn count_done(&mut self, done: &[Done]) {
        for d in done {
            if let Some(n) = self.pending.get_mut(&d.pid) {
                *n = n.saturating_sub(1);
            }
        }
    }
}

/// What the writer keeps per process between its snapshots.
#[derive(Default)]
struct WriterState {
    /// Each process's namer, with the maps it was built from.
    namers: HashMap<u32, (String, Namer)>,
    /// JVMs' perf maps, to remove where memprobe made them.
    perf_maps: HashMap<u32, RequestedPerfMap>,
    /// `--debug-dir`.
    debug_dir: Option<PathBuf>,
}

impl WriterState {
    /// The process's last snapshot is written: drop what was kept for it.
    fn forget(&mut self, pid: u32) {
        self.namers.remove(&pid);
        if let Some(map) = self.perf_maps.remove(&pid) {
            map.remove();
        }
    }

    fn forget_all(&mut self) {
        let pids: Vec<u32> = self.perf_maps.keys().copied().collect();
        for pid in pids {
            self.forget(pid);
        }
    }
}

fn write(output: &OutputDir, state: &mut WriterState, job: Job) -> Done {
    let Job {
        pid,
        seq,
        mut profile,
        formats,
        jvm_perfmap,
        announce,
        ..
    } = job;
    let maps = &profile.mapped_libraries;
    // A memory account names its mappings' stacks.
    let symbolized = formats.iter().any(|f| *f != Format::Heap) || profile.memory.is_some();
    let namers = &mut state.namers;
    if symbolized && namers.get(&pid).is_none_or(|(known, _)| known != maps) {
        let namer = Namer::for_process(pid, maps).with_debug_dir(state.debug_dir.clone());
        namers.insert(pid, (maps.clone(), namer));
    }
    let mut namer = namers.get_mut(&pid).map(|(_, n)| n);
    // A JVM's JIT code is anonymous memory: its names come from HotSpot.
    if let (Some(inner_pid), Some(namer)) = (jvm_perfmap, namer.as_deref_mut()) {
        if !state.perf_maps.contains_key(&pid)
            && let Some(map) = RequestedPerfMap::before_request(pid, inner_pid)
        {
            state.perf_maps.insert(pid, map);
        }
        perfmap::request_from_hotspot(pid, Duration::from_secs(10));
        namer.set_jit(perfmap::read_for_process(pid, inner_pid));
        let addresses = profile.stacks.iter().flat_map(|s| &s.frames);
        profile.jit_symbols = namer.jit_names(addresses.map(|f| f.saturating_sub(1)));
    }
    if let Some(namer) = namer.as_deref_mut() {
        namer.add_python(&profile.python_frames);
    }
    if let (Some(reading), Some(namer)) = (&profile.memory, namer.as_deref_mut()) {
        profile.account = Some(account::account(&profile, reading, namer));
    }
    let account = profile.account.clone();
    let files =
        write_files(output, (pid, seq), &profile, &formats, namer).map_err(|error| error.into());
    Done {
        pid,
        announce,
        files,
        account,
    }
}

/// Writes the snapshot in each of `formats`, and its mappings' profiles
/// where it has them; the files in that order.
fn write_files(
    output: &OutputDir,
    (pid, seq): (u32, u64),
    profile: &HeapProfile,
    formats: &[Format],
    mut namer: Option<&mut Namer>,
) -> std::result::Result<Vec<(Format, PathBuf)>, WriteError> {
    let mut files = Vec::new();
    let mut write_one = |format: Format, ext: &str, mappings: bool, namer: Option<&mut Namer>| {
        let written = output.write_file(pid, seq, ext, |w| match (mappings, namer) {
            (true, Some(namer)) => output::mappings::write(format, profile, namer, w),
            (true, None) => Ok(()),
            (false, namer) => output::write_format(format, profile, namer, w),
        });
        match written {
            Ok(path) => {
                files.push((format, path));
                Ok(())
            }
            Err(cause) => {
                let path = output.path().join(file_name(pid, seq, ext));
                Err(WriteError { path, cause })
            }
        }
    };
    for &format in formats {
        write_one(format, format.extension(), false, namer.as_deref_mut())?;
    }
    let has_mappings = profile
        .memory
        .as_ref()
        .is_some_and(|m| !m.mapped.is_empty());
    let with_mappings = if has_mappings && namer.is_some() {
        formats
    } else {
        &[]
    };
    for &format in with_mappings {
        if let Some(ext) = output::mappings::extension(format) {
            write_one(format, ext, true, namer.as_deref_mut())?;
        }
    }
    Ok(files)
}
