//! Attaching: the allocator copies of each process, found at the start,
//! in libraries loaded later and, with `--all`, in processes started later.
pub(in crate::run) mod allocator_calls;
pub(in crate::run) mod checked;
mod found;
pub(in crate::run) mod launch;

use std::path::Path;

use crate::{
    discover::{
        Allocator, AllocatorKind, Found,
        fast_path::{SlowPath, TlsOffset},
    },
    error::{Error, Result},
    kernel::{ReturnHalf, Scope},
    proc::{all_pids, parse_maps, read_maps},
    run::{
        Sampling, Session, process::Tracked, sampling::windows::WindowedCopy, waits::watch_exit,
    },
};

impl Session<'_> {
    pub(in crate::run) fn instance(&mut self) -> Result<u16> {
        let instance = self.next_instance;
        self.next_instance = instance.checked_add(1).ok_or(Error::TooManyCopies)?;
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
        if self.scope.watches_exits() {
            watch_exit(pid, self.exits.clone());
        }
        if self.scope.watches_mapped_code() {
            self.probes.watch_mapped_code(pid, true);
        }
    }

    /// Attaches pid-scoped probes to each found copy not yet probed.
    pub(in crate::run) fn attach_found(&mut self, pid: u32, found: Vec<Found>) -> Result<usize> {
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
                self.clear_progress();
                let _ = writeln!(
                    self.status,
                    "memprobe: warning: {}; profiling goes on without it",
                    crate::error::chain(&e)
                );
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
            .and_then(|_| allocator.on_slow_path());
        let probed = on_slow_path.as_ref().unwrap_or(allocator);
        let before = self.probes.attached.len();
        let attached = self
            .probes
            .attach(scope, path, open_path, probed, instance)?;
        self.print_verbose_probes(before);
        self.print_verbose_wrappers(path, allocator);
        self.say_found_by_code(scope, path, allocator);
        let slots = (before..self.probes.attached.len()).collect();
        let file = (path, open_path);
        self.watch(scope, file, allocator, (instance, slots), None);
        let Scope::Process(pid) = scope else {
            return Ok(attached);
        };
        match windowed {
            Ok(parts) => {
                let copy = WindowedCopy::new(path, open_path, instance, parts.served, parts.config);
                self.start_windows(pid, copy);
            }
            Err(reason) if allocator.kind == AllocatorKind::Jemalloc => {
                let note = format!("{path}: at entry ({reason})");
                if self.options.verbose {
                    let _ = writeln!(self.status, "memprobe: pid {pid}: {note}");
                }
                if let Some(t) = self.tracked.get_mut(&pid) {
                    t.sampling_notes.push(note);
                }
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
        for pid in all_pids().into_iter().filter(|&p| p != own) {
            let Ok(maps) = read_maps(pid) else {
                continue;
            };
            let found = self.cache.find(pid, &parse_maps(&maps));
            if found.is_empty() {
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
                self.survive_late_failure(attached)?;
                continue;
            }
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
            self.clear_progress();
            let _ = writeln!(
                self.status,
                "memprobe: warning: {}",
                crate::error::chain(&e)
            );
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
        }
        let new: Vec<Found> = found
            .into_iter()
            .filter(|f| {
                self.tracked
                    .get(&pid)
                    .is_some_and(|t| !t.attached_files.contains(&f.key()))
            })
            .collect();
        let paths: Vec<String> = new
            .iter()
            .map(|f| format!("{} in {}", f.allocator.kind, f.path))
            .collect();
        let attached = self.attach_found(pid, new)?;
        if attached > 0 {
            let after = mapped_at
                .map(|at| {
                    format!(
                        ", {} ms after it was mapped",
                        monotonic_ns().saturating_sub(at) / 1_000_000
                    )
                })
                .unwrap_or_default();
            self.clear_progress();
            let _ = writeln!(
                self.status,
                "memprobe: pid {pid} loaded {}: attached {attached} probes{after}",
                paths.join(", ")
            );
        }
        Ok(())
    }

    fn print_verbose_wrappers(&mut self, path: &str, allocator: &Allocator) {
        if !self.options.verbose {
            return;
        }
        if allocator.kind == AllocatorKind::Jemalloc {
            let _ = writeln!(
                self.status,
                "memprobe: {path}: {}",
                describe_fast_path(allocator.fast_path.as_ref())
            );
        }
        for (wrapper, inner) in &allocator.wrappers {
            let _ = writeln!(
                self.status,
                "memprobe: {path}: {wrapper} not probed: every call passes to {inner}"
            );
        }
    }

    pub(in crate::run) fn print_verbose_probes(&mut self, from: usize) {
        if !self.options.verbose {
            return;
        }
        if from == 0
            && let Some(reason) = &self.probes.sessions_unavailable
        {
            let _ = writeln!(
                self.status,
                "memprobe: return probes: uretprobes ({reason}): every allocation call also \
                 traps at its return"
            );
        }
        if from == 0
            && let Some(reason) = &self.probes.mapped_code_unavailable
        {
            let _ = writeln!(
                self.status,
                "memprobe: libraries loaded later are found by rescans, within a second (the \
                 kernel cannot tell of newly mapped code: {})",
                crate::error::chain(reason)
            );
        }
        for p in &self.probes.attached[from..] {
            let scope = match p.scope {
                Scope::Process(pid) => format!("pid {pid}"),
                Scope::AllProcesses => "all processes".to_owned(),
            };
            let halves = match p.return_half {
                ReturnHalf::None => "entry",
                ReturnHalf::Uretprobe => "entry and return",
                ReturnHalf::Session => "entry and return, as a session",
            };
            let place = match &p.placement.fallback {
                None => format!("+{:#x} `{}`", p.placement.offset, p.placement.instruction),
                Some(reason) => format!(" at the first instruction: {reason}"),
            };
            let _ = writeln!(
                self.status,
                "memprobe: {scope}: {} at {}+{:#x}{place} ({halves})",
                p.symbol, p.path, p.file_offset,
            );
        }
    }
}

/// `--verbose`'s words on jemalloc's fast path.
fn describe_fast_path(fast: Option<&SlowPath>) -> String {
    let Some(SlowPath { fast, .. }) = fast else {
        return "jemalloc's malloc fast path not recognised".into();
    };
    let tls = match fast.tls {
        TlsOffset::GotSlot(slot) => {
            format!("the TLS offset in the GOT slot at file offset {slot:#x}")
        }
        TlsOffset::Immediate(offset) => format!("TLS at fs{}", signed_hex(offset)),
    };
    format!(
        "jemalloc 5.3 malloc fast path recognised: above {} bytes and at a thread's \
         threshold it leaves for the slow path at file offset {:#x}; thread counters at TLS \
         {} and {}, {tls}",
        fast.large_above,
        fast.slow_path,
        signed_hex(fast.allocated),
        signed_hex(fast.allocated + 8)
    )
}

/// `+0x338`, `-0xa98`.
fn signed_hex(value: i64) -> String {
    let sign = if value < 0 { '-' } else { '+' };
    format!("{sign}{:#x}", value.unsigned_abs())
}

impl Session<'_> {
    /// `--sampling windows`: this jemalloc copy's parts for sampling in
    /// windows (see `run::sampling::windows`), with the kernel told where `pid`'s
    /// threads keep their counters; or why it is sampled at entry (other
    /// allocators, unrecognised builds, system-wide probes, a process not
    /// started yet).
    fn windowed_parts(
        &mut self,
        scope: Scope,
        path: &str,
        allocator: &Allocator,
        instance: u16,
    ) -> Result<WindowedParts, &'static str> {
        let Scope::Process(pid) = scope else {
            return Err("system-wide probes");
        };
        if self.options.sampling == Sampling::Entry {
            return Err("--sampling entry");
        }
        if !crate::kernel::KernelProbes::knows_fsbase() {
            return Err("the kernel's BTF does not place a task's fs base");
        }
        let not_recognised = "its malloc fast path is not a jemalloc 5.3 build memprobe recognises";
        let served = allocator.windowed_part().ok_or(not_recognised)?;
        let fast = allocator.fast_path.as_ref().ok_or(not_recognised)?.fast;
        let tls = match fast.tls {
            TlsOffset::Immediate(offset) => offset,
            TlsOffset::GotSlot(file_offset) => {
                let unread = "its TLS offset is not in its GOT yet: a process not started";
                let maps = &self.tracked.get(&pid).ok_or(unread)?.maps;
                read_mapped_word(pid, maps, path, file_offset).ok_or(unread)? as i64
            }
        };
        let config = profiler_common::FastPathConfig {
            allocated: tls.wrapping_add(fast.allocated),
            large_above: fast.large_above,
            window_shift: 0,
            window: 0,
        };
        if !self.probes.set_fast_path(pid, instance, config) {
            return Err("the kernel's table of fast paths is full");
        }
        Ok(WindowedParts { served, config })
    }
}

/// A jemalloc copy split for sampling in windows: the entry points the
/// windows attach (`malloc`, `operator new`), and its counters as the
/// kernel was told them.
struct WindowedParts {
    served: Allocator,
    config: profiler_common::FastPathConfig,
}

/// The word at `file_offset` of `path` as `pid` has it mapped (a GOT slot
/// the dynamic linker filled), read from `/proc/PID/mem`: read, never
/// written.
fn read_mapped_word(pid: u32, maps: &str, path: &str, file_offset: u64) -> Option<u64> {
    let address = crate::proc::mapped_address(maps, path, file_offset, 8)?;
    let mut word = [0u8; 8];
    crate::proc::ProcessMemory::open(pid)?.read(address, &mut word)?;
    Some(u64::from_le_bytes(word))
}

/// CLOCK_MONOTONIC in ns, the kernel programs' `bpf_ktime_get_ns`.
fn monotonic_ns() -> u64 {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid timespec to fill.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut now) };
    now.tv_sec as u64 * 1_000_000_000 + now.tv_nsec as u64
}
