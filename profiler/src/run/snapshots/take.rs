//! Taking a snapshot: the process's profile copied on the loop with the
//! notes that say how it was taken, and handed to the writer.
use std::time::Instant;

use crate::{
    error::Result,
    output::Format,
    profile::{HeapProfile, ProfileNotes},
    run::{
        Session,
        actions::Action,
        snapshots::{
            SnapshotKind,
            growth::Reading,
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
        // Its last switches, which /proc no longer counts.
        (self.costs.ledger).process_ended(pid, std::time::Instant::now());
        // Its pid may come back as another program.
        t.stacks.reset_trust();
        self.probes.trust_frame_pointers(pid, false);
        self.probes.unwatch_mappings(pid);
        self.probes.forget_fast_paths(pid);
        self.probes.forget_exit_counters(pid);
        self.probes.forget_python(pid);
        self.probes.follow_frees(pid, false);
        self.snapshot(pid, "process exited", SnapshotKind::Last, Announce::Exited);
        self.frees_on_request.forget(pid);
        Ok(())
    }

    /// A snapshot of every live process, for `reason`.
    pub(in crate::run) fn snapshot_all(&mut self, reason: &str, kind: SnapshotKind) {
        for pid in self.live_pids() {
            self.snapshot(pid, reason, kind, Announce::Nothing);
        }
    }

    /// `--dump-on-growth`'s answer each tick: a snapshot of each process
    /// whose estimated in-use bytes (or resident memory) grew by the
    /// trigger's size within its window.
    pub(in crate::run) fn growth_actions(&mut self) -> Vec<Action> {
        let resident = self.snapshots.watches_resident();
        let readings: Vec<(u32, Reading)> = self
            .tracked
            .values()
            .filter(|t| !t.exited)
            .map(|t| {
                let reading = Reading {
                    heap: t.heap.inuse_bytes(),
                    resident: resident
                        .then(|| crate::proc::resident_bytes(t.pid))
                        .flatten()
                        .map(|b| b as f64),
                };
                (t.pid, reading)
            })
            .collect();
        let grown = self.snapshots.grown(Instant::now(), readings);
        // Under --track allocations, resident growth has the process's
        // frees followed for a while: what grows shows in the delta.
        for g in grown.iter().filter(|g| g.resident) {
            self.follow_on_growth(g.pid, &g.reason);
        }
        grown
            .into_iter()
            .map(|g| Action::Snapshot {
                pid: g.pid,
                announce: Announce::Growth(g.reason.clone()),
                reason: g.reason,
            })
            .collect()
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
        self.snapshot_as(pid, reason, kind, announce, |profile| profile);
    }

    /// Takes `pid`'s profile now, made into what `shape` gives (a delta),
    /// and hands it to the writer.
    pub(in crate::run) fn snapshot_as(
        &mut self,
        pid: u32,
        reason: &str,
        kind: SnapshotKind,
        announce: Announce,
        shape: impl FnOnce(HeapProfile) -> HeapProfile,
    ) {
        self.close_open_window(pid);
        let allocator_calls = self.allocator_calls(pid, &self.probes.probe_hits());
        let Some(t) = self.tracked.get_mut(&pid) else {
            return;
        };
        t.allocator_calls = allocator_calls;
        let mut profile = shape(t.profile());
        self.note_the_run(pid, reason, &mut profile.notes);
        profile.memory = self.read_memory(pid);
        let Some(t) = self.tracked.get(&pid) else {
            return;
        };
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

    /// `notes` with what `pid`'s profile says of the run: what it is, why
    /// it was taken, and how its allocations were found, sampled and
    /// tracked.
    fn note_the_run(&self, pid: u32, reason: &str, notes: &mut ProfileNotes) {
        let Some(t) = self.tracked.get(&pid) else {
            return;
        };
        let (taken, skipped) = self
            .snapshots
            .of(pid)
            .map_or((0, 0), |s| (s.taken, s.skipped));
        notes.command = Some(t.command.clone());
        notes.reason = Some(reason.to_owned());
        notes.snapshot = Some(taken);
        notes.elapsed_s = Some(self.started.elapsed().as_secs_f64());
        notes.container_pid = t.container_pid;
        notes.allocators = Some(describe(&t.allocator_calls));
        notes.allocator = (!t.found_notes.is_empty()).then(|| t.found_notes.join("; "));
        let sampling: Vec<String> = self.sampling.of(pid).map_or(Vec::new(), |s| {
            let windowed = s
                .windows
                .iter()
                .flat_map(|w| w.notes(&self.options.windows));
            windowed.chain(s.notes.iter().cloned()).collect()
        });
        notes.malloc_sampling = (!sampling.is_empty()).then(|| sampling.join("; "));
        let on_request =
            (self.options.collector.allocations_only).then(|| self.frees_on_request.note(pid));
        let steps = self.budget.tracking_note(pid);
        notes.tracking = match (on_request, steps) {
            (Some(on_request), Some(steps)) => Some(format!("{on_request}; {steps}")),
            (on_request, steps) => on_request.or(steps),
        };
        notes.skipped_snapshots = (skipped > 0).then_some(skipped);
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
