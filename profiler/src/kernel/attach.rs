//! Attaching one allocator copy's entry points: each entry program, and
//! the return half as a uprobe session or a uretprobe, with the sessions
//! fallback found out at the first link; all or nothing per copy.
use std::{collections::HashMap, num::NonZeroU32, path::Path};

use aya::programs::uprobe::UProbeScope;
use profiler_common::{CallShape, cookie};

use crate::{
    binary::placement::Placement,
    discover::{Allocator, entry_points::EntryPoint},
    kernel::error::{KernelError, Result},
    kernel::{AttachedProbe, KernelProbes, LinkFailure, PlacementMode, ProbeLinks, Scope},
    proc::FileId,
};

/// Where one allocator copy's probes go.
pub(super) struct Target<'a> {
    pub(super) scope: Scope,
    pub(super) pid: u32,
    pub(super) uprobe_scope: UProbeScope,
    pub(super) path: &'a str,
    pub(super) open_path: &'a Path,
    /// Which file the kernel probes (what its uprobes are keyed by).
    pub(super) file: Option<FileId>,
    /// Probes attached only in sampling windows.
    pub(super) windowed: bool,
}

impl<'a> Target<'a> {
    pub(super) fn new(scope: Scope, path: &'a str, open_path: &'a Path) -> Result<Self> {
        let (pid, uprobe_scope) = match scope {
            Scope::Process(pid) => (
                pid,
                UProbeScope::OneProcess(NonZeroU32::new(pid).ok_or(KernelError::Process(
                    crate::proc::ProcessError::NoSuchProcess(0),
                ))?),
            ),
            Scope::AllProcesses => (0, UProbeScope::AllProcesses),
        };
        Ok(Self {
            scope,
            pid,
            uprobe_scope,
            path,
            open_path,
            file: std::fs::metadata(open_path)
                .ok()
                .map(|meta| FileId::of(&meta)),
            windowed: false,
        })
    }

    pub(super) fn error(&self, entry_point: &str, cause: LinkFailure) -> KernelError {
        KernelError::Attach {
            pid: self.pid,
            entry_point: entry_point.into(),
            path: self.path.into(),
            cause: Box::new(cause),
            undone: 0,
        }
    }
}

impl KernelProbes {
    /// Attaches to every entry point of one jemalloc copy. `path` is how
    /// the file is named in messages, `open_path` where the kernel finds it.
    /// Returns how many entry points were attached. On failure the probes
    /// of this copy attached so far are detached again: nothing is left
    /// half-probed.
    pub fn attach(
        &mut self,
        scope: Scope,
        path: &str,
        open_path: &Path,
        allocator: &Allocator,
        instance: u16,
    ) -> Result<usize> {
        let target = Target::new(scope, path, open_path)?;
        Ok(self.attach_into(&target, allocator, instance, &[])?.len())
    }

    /// As [`Self::attach`], each entry point into the probe index it held
    /// before (among `slots`, detached since), so that a copy or part of
    /// one attached again and again (a window's entry points, a copy whose
    /// frees are followed for a while) keeps its counters instead of taking
    /// new ones; a new index for an entry point that held none. Returns the
    /// indexes used.
    pub fn attach_again(
        &mut self,
        scope: Scope,
        (path, open_path): (&str, &Path),
        allocator: &Allocator,
        instance: u16,
        slots: &[usize],
    ) -> Result<Vec<usize>> {
        let target = Target::new(scope, path, open_path)?;
        self.attach_into(&target, allocator, instance, slots)
    }

    /// As [`Self::attach_again`], for a sampling window: the calls these
    /// probes see count their bytes 2^`window_shift` times (the copy's
    /// [`FastPathConfig`](profiler_common::FastPathConfig)), and requests
    /// jemalloc's slow path sees anyway are left to it.
    pub fn attach_window(
        &mut self,
        scope: Scope,
        (path, open_path): (&str, &Path),
        allocator: &Allocator,
        instance: u16,
        slots: &[usize],
    ) -> Result<Vec<usize>> {
        let mut target = Target::new(scope, path, open_path)?;
        target.windowed = true;
        self.attach_into(&target, allocator, instance, slots)
    }

