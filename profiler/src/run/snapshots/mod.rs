//! Snapshots: a process's profile taken on the loop (owned data, quickly)
//! and handed to the writer thread, when the process exits, on a timer, on
//! SIGUSR1 and on growth; what the writer finished is recorded here.
pub(in crate::run) mod growth;
pub mod retention;
pub(in crate::run) mod writer;

use std::{collections::BTreeMap, io::Write, time::Instant};

use crate::{
    error::Result,
    output::Format,
    run::{
        Session,
        process::Tracked,
        snapshots::{
            retention::Retention,
            writer::{Announce, Done, Job},
        },
        targets::allocator_calls::describe,
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

impl Session<'_> {
    pub(in crate::run) fn process_exited(&mut self, pid: u32) -> Result<()> {
        let Some(t) = self.tracked.get_mut(&pid) else {
            return Ok(());
        };
        if t.exited {
            return Ok(());
        }
        t.exited = true;
        // Its pid may come back as another program.
        t.stacks.reset_trust();
        self.probes.trust_frame_pointers(pid, false);
        self.probes.watch_mapped_code(pid, false);
        self.snapshot(pid, "process exited", SnapshotKind::Last, Announce::Exited);
        Ok(())
    }

    /// A snapshot of every live process, for `reason`.
    pub(in crate::run) fn snapshot_all(&mut self, reason: &str, kind: SnapshotKind) {
        for pid in self.live_pids() {
            self.snapshot(pid, reason, kind, Announce::Nothing);
        }
    }

    /// `--dump-on-growth`: a snapshot of each process whose estimated
    /// in-use bytes grew by the trigger's size within its window.
    pub(in crate::run) fn check_growth(&mut self) {
        let Some(trigger) = self.options.dump_on_growth else {
            return;
        };
        let now = Instant::now();
        let min_gap = self.options.min_dump_gap;
        let due: Vec<(u32, String)> = self
            .tracked
            .values_mut()
            .filter(|t| !t.exited)
            .filter_map(|t| {
                let inuse = t.heap.inuse_bytes();
                Some((t.pid, t.growth.observe(now, inuse, trigger, min_gap)?))
            })
            .collect();
        for (pid, reason) in due {
            let announce = Announce::Growth(reason.clone());
            self.snapshot(pid, &reason, SnapshotKind::Requested, announce);
        }
    }

    /// Takes `pid`'s profile now and hands it to the writer.
    pub(in crate::run) fn snapshot(
        &mut self,
        pid: u32,
        reason: &str,
        kind: SnapshotKind,
        announce: Announce,
    ) {
        if kind == SnapshotKind::Periodic && self.writer.busy_with(pid) {
            if let Some(t) = self.tracked.get_mut(&pid) {
                t.skipped_snapshots += 1;
            }
            return;
        }
        self.close_open_window(pid);
        let allocator_calls = self.allocator_calls(pid, &self.probes.probe_hits());
        let Some(t) = self.tracked.get_mut(&pid) else {
            return;
        };
        let mut profile = t.heap.snapshot(t.maps.clone());
        t.allocator_calls = allocator_calls;
        let mut head = vec![
            ("command".to_owned(), t.command.clone()),
            ("reason".to_owned(), reason.to_owned()),
            ("snapshot".to_owned(), t.snapshots.to_string()),
            (
                "elapsed_s".to_owned(),
                format!("{:.3}", self.started.elapsed().as_secs_f64()),
            ),
        ];
        if let Some(inner) = t.container_pid {
            head.push(("container_pid".into(), inner.to_string()));
        }
        head.push(("allocators".into(), describe(&t.allocator_calls)));
        if !t.found_notes.is_empty() {
            head.push(("allocator".into(), t.found_notes.join("; ")));
        }
        let windowed = t
            .windows
            .iter()
            .flat_map(|w| w.notes(&self.options.windows));
        let notes: Vec<String> = windowed.chain(t.sampling_notes.iter().cloned()).collect();
        if !notes.is_empty() {
            head.push(("malloc_sampling".into(), notes.join("; ")));
        }
        if self.options.collector.allocations_only {
            head.push((
                "tracking".into(),
                "allocations only (--track allocations): in use = allocated".into(),
            ));
        } else if let Some(dropped) = self.budget.frees_dropped(pid) {
            head.push(("tracking".into(), dropped.note()));
        }
        if t.skipped_snapshots > 0 {
            head.push(("skipped_snapshots".into(), t.skipped_snapshots.to_string()));
        }
        profile.notes.splice(0..0, head);
        t.snapshots += 1;
        let symbolized = self.options.formats.iter().any(|f| *f != Format::Heap);
        let is_jvm = t.maps.contains("/libjvm.so");
        let ask_jvm = symbolized && is_jvm && !t.exited && self.options.java_perfmap;
        let job = Job {
            pid,
            seq: self.output.next_seq(pid),
            profile,
            formats: self.options.formats.clone(),
            jvm_perfmap: ask_jvm.then(|| t.container_pid.unwrap_or(pid)),
            last: kind == SnapshotKind::Last,
            announce,
        };
        self.writer.submit(job);
    }

    /// Records the snapshots the writer finished since the last look.
    pub(in crate::run) fn record_written(&mut self) -> Result<()> {
        let options = (self.options.progress, self.options.retention);
        for done in self.writer.finished() {
            record(done, &mut self.tracked, self.status, options)?;
        }
        Ok(())
    }
}

/// Notes a finished snapshot's files in its process's state and says what
/// it was announced with.
pub(in crate::run) fn record(
    done: Done,
    tracked: &mut BTreeMap<u32, Tracked>,
    status: &mut dyn Write,
    options: (bool, Retention),
) -> Result<()> {
    let (progress, retention) = options;
    let files = done.files?;
    let Some(t) = tracked.get_mut(&done.pid) else {
        return Ok(());
    };
    for (format, path) in &files {
        if *format == Format::Heap {
            t.heaps.push(path.clone());
        }
        t.files.push(path.clone());
    }
    let removed = t
        .kept
        .add(files.iter().map(|(_, p)| p.clone()).collect(), retention);
    t.files.retain(|f| !removed.contains(f));
    t.heaps.retain(|f| !removed.contains(f));
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
            "memprobe: pid {}: detached, {reason}; wrote its profile {}",
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
