//! Attaching: the allocator copies of each process, found at the start,
//! in libraries loaded later and, with `--all`, in processes started later.
pub(in crate::run) mod allocator_calls;
pub(in crate::run) mod checked;
mod found;
pub(in crate::run) mod launch;
pub(in crate::run) mod looks;
mod verbose;

use std::{path::Path, time::Instant};

use crate::{
    discover::{Allocator, AllocatorKind, Found},
    error::Result,
    kernel::KernelError,
    kernel::Scope,
    proc::{all_pids, parse_maps, read_maps},
    run::{
        Sampling, Session,
        frees_on_request::UsualCopy,
        notice::{SamplingNotice, TargetNotice},
        process::Tracked,
        sampling::windows::WindowedCopy,
        waits::watch_exit,
    },
};

impl Session<'_> {
    pub(in crate::run) fn instance(&mut self) -> Result<u16> {
        let instance = self.next_instance;
        self.next_instance = instance.checked_add(1).ok_or(KernelError::TooManyCopies)?;
        Ok(instance)
    }

    /// Starts keeping a profile for `pid`.
    pub(in crate::run) fn track(&mut self, pid: u32, maps: String) {
        if self.tracked.contains_key(&pid) {
            return;
        }
        let tracked = Tracked::new(
            pid,
            maps,
            self.options.sample_interval,
            self.options.collector.clone(),
        );
        self.tracked.insert(pid, tracked);
        self.watch_python(pid);
        if self.scope.watches_exits() {
            watch_exit(pid, self.exits.clone());
        }
        if self.scope.watches_mapped_code()
            && let Some(t) = self.tracked.get(&pid)
        {
            self.probes.watch_mappings(pid, t.mappings());
        }
    }

    /// Attaches pid-scoped probes to each found copy not yet probed.
    pub(in crate::run) fn attach_found(&mut self, pid: u32, found: Vec<Found>) -> Result<usize> {
        // Its allocators' probes were detached over budget: one it loads
        // since would cost it the same.
        if self.budget.detached(pid).is_some() {
            return Ok(0);
        }
        let mut attached = 0;
        for f in found {
            let known = self
                .tracked
                .get(&pid)
                .is_some_and(|t| t.attached_files.contains(&f.key()));
            if known {
                continue;
            }
            let result = self.attach_file(Scope::Process(pid), &f.path, &f.open_path, &f.allocator);
            // Tried once: a copy that failed is not retried at every rescan.
            if let Some(t) = self.tracked.get_mut(&pid) {
                t.attached_files.insert(f.key());
            }
            attached += self.survive_late_failure(result)?;
        }
        Ok(attached)
    }

    /// Before the run is announced a failed attach ends it (nothing stays
    /// attached); after, a copy found later (`dlopen`, a new process with
    /// `--all`) that cannot be probed is reported and the run goes on.
    fn survive_late_failure(&mut self, result: Result<usize>) -> Result<usize> {
        match result {
            Err(e) if self.announced => {
                self.say(TargetNotice::LateAttachFailed {
                    error: crate::error::chain(&e),
                });
                Ok(0)
            }
            result => result,
        }
    }

    /// Attaches to one allocator copy and, with `--verbose`, lists its
    /// probes. A failed attach leaves none of the copy's probes behind.
    pub(in crate::run) fn attach_file(
        &mut self,
        scope: Scope,
        path: &str,
        open_path: &Path,
        allocator: &Allocator,
    ) -> Result<usize> {
        let instance = self.instance()?;
        let file = (path, open_path);
        if let Some(attached) = self.attach_own_sampling(scope, file, allocator, instance)? {
            return Ok(attached);
        }
        self.attach_usual(scope, file, allocator, instance)
    }

    /// Attaches to one allocator copy through memprobe's own sampling: in
    /// windows, with jemalloc's slow path for large requests, where it can;
    /// else at entry.
    pub(in crate::run) fn attach_usual(
        &mut self,
        scope: Scope,
        (path, open_path): (&str, &Path),
        allocator: &Allocator,
        instance: u16,
    ) -> Result<usize> {
        let windowed = self.windowed_parts(scope, path, allocator, instance);
        let on_slow_path = windowed
            .as_ref()
            .ok()
            .and_then(|parts| allocator.on_slow_path(parts.large_requests));
        let probed = on_slow_path.as_ref().unwrap_or(allocator);
        let before = self.probes.attached.len();
        let attached = self
            .probes
            .attach(scope, path, open_path, probed, instance)?;
        self.print_verbose_probes(before);
        self.print_verbose_wrappers(path, allocator);
        self.say_found_by_code(scope, path, allocator);
        let slots: Vec<usize> = (before..self.probes.attached.len()).collect();
        let file = (path, open_path);
        self.watch(scope, file, allocator, (instance, slots.clone()), None);
        let Scope::Process(pid) = scope else {
            return Ok(attached);
        };
        let copy = UsualCopy::new(
            file,
            on_slow_path.as_ref().unwrap_or(allocator),
            instance,
            slots,
        );
        self.frees_on_request.record(pid, copy);
        match windowed {
            Ok(parts) => {
                let copy = WindowedCopy::new(path, open_path, instance, parts.served, parts.config);
                self.start_windows(pid, copy);
            }
            Err(reason) if allocator.kind == AllocatorKind::Jemalloc => {
                let note = format!("{path}: at entry ({reason})");
                if self.tracked.contains_key(&pid) {
                    self.sampling.of_mut(pid).notes.push(note.clone());
                }
                self.say(SamplingNotice::Sampling { pid, note });
            }
            Err(_) => {}
        }
        Ok(attached)
    }

    /// `--all`: a profile for every process that maps jemalloc. Sampled in
    /// windows (the default), each process is probed on its own, as with
    /// `--pid`: its windows open in it alone, a window's traps slow no
    /// other process, and a process started since the last scan is probed
    /// at the next. With `--sampling entry`, system-wide probes on every
    /// jemalloc file in use.
    pub(in crate::run) fn scan_all(&mut self) -> Result<()> {
        let own = std::process::id();
        let pids = all_pids();
        let now = Instant::now();
        self.looks.keep_only(&pids);
        for pid in pids.into_iter().filter(|&p| p != own) {
            let Some(stamp) = self.looks.changed(pid, now) else {
                continue;
            };
            let Ok(maps) = read_maps(pid) else {
                continue;
            };
            let found = self.cache.find(pid, &parse_maps(&maps));
            if found.is_empty() {
                self.looks.looked(pid, stamp, now);
                continue;
            }
            if self.options.sampling == Sampling::Windows {
                match self.tracked.get_mut(&pid) {
                    Some(t) => t.set_maps(Some(maps)),
                    None => self.track(pid, maps),
                }
                let attached = self.attach_found(pid, found);
                // A process that exited while it was being probed (a
                // compiler, a short script) is no failure of the run's.
                if attached.is_err() && read_maps(pid).is_err() {
                    continue;
                }
                // One that could not be probed is looked at again.
                if attached.is_ok() {
                    self.looks.looked(pid, stamp, now);
                }
                self.survive_late_failure(attached)?;
                continue;
            }
            self.looks.looked(pid, stamp, now);
            for f in &found {
                if self.system_wide.insert(f.key()) {
                    let result =
                        self.attach_file(Scope::AllProcesses, &f.path, &f.open_path, &f.allocator);
                    self.survive_late_failure(result)?;
                }
            }
            match self.tracked.get_mut(&pid) {
                Some(t) => t.set_maps(Some(maps)),
                None => {
                    self.track(pid, maps);
                    if let Some(t) = self.tracked.get_mut(&pid) {
                        t.attached_files.extend(found.iter().map(Found::key));
                    }
                }
            }
        }
        Ok(())
    }

    /// Picks up libraries loaded since the last look (`dlopen`) and, with
    /// `--all`, new processes; keeps each process's maps fresh.
    pub(in crate::run) fn rescan(&mut self) -> Result<()> {
        if self.scope.finds_processes() {
            return self.scan_all();
        }
        for pid in self.live_pids() {
            self.rescan_pid(pid, None)?;
        }
        Ok(())
    }

    /// The kernel told that `pid` mapped code at `mapped_at` (ns, the
    /// monotonic clock): its new allocator copies are probed now.
    pub(in crate::run) fn probe_mapped_code(&mut self, pid: u32, mapped_at: u64) {
        if self.tracked.get(&pid).is_none_or(|t| t.exited) {
            return;
        }
        if let Err(e) = self.rescan_pid(pid, Some(mapped_at)) {
            self.say(TargetNotice::RescanFailed {
                error: crate::error::chain(&e),
            });
        }
    }

    /// Probes the allocator copies `pid` mapped since the last look and
    /// keeps its maps fresh; says how long after their mapping when the
    /// kernel told of it.
    fn rescan_pid(&mut self, pid: u32, mapped_at: Option<u64>) -> Result<()> {
        // The process may be gone; keep the last good copy of its maps.
        let Ok(maps) = read_maps(pid) else {
            return Ok(());
        };
        let mappings = parse_maps(&maps);
        let found = self.cache.find(pid, &mappings);
        self.say_unprobed(pid, &mappings);
        if let Some(t) = self.tracked.get_mut(&pid) {
            t.set_maps(Some(maps));
            if self.scope.watches_mapped_code() && !t.exited {
                self.probes.watch_mappings(pid, &mappings);
            }
            if !t.exited {
                self.watch_python(pid);
            }
        }
        let new: Vec<Found> = found
            .into_iter()
            .filter(|f| {
                self.tracked
                    .get(&pid)
                    .is_some_and(|t| !t.attached_files.contains(&f.key()))
            })
            .collect();
        let copies: Vec<String> = new
            .iter()
            .map(|f| format!("{} in {}", f.allocator.kind, f.path))
            .collect();
        let attached = self.attach_found(pid, new)?;
        if attached > 0 {
            self.say(TargetNotice::Loaded {
                pid,
                copies,
                probes: attached,
                after_ms: mapped_at
                    .map(|at| crate::clock::monotonic_ns().saturating_sub(at) / 1_000_000),
            });
        }
        Ok(())
    }
}
