//! Taking a snapshot: the process's profile copied on the loop with the
//! notes that say how it was taken, and handed to the writer.
use std::time::Instant;

use crate::{
    error::Result,
    output::Format,
    run::{
        Session,
        snapshots::{
            SnapshotKind,
            writer::{Announce, Job},
        },
        targets::allocator_calls::describe,
    },
};

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
        let inuse: Vec<(u32, f64)> = self
            .tracked
            .values()
            .filter(|t| !t.exited)
            .map(|t| (t.pid, t.heap.inuse_bytes()))
            .collect();
        for (pid, reason) in self.snapshots.grown(Instant::now(), inuse) {
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
        if kind == SnapshotKind::Periodic && self.snapshots.writer.busy_with(pid) {
            self.snapshots.of_mut(pid).skipped += 1;
            return;
        }
        self.close_open_window(pid);
        let allocator_calls = self.allocator_calls(pid, &self.probes.probe_hits());
        let Some(t) = self.tracked.get_mut(&pid) else {
            return;
        };
        t.allocator_calls = allocator_calls;
        let Some(head) = self.profile_head(pid, reason) else {
            return;
        };
        let Some(t) = self.tracked.get(&pid) else {
            return;
        };
        let mut profile = t.heap.snapshot(t.maps.clone());
        profile.notes.splice(0..0, head);
        self.snapshots.of_mut(pid).taken += 1;
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
        self.snapshots.writer.submit(job);
    }

    /// The notes at the head of `pid`'s next profile: what it is, why it
    /// was taken, and how its allocations were found, sampled and tracked.
    fn profile_head(&self, pid: u32, reason: &str) -> Option<Vec<(String, String)>> {
        let t = self.tracked.get(&pid)?;
        let (taken, skipped) = self
            .snapshots
            .of(pid)
            .map_or((0, 0), |s| (s.taken, s.skipped));
        let mut head = vec![
            ("command".to_owned(), t.command.clone()),
            ("reason".to_owned(), reason.to_owned()),
            ("snapshot".to_owned(), taken.to_string()),
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
        if skipped > 0 {
            head.push(("skipped_snapshots".into(), skipped.to_string()));
        }
        Some(head)
    }

    /// Records the snapshots the writer finished since the last look.
    pub(in crate::run) fn record_written(&mut self) -> Result<()> {
        for done in self.snapshots.writer.finished() {
            self.snapshots
                .record(done, self.status, self.options.progress)?;
        }
        Ok(())
    }
}