    fn attach_into(
        &mut self,
        target: &Target,
        allocator: &Allocator,
        instance: u16,
        slots: &[usize],
    ) -> Result<Vec<usize>> {
        let attached_before = self.attached.len();
        // `--track allocations`, or frees dropped for the budget: frees and
        // resizes are not probed at all.
        let allocations_only = self.allocations_only_in(target.scope);
        let entries = allocator
            .entry_points
            .iter()
            .filter(|e| !allocations_only || e.shape.allocates());
        // Each entry point takes back the index it held among `slots`: an
        // index's hits are always one entry point's (the cost line names
        // and prices them by it), also where the copy comes back in
        // another form (frees followed or not, jemalloc's slow path at its
        // entry or past its size check).
        let mut held: Vec<usize> = slots
            .iter()
            .copied()
            .filter(|&i| i < attached_before)
            .collect();
        let mut used = Vec::new();
        for entry in entries {
            let slot = held
                .iter()
                .position(|&i| {
                    let probe = &self.attached[i];
                    probe.symbol == entry.symbol
                        && probe.shape == entry.shape
                        && probe.file_offset == entry.file_offset
                })
                .map(|at| held.remove(at));
            match self.attach_entry(target, entry, allocator, instance, slot) {
                Ok(index) => used.push(index),
                Err(mut error) => {
                    if let KernelError::Attach { undone, .. } = &mut error {
                        *undone = used.len();
                    }
                    for index in used {
                        let links = std::mem::take(&mut self.links[index]);
                        self.detach_links(links);
                    }
                    self.links.truncate(attached_before);
                    self.attached.truncate(attached_before);
                    return Err(error);
                }
            }
        }
        Ok(used)
    }

    /// How many probes are attached now (the slow path's trial detaches
    /// some and attaches others).
    pub fn attached_now(&self) -> usize {
        self.links.iter().filter(|links| !links.is_empty()).count()
    }

    /// Per process, how many perf events its probes have put on its main
    /// thread, the allocators' and the mapping probes': aya's uprobes and
    /// uretprobes (where the kernel does not filter uprobe_multi links by
    /// process) are perf events bound to the task whose id is the pid,
    /// switched with it at every context switch.
    pub fn task_events(&self) -> HashMap<u32, usize> {
        let mut events = HashMap::new();
        for (probe, links) in self.attached.iter().zip(&self.links) {
            if let (Scope::Process(pid), false) = (probe.scope, links.uprobes.is_empty()) {
                *events.entry(pid).or_default() += links.uprobes.len();
            }
        }
        for (pid, count) in self.mappings.task_events() {
            *events.entry(pid).or_default() += count;
        }
        events
    }

    /// Detaches the probes at these indexes of `attached`.
    pub fn detach_probes(&mut self, indexes: &[usize]) {
        let links = indexes
            .iter()
            .filter_map(|&index| self.links.get_mut(index).map(std::mem::take))
            .collect();
        self.detach_side_by_side(links);
    }

    /// Detaches every probe scoped to `pid` (its other processes' and the
    /// system-wide ones stay); returns how many entry points were detached.
    pub fn detach_process(&mut self, pid: u32) -> usize {
        let links: Vec<ProbeLinks> = (0..self.attached.len())
            .filter(|&index| self.attached[index].scope == Scope::Process(pid))
            .map(|index| std::mem::take(&mut self.links[index]))
            .filter(|links| !links.is_empty())
            .collect();
        let detached = links.len();
        self.detach_side_by_side(links);
        detached
    }

    /// Attaches one entry point: its entry program, and its return half as
    /// a session or a uretprobe; all or nothing.
    fn attach_entry(
        &mut self,
        target: &Target,
        entry: &EntryPoint,
        allocator: &Allocator,
        instance: u16,
        slot: Option<usize>,
    ) -> Result<usize> {
        let index = slot.unwrap_or(self.attached.len());
        let probe_index = u32::try_from(index)
            .ok()
            .filter(|&i| i < cookie::MAX_PROBES)
            .ok_or(KernelError::TooManyCopies)?;
        let placement = match self.placement {
            PlacementMode::Emulated => entry.placement.clone(),
            PlacementMode::Entry => Placement::entry("--placement entry"),
        };
        // After `pushes` pushes the return address is at [rsp + 8 * pushes].
        let cookie = cookie::encode(probe_index, placement.pushes * 8, instance, entry.forwards);
        let cookie = if target.windowed {
            cookie::windowed(cookie)
        } else {
            cookie
        };
        let offset = entry.file_offset + placement.offset;
        let (links, return_half) = self
            .link_entry(target, entry, offset, cookie)
            .map_err(|cause| target.error(&entry.symbol, cause))?;
        let probe = AttachedProbe {
            scope: target.scope,
            symbol: entry.symbol.clone(),
            path: target.path.to_owned(),
            file: target.file,
            file_offset: entry.file_offset,
            placement,
            return_half,
            instance,
            allocator: allocator.kind,
            shape: entry.shape,
            windowed: target.windowed,
            own_code: match entry.shape {
                CallShape::SlowPath | CallShape::LargeRequest => {
                    allocator.fast_path.as_ref().map(|s| s.own_code.clone())
                }
                CallShape::OwnSample => allocator.own_sampling.as_ref().map(|o| o.own_code.clone()),
                _ => None,
            },
        };
        if index < self.attached.len() {
            self.links[index] = links;
            self.attached[index] = probe;
        } else {
            self.links.push(links);
            self.attached.push(probe);
        }
        Ok(index)
    }
}
