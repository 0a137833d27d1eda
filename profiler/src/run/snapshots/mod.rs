//! Snapshots: a process's profile taken on the loop (owned data, quickly,
//! [`take`]) and handed to the writer thread ([`writer`]), when the
//! process exits, on a timer, on SIGUSR1 and on growth ([`growth`]); what
//! the writer finished is recorded here, and old snapshots removed past
//! `--keep` and `--max-disk` ([`retention`]).
pub(in crate::run) mod growth;
pub mod retention;
mod take;
pub(in crate::run) mod writer;

use std::{
    collections::HashMap,
    io::Write,
    path::PathBuf,
    time::{Duration, Instant},
};

use crate::{
    error::Result,
    output::Format,
    profile::MemoryAccount,
    run::{
        GrowthTrigger,
        options::Growing,
        snapshots::{
            growth::{GrowthWindow, Reading},
            retention::{KeptSnapshots, Retention},
            writer::{Announce, Done, SnapshotWriter},
        },
    },
};

/// Why a snapshot is taken, which decides whether it may be skipped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(in crate::run) enum SnapshotKind {
    /// `--interval`: skipped while several of the process's earlier ones
    /// are still to be written, so the writer never falls ever further
    /// behind.
    Periodic,
    /// SIGUSR1: always taken.
    Requested,
    /// The process's last: at its exit or at the end of the run.
    Last,
}

/// A process whose growth calls for a snapshot.
#[derive(Debug)]
pub(in crate::run) struct Grown {
    pub pid: u32,
    /// Why (each trigger that fired).
    pub reason: String,
    /// Whether its resident memory's trigger fired.
    pub resident: bool,
}

/// What one process's snapshots left.
#[derive(Debug, Default)]
pub(in crate::run) struct ProcessSnapshots {
    /// Taken so far, and periodic ones skipped because earlier ones were
    /// still being written.
    pub taken: u64,
    pub skipped: u64,
    /// Every file written and still on disk, all formats; the `heap_v2`
    /// ones among them, in order.
    pub files: Vec<PathBuf>,
    pub heaps: Vec<PathBuf>,
    /// Its memory accounted for, as of its last snapshot that read it.
    pub account: Option<MemoryAccount>,
    kept: KeptSnapshots,
    /// One per `--dump-on-growth` trigger.
    growth: Vec<GrowthWindow>,
}

impl ProcessSnapshots {
    /// Snapshots removed to stay within `--keep` and `--max-disk`.
    pub fn removed(&self) -> u64 {
        self.kept.removed
    }
}

/// The run's snapshots: the writer, and what each process's left.
pub(in crate::run) struct Snapshots {
    pub writer: SnapshotWriter,
    retention: Retention,
    /// `--dump-on-growth`'s triggers, and the least time between two such
    /// dumps.
    growth: (Vec<GrowthTrigger>, Duration),
    processes: HashMap<u32, ProcessSnapshots>,
}

impl Snapshots {
    pub fn new(
        writer: SnapshotWriter,
        retention: Retention,
        growth: (Vec<GrowthTrigger>, Duration),
    ) -> Self {
        Self {
            writer,
            retention,
            growth,
            processes: HashMap::new(),
        }
    }

    pub fn of(&self, pid: u32) -> Option<&ProcessSnapshots> {
        self.processes.get(&pid)
    }

    pub fn of_mut(&mut self, pid: u32) -> &mut ProcessSnapshots {
        self.processes.entry(pid).or_default()
    }

    /// Takes what `pid`'s snapshots left (at the end of the run).
    pub fn take(&mut self, pid: u32) -> ProcessSnapshots {
        self.processes.remove(&pid).unwrap_or_default()
    }

    /// Snapshots written so far, all processes.
    pub fn written(&self) -> usize {
        self.processes.values().map(|p| p.heaps.len()).sum()
    }

    /// Whether a `--dump-on-growth` trigger watches resident memory.
    pub fn watches_resident(&self) -> bool {
        self.growth.0.iter().any(|t| t.of == Growing::Resident)
    }

    /// `--dump-on-growth`: takes each process's estimated heap in use and
    /// resident bytes now (where read); the processes whose growth calls
    /// for a snapshot, with why (one snapshot however many triggers).
    pub fn grown(&mut self, now: Instant, readings: Vec<(u32, Reading)>) -> Vec<Grown> {
        let (triggers, min_gap) = self.growth.clone();
        let mut due = Vec::new();
        for (pid, reading) in readings {
            let windows = &mut self.of_mut(pid).growth;
            windows.resize_with(triggers.len(), GrowthWindow::default);
            let fired: Vec<(Growing, String)> = triggers
                .iter()
                .zip(windows.iter_mut())
                .filter_map(|(trigger, window)| {
                    let bytes = match trigger.of {
                        Growing::Heap => reading.heap,
                        Growing::Resident => reading.resident?,
                    };
                    let reason = window.observe(now, bytes, *trigger, min_gap)?;
                    Some((trigger.of, reason))
                })
                .collect();
            if !fired.is_empty() {
                due.push(Grown {
                    pid,
                    resident: fired.iter().any(|(of, _)| *of == Growing::Resident),
                    reason: fired
                        .into_iter()
                        .map(|(_, r)| r)
                        .collect::<Vec<_>>()
                        .join("; "),
                });
            }
        }
        due
    }

    /// Notes a finished snapshot's files (removing the oldest past the
    /// retention bounds) and says what it was announced with.
    pub fn record(&mut self, done: Done, status: &mut dyn Write, progress: bool) -> Result<()> {
        let files = done.files?;
        let retention = self.retention;
        let process = self.of_mut(done.pid);
        if done.account.is_some() {
            process.account = done.account;
        }
        // An account alone (for the endpoints) wrote no file.
        if files.is_empty() {
            return Ok(());
        }
        for (format, path) in &files {
            if *format == Format::Heap {
                process.heaps.push(path.clone());
            }
            process.files.push(path.clone());
        }
        let written = files.iter().map(|(_, p)| p.clone()).collect();
        let removed = process.kept.add(written, retention);
        process.files.retain(|f| !removed.contains(f));
        process.heaps.retain(|f| !removed.contains(f));
        let Some((_, first)) = files.first() else {
            return Ok(());
        };
        let line = match done.announce {
            Announce::Nothing => return Ok(()),
            Announce::Exited => format!(
                "memprobe: process {} exited; wrote its final profile {}",
                done.pid,
                first.display()
            ),
            Announce::Growth(reason) => format!(
                "memprobe: pid {}: {reason}: wrote {}",
                done.pid,
                first.display()
            ),
            Announce::Detached(reason) => format!(
                "memprobe: pid {}: allocators' probes detached, {reason}; wrote its profile {} \
                 (its memory followed to the end)",
                done.pid,
                first.display()
            ),
        };
        if progress {
            let _ = write!(status, "\r\x1b[2K");
        }
        let _ = writeln!(status, "{line}");
        Ok(())
    }
}
