//! One profiling run: find the targets, attach, collect until told to stop,
//! write, detach. Rescans once a second for libraries loaded later and, with
//! `--all`, for processes started later.
pub mod cost;
pub mod launch;
use std::{
    collections::{BTreeMap, HashSet},
    ffi::OsString,
    io::Write,
    os::fd::{FromRawFd, OwnedFd},
    path::{Path, PathBuf},
    process::ExitStatus,
    time::{Duration, Instant},
};

use aya::maps::{MapData, RingBuf};
use profiler_common::Counter;
use tokio::{
    io::{Interest, unix::AsyncFd},
    signal::unix::{SignalKind, signal},
    sync::{mpsc, oneshot},
};

use crate::{
    collect::{CollectorOptions, Drops, ProcessHeap},
    discover::{Allocator, AllocatorCache, Found, allocator_in_file},
    error::{Error, Result},
    kernel::events::{Event, decode},
    kernel::features,
    kernel::{KernelOptions, KernelProbes, ReturnHalf, Scope},
    output::{Format, files::OutputDir, flamegraph, folded, heap_v2, pprof, symbolized},
    proc::{FileId, Mapping, all_pids, command_name, namespace_pid, parse_maps, read_maps},
    profile::HeapProfile,
    run::cost::{CostModel, ProbeCost, rates},
    stacks::unwind::{self, ProcessUnwinder, UnwindEnd},
    symbolize::Namer,
};

/// Which processes to profile.
#[derive(Clone, Debug)]
pub enum Targets {
    /// These running processes.
    Pids(Vec<u32>),
    /// Every process that maps jemalloc, now and started during the run,
    /// through system-wide probes.
    All,
    /// Start this command with the probes in place; exit with its code.
    Launch(Vec<OsString>),
}

/// Everything a run needs to know.
#[derive(Clone, Debug)]
pub struct SessionOptions {
    pub targets: Targets,
    /// Stop after this long; `None` runs until Ctrl-C, SIGTERM or the
    /// processes exit.
    pub duration: Option<Duration>,
    /// Default: the current directory.
    pub output_dir: PathBuf,
    pub kernel: KernelOptions,
    pub collector: CollectorOptions,
    /// Say what was attached where.
    pub verbose: bool,
    /// Redraw a status line once a second (on a terminal).
    pub progress: bool,
    /// How often to look for newly loaded libraries and new processes.
    /// Default: one second.
    pub rescan_interval: Duration,
    /// Write a full snapshot of every process this often. Default: none.
    pub snapshot_interval: Option<Duration>,
    /// Write a snapshot when a process's estimated in-use heap grew this much.
    pub dump_on_growth: Option<GrowthTrigger>,
    /// Least time between two growth-triggered snapshots of one process.
    /// Default: 10 s.
    pub min_dump_gap: Duration,
    /// The files each snapshot is written as. Default: all formats.
    pub formats: Vec<Format>,
    /// Ask JVMs for a perf map (`jcmd PID Compiler.perfmap`) before each
    /// snapshot, to name JIT-compiled Java frames. Default: yes.
    pub java_perfmap: bool,
}

/// `--dump-on-growth SIZE[/WINDOW]`: growth of `size` bytes within `window`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GrowthTrigger {
    pub size: u64,
    pub window: Duration,
}

impl Default for SessionOptions {
    fn default() -> Self {
        Self {
            targets: Targets::Pids(Vec::new()),
            duration: None,
            output_dir: PathBuf::from("."),
            kernel: KernelOptions::default(),
            collector: CollectorOptions::default(),
            verbose: false,
            progress: false,
            rescan_interval: Duration::from_secs(1),
            snapshot_interval: None,
            dump_on_growth: None,
            min_dump_gap: Duration::from_secs(10),
            formats: Format::ALL.to_vec(),
            java_perfmap: true,
        }
    }
}

/// What happened to one process.
#[derive(Clone, Debug)]
pub struct ProcessSummary {
    pub pid: u32,
    pub container_pid: Option<u32>,
    pub command: String,
    pub samples: u64,
    pub inuse_bytes: f64,
    pub files: Vec<PathBuf>,
    /// The `heap_v2` snapshots among `files`, in order.
    pub heaps: Vec<PathBuf>,
    pub drops: Drops,
    pub exited: bool,
}

#[derive(Clone, Debug)]
pub struct Summary {
    pub processes: Vec<ProcessSummary>,
    pub probes: usize,
    pub elapsed: Duration,
    /// Kernel counters, indexed by `profiler_common::Counter`.
    pub kernel_counters: Vec<u64>,
    /// In launch mode: the command's exit code (128 + signal if killed).
    pub exit_code: Option<i32>,
    /// Hits and estimated cost per entry point, busiest first.
    pub probe_costs: Vec<ProbeCost>,
    /// How calls got their return half, and why.
    pub return_probes: String,
}

/// Why the run stopped.
#[derive(Debug, PartialEq, Eq)]
enum Stop {
    Duration,
    Signal(i32),
    AllExited,
}

struct Tracked {
    pid: u32,
    command: String,
    container_pid: Option<u32>,
    heap: ProcessHeap,
    /// `/proc/PID/maps` as last read: written with each profile.
    maps: String,
    /// The address ranges of `maps`, to notice samples from code mapped
    /// since (a library just loaded, a launched command just exec'd).
    ranges: Vec<(u64, u64)>,
    /// The `[uprobes]` area of `maps`, where the kernel's uretprobe
    /// trampoline lives.
    trampoline: Option<(u64, u64)>,
    /// Files whose jemalloc is probed for this process.
    attached_files: HashSet<FileId>,
    exited: bool,
    /// Every file written, all formats.
    files: Vec<PathBuf>,
    /// The `heap_v2` snapshots among them, in order.
    heaps: Vec<PathBuf>,
    /// Names frames for the symbolized formats; rebuilt when the maps change.
    namer: Option<(String, Namer)>,
    /// (when, estimated bytes in use) once a tick, for growth triggers; the
    /// oldest entry is the baseline.
    growth: std::collections::VecDeque<(Instant, f64)>,
    last_growth_dump: Option<Instant>,
    /// DWARF unwinding of this process's samples.
    unwinder: ProcessUnwinder,
    /// Complete DWARF unwinds in a row that the frame-pointer walk of the
    /// same sample matched, and whether the kernel was told to trust it.
    frame_pointer_matches: u32,
    frame_pointers_trusted: bool,
}

/// Matches in a row after which a process's frame pointers are trusted.
const FRAME_POINTER_MATCHES: u32 = 32;

impl Tracked {
    /// Keeps a fresh copy of the maps; a failed read keeps the last good one
    /// (the process may be gone).
    fn set_maps(&mut self, maps: Option<String>) {
        if let Some(maps) = maps {
            let mappings = parse_maps(&maps);
            (self.ranges, self.trampoline) = ranges_of(&mappings);
            self.unwinder.add_files(self.pid, &mappings);
            self.maps = maps;
        }
    }

    /// Replaces a sample's frame-pointer frames with DWARF-unwound ones
    /// where the kernel copied its stack. Frame pointers are a fast path
    /// where the code keeps them: once the walks of enough samples in a row
    /// matched their DWARF unwinds, the kernel is told to send most samples
    /// of the process without a copy; one that does not match ends that.
    /// Returns the new trust when it changes.
    fn unwind(&mut self, event: &mut Event, fast_path: bool) -> Option<bool> {
        let Event::Sampled {
            frames, stack_copy, ..
        } = event
        else {
            return None;
        };
        let Some(copy) = stack_copy else {
            self.unwinder.complete_root(frames);
            if self.frame_pointers_trusted {
                self.heap.drops.trusted_frame_pointers += 1;
            }
            return None;
        };
        let mut unwound = Vec::new();
        let end = self.unwinder.unwind(&copy.regs, &copy.bytes, &mut unwound);
        let trust = if fast_path {
            let mut walked = frames.clone();
            self.unwinder.complete_root(&mut walked);
            self.judge_frame_pointers(end, walked == unwound)
        } else {
            None
        };
        // Another tool's uretprobe put the trampoline where the caller's
        // return address was: CFI cannot see past it; keep the walk, whose
        // trampoline frame is dropped and counted next.
        let hidden = unwound.first().is_some_and(|&caller| {
            self.trampoline
                .is_some_and(|(start, end)| caller >= start && caller < end)
        });
        if unwound.is_empty() || hidden {
            self.unwinder.complete_root(frames);
            return trust;
        }
        *frames = unwind::splice(&unwound, end, frames);
        self.heap.drops.dwarf_unwound += 1;
        if end != UnwindEnd::Complete && frames.len() == unwound.len() {
            self.heap.drops.truncated_stacks += 1;
        }
        trust
    }

    fn judge_frame_pointers(&mut self, end: UnwindEnd, matched: bool) -> Option<bool> {
        if end != UnwindEnd::Complete {
            return None;
        }
        if !matched {
            self.frame_pointer_matches = 0;
            return std::mem::take(&mut self.frame_pointers_trusted).then_some(false);
        }
        self.frame_pointer_matches += 1;
        if self.frame_pointer_matches >= FRAME_POINTER_MATCHES && !self.frame_pointers_trusted {
            self.frame_pointers_trusted = true;
            return Some(true);
        }
        None
    }
}

/// [start, end) of a mapping.
type Range = (u64, u64);

/// The address ranges of a process's mappings, and its `[uprobes]` area:
/// found once per read of the maps, not per event.
fn ranges_of(mappings: &[Mapping]) -> (Vec<Range>, Option<Range>) {
    let trampoline = mappings
        .iter()
        .find(|m| m.path.as_deref() == Some("[uprobes]"))
        .map(|m| (m.start, m.end));
    (
        mappings.iter().map(|m| (m.start, m.end)).collect(),
        trampoline,
    )
}

struct Session<'a> {
    options: SessionOptions,
    status: &'a mut dyn Write,
    probes: KernelProbes,
    cache: AllocatorCache,
    tracked: BTreeMap<u32, Tracked>,
    /// Files probed system-wide (`--all`).
    system_wide: HashSet<FileId>,
    next_instance: u16,
    output: OutputDir,
    exits: mpsc::UnboundedSender<u32>,
    /// When the probes were attached: snapshots say how long after.
    started: Instant,
    /// Whether the run was announced: attach failures after that are
    /// warnings.
    announced: bool,
}

/// Runs a session; status lines go to `status` (stderr in the binary).
pub async fn run(options: SessionOptions, status: &mut dyn Write) -> Result<Summary> {
    features::require_root()?;
    features::require_kernel_support()?;

    // Every named target is checked before anything is loaded or attached.
    let mut cache = AllocatorCache::default();
    let mut initial = Vec::new();
    let mut predicted = Vec::new();
    match &options.targets {
        Targets::Pids(pids) => {
            for &pid in pids {
                let maps = read_maps(pid)?;
                let found = cache.require(pid, &parse_maps(&maps), &command_name(pid))?;
                initial.push((pid, maps, found));
            }
        }
        Targets::Launch(command) => {
            let program = command
                .first()
                .ok_or_else(|| Error::Launch("no command given after --".into()))?;
            let executable = launch::resolve_program(program)?;
            predicted = launch::predict_files(&executable)?;
        }
        Targets::All => {}
    }

    let output = OutputDir::new(&options.output_dir);
    output.prepare()?;
    output.remove_stale_temporaries();
    let probes = KernelProbes::load(&options.kernel)?;
    let (exits, mut exit_rx) = mpsc::unbounded_channel();
    let mut session = Session {
        output,
        options,
        status,
        probes,
        cache,
        tracked: BTreeMap::new(),
        system_wide: HashSet::new(),
        next_instance: 0,
        exits,
        started: Instant::now(),
        announced: false,
    };

    let mut launched_exit: Option<oneshot::Receiver<std::io::Result<ExitStatus>>> = None;
    let mut launched_pid = None;
    match session.options.targets.clone() {
        Targets::Pids(_) => {
            for (pid, maps, found) in initial {
                session.track(pid, maps);
                session.attach_found(pid, found)?;
            }
        }
        Targets::All => session.scan_all()?,
        Targets::Launch(command) => {
            let child = launch::spawn_gated(&command)?;
            let pid = child.pid;
            let name = command[0]
                .to_string_lossy()
                .rsplit('/')
                .next()
                .unwrap_or("?")
                .to_owned();
            session.track(pid, String::new());
            if let Some(t) = session.tracked.get_mut(&pid) {
                t.command = name;
            }
            for file in &predicted {
                let Some(allocator) = allocator_in_file(&file.path) else {
                    continue;
                };
                let path = file.path.to_string_lossy().into_owned();
                session.attach_file(Scope::Process(pid), &path, &file.path, &allocator)?;
                if let Some(t) = session.tracked.get_mut(&pid) {
                    t.attached_files.insert(file.file);
                }
            }
            // Only now may the command run: every probe is in place.
            let (pid, exit) = child.release();
            launched_exit = Some(exit);
            launched_pid = Some(pid);
        }
    }
    session.announce();

    let started = Instant::now();
    session.started = started;
    // SAFETY: the ring buffer owns its fd and keeps it open while it lives,
    // which is as long as the AsyncFd that owns the ring buffer.
    let mut ring = unsafe {
        AsyncFd::register_with_interest(session.probes.take_events()?, Interest::READABLE)
    }
    .map_err(|e| Error::Events(e.to_string()))?;
    let signal_error = |e: std::io::Error| Error::Events(e.to_string());
    let mut interrupt = signal(SignalKind::interrupt()).map_err(signal_error)?;
    let mut terminate = signal(SignalKind::terminate()).map_err(signal_error)?;
    let mut snapshot_signal = signal(SignalKind::user_defined1()).map_err(signal_error)?;
    let mut snapshot_timer = session
        .options
        .snapshot_interval
        .map(|period| tokio::time::interval_at(tokio::time::Instant::now() + period, period));
    let deadline = session
        .options
        .duration
        .map(|d| tokio::time::Instant::now() + d);
    let mut ticker = tokio::time::interval(session.options.rescan_interval);
    let mut exit_status: Option<std::io::Result<ExitStatus>> = None;
    let mut ticks: u64 = 0;
    let mut last_hits: Vec<u64> = Vec::new();

    let stop = loop {
        tokio::select! {
            readable = ring.readable_mut() => {
                let mut guard = readable.map_err(|e| Error::Events(e.to_string()))?;
                session.drain(guard.get_inner_mut());
                guard.clear_ready();
            }
            _ = sleep_until(deadline) => break Stop::Duration,
            _ = interrupt.recv() => break Stop::Signal(libc::SIGINT),
            _ = terminate.recv() => break Stop::Signal(libc::SIGTERM),
            _ = snapshot_signal.recv() => {
                session.drain(ring.get_mut());
                session.snapshot_all("SIGUSR1")?;
            }
            _ = tick_of(&mut snapshot_timer) => {
                session.drain(ring.get_mut());
                session.snapshot_all("interval")?;
            }
            status = wait_launched(&mut launched_exit) => {
                exit_status = Some(status);
                session.drain(ring.get_mut());
                if let Some(pid) = launched_pid {
                    session.process_exited(pid)?;
                }
                break Stop::AllExited;
            }
            Some(pid) = exit_rx.recv() => {
                session.drain(ring.get_mut());
                session.process_exited(pid)?;
                let all_gone = session.tracked.values().all(|t| t.exited);
                if all_gone && matches!(session.options.targets, Targets::Pids(_)) {
                    break Stop::AllExited;
                }
            }
            _ = ticker.tick() => {
                session.drain(ring.get_mut());
                session.rescan()?;
                session.check_growth()?;
                ticks += 1;
                if session.options.verbose && ticks.is_multiple_of(10) {
                    last_hits = session.report_rates(&last_hits, session.options.rescan_interval * 10);
                }
                if session.options.progress {
                    let line = session.progress_line(started.elapsed());
                    let _ = write!(session.status, "\r\x1b[2K{line}");
                    let _ = session.status.flush();
                }
            }
        }
    };
    session.drain(ring.get_mut());
    let elapsed = started.elapsed();
    session.clear_progress();
    if session.options.verbose {
        let reason = match stop {
            Stop::Duration => "duration reached".to_owned(),
            Stop::Signal(libc::SIGINT) => "interrupted".to_owned(),
            Stop::Signal(_) => "terminated".to_owned(),
            Stop::AllExited => "every process exited".to_owned(),
        };
        let _ = writeln!(session.status, "memprobe: stopping: {reason}");
    }
    session.snapshot_all("end of run")?;
    let Session {
        probes,
        tracked,
        status,
        ..
    } = session;
    let kernel_counters = probes.counters().to_vec();
    let probe_count = probes.attached.len();
    let probe_costs = CostModel::default().costs(&probes.attached, &probes.probe_hits());
    let return_probes = probes.return_probes_used();
    // Detach before anything else: the targets run unprobed from here on.
    drop(ring);
    drop(probes);

    // A launched command is waited for, as a wrapper would: a signal that
    // stopped memprobe is passed on to it.
    if let (Some(pid), Some(exit)) = (launched_pid, launched_exit) {
        if let Stop::Signal(signal) = stop {
            // SAFETY: signalling our own child.
            unsafe { libc::kill(pid as i32, signal) };
        }
        if exit_status.is_none() {
            let _ = writeln!(status, "memprobe: detached; waiting for pid {pid} to exit");
            exit_status = Some(
                exit.await
                    .unwrap_or_else(|_| Err(std::io::Error::other("lost"))),
            );
        }
    }
    let exit_code = match exit_status {
        Some(Ok(status)) => Some(exit_code_of(status)),
        Some(Err(e)) => return Err(Error::Launch(e.to_string())),
        None => None,
    };

    let processes = tracked
        .into_values()
        .filter(|t| !t.files.is_empty())
        .map(|t| ProcessSummary {
            pid: t.pid,
            container_pid: t.container_pid,
            command: t.command,
            samples: t.heap.samples,
            inuse_bytes: t.heap.inuse_bytes(),
            files: t.files,
            heaps: t.heaps,
            drops: t.heap.drops,
            exited: t.exited,
        })
        .collect();
    Ok(Summary {
        processes,
        probes: probe_count,
        elapsed,
        kernel_counters,
        exit_code,
        probe_costs,
        return_probes,
    })
}

fn exit_code_of(status: ExitStatus) -> i32 {
    use std::os::unix::process::ExitStatusExt;
    status
        .code()
        .unwrap_or_else(|| 128 + status.signal().unwrap_or(0))
}

async fn wait_launched(
    exit: &mut Option<oneshot::Receiver<std::io::Result<ExitStatus>>>,
) -> std::io::Result<ExitStatus> {
    match exit {
        Some(receiver) => {
            let status = receiver
                .await
                .unwrap_or_else(|_| Err(std::io::Error::other("lost the launched command")));
            *exit = None;
            status
        }
        None => std::future::pending().await,
    }
}

async fn tick_of(timer: &mut Option<tokio::time::Interval>) {
    match timer {
        Some(timer) => {
            timer.tick().await;
        }
        None => std::future::pending().await,
    }
}

async fn sleep_until(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}

impl Session<'_> {
    /// Tracked processes that have not exited.
    fn live_pids(&self) -> Vec<u32> {
        self.tracked
            .values()
            .filter(|t| !t.exited)
            .map(|t| t.pid)
            .collect()
    }

    fn instance(&mut self) -> Result<u16> {
        let instance = self.next_instance;
        self.next_instance = instance
            .checked_add(1)
            .ok_or_else(|| Error::Load("more than 65535 jemalloc copies".into()))?;
        Ok(instance)
    }

    /// Starts keeping a profile for `pid`.
    fn track(&mut self, pid: u32, maps: String) {
        if self.tracked.contains_key(&pid) {
            return;
        }
        let mut tracked = Tracked {
            pid,
            command: command_name(pid),
            container_pid: namespace_pid(pid),
            heap: ProcessHeap::new(pid, self.options.collector.clone()),
            ranges: Vec::new(),
            trampoline: None,
            maps: String::new(),
            attached_files: HashSet::new(),
            exited: false,
            files: Vec::new(),
            heaps: Vec::new(),
            namer: None,
            growth: std::collections::VecDeque::new(),
            last_growth_dump: None,
            unwinder: ProcessUnwinder::new(),
            frame_pointer_matches: 0,
            frame_pointers_trusted: false,
        };
        tracked.set_maps(Some(maps));
        self.tracked.insert(pid, tracked);
        if !matches!(self.options.targets, Targets::Launch(_)) {
            watch_exit(pid, self.exits.clone());
        }
    }

    /// Attaches pid-scoped probes to each found copy not yet probed.
    fn attach_found(&mut self, pid: u32, found: Vec<Found>) -> Result<usize> {
        let mut attached = 0;
        for f in found {
            let known = self
                .tracked
                .get(&pid)
                .is_some_and(|t| t.attached_files.contains(&f.file));
            if known {
                continue;
            }
            let result = self.attach_file(Scope::Process(pid), &f.path, &f.open_path, &f.allocator);
            // Tried once: a copy that failed is not retried at every rescan.
            if let Some(t) = self.tracked.get_mut(&pid) {
                t.attached_files.insert(f.file);
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
                    "memprobe: warning: {e}; profiling goes on without it"
                );
                Ok(0)
            }
            result => result,
        }
    }

    /// Attaches to one allocator copy and, with `--verbose`, lists its
    /// probes. A failed attach leaves none of the copy's probes behind.
    fn attach_file(
        &mut self,
        scope: Scope,
        path: &str,
        open_path: &Path,
        allocator: &Allocator,
    ) -> Result<usize> {
        let instance = self.instance()?;
        let before = self.probes.attached.len();
        let attached = self
            .probes
            .attach(scope, path, open_path, allocator, instance)?;
        self.print_verbose_probes(before);
        self.print_verbose_wrappers(path, allocator);
        Ok(attached)
    }

    /// `--all`: system-wide probes on every jemalloc file in use, and a
    /// profile for every process that maps one.
    fn scan_all(&mut self) -> Result<()> {
        let own = std::process::id();
        for pid in all_pids().into_iter().filter(|&p| p != own) {
            let Ok(maps) = read_maps(pid) else {
                continue;
            };
            let found = self.cache.find(pid, &parse_maps(&maps));
            if found.is_empty() {
                continue;
            }
            for f in &found {
                if self.system_wide.insert(f.file) {
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
                        t.attached_files.extend(found.iter().map(|f| f.file));
                    }
                }
            }
        }
        Ok(())
    }

    /// Picks up libraries loaded since the last look (`dlopen`) and, with
    /// `--all`, new processes; keeps each process's maps fresh.
    fn rescan(&mut self) -> Result<()> {
        if matches!(self.options.targets, Targets::All) {
            return self.scan_all();
        }
        for pid in self.live_pids() {
            // The process may be gone; keep the last good copy of its maps.
            let Ok(maps) = read_maps(pid) else {
                continue;
            };
            let found = self.cache.find(pid, &parse_maps(&maps));
            if let Some(t) = self.tracked.get_mut(&pid) {
                t.set_maps(Some(maps));
            }
            let new: Vec<Found> = found
                .into_iter()
                .filter(|f| {
                    self.tracked
                        .get(&pid)
                        .is_some_and(|t| !t.attached_files.contains(&f.file))
                })
                .collect();
            let paths: Vec<String> = new.iter().map(|f| f.path.clone()).collect();
            let attached = self.attach_found(pid, new)?;
            if attached > 0 {
                self.clear_progress();
                let _ = writeln!(
                    self.status,
                    "memprobe: pid {pid} loaded jemalloc in {}: attached {attached} probes",
                    paths.join(", ")
                );
            }
        }
        Ok(())
    }

    fn drain(&mut self, ring: &mut RingBuf<MapData>) {
        while let Some(record) = ring.next() {
            let Some(event) = decode(&record) else {
                continue;
            };
            let pid = match &event {
                Event::Sampled { header, .. }
                | Event::Returned { header, .. }
                | Event::Freed { header, .. }
                | Event::Resized { header, .. } => header.pid,
            };
            // System-wide probes see processes before the next scan does.
            if !self.tracked.contains_key(&pid) && matches!(self.options.targets, Targets::All) {
                let maps = read_maps(pid).unwrap_or_default();
                self.track(pid, maps);
            }
            if let Some(t) = self.tracked.get_mut(&pid) {
                if let Event::Sampled { frames, .. } = &event
                    && let Some(&caller) = frames.first()
                    && !t.ranges.iter().any(|&(s, e)| caller >= s && caller < e)
                {
                    t.set_maps(read_maps(pid).ok());
                }
                let mut event = event;
                if let Some(trusted) = t.unwind(&mut event, self.probes.frame_pointer_fast_path()) {
                    self.probes.trust_frame_pointers(pid, trusted);
                }
                drop_trampoline_caller(&mut event, t.trampoline, &mut t.heap);
                t.heap.apply(event);
            }
        }
    }

    fn process_exited(&mut self, pid: u32) -> Result<()> {
        let Some(t) = self.tracked.get_mut(&pid) else {
            return Ok(());
        };
        if t.exited {
            return Ok(());
        }
        t.exited = true;
        // Its pid may come back as another program.
        self.probes.trust_frame_pointers(pid, false);
        let path = self.write_profile(pid, "process exited")?;
        self.clear_progress();
        let _ = writeln!(
            self.status,
            "memprobe: process {pid} exited; wrote its final profile {}",
            path.display()
        );
        Ok(())
    }

    /// A snapshot of every live process, for `reason`.
    fn snapshot_all(&mut self, reason: &str) -> Result<()> {
        for pid in self.live_pids() {
            self.write_profile(pid, reason)?;
        }
        Ok(())
    }

    /// `--dump-on-growth`: a snapshot of each process whose estimated
    /// in-use bytes grew by the trigger's size within its window, at most
    /// once per minimum gap; the next one needs as much growth again.
    fn check_growth(&mut self) -> Result<()> {
        let Some(trigger) = self.options.dump_on_growth else {
            return Ok(());
        };
        let now = Instant::now();
        let mut due = Vec::new();
        for t in self.tracked.values_mut().filter(|t| !t.exited) {
            let inuse = t.heap.inuse_bytes();
            t.growth.push_back((now, inuse));
            while t
                .growth
                .front()
                .is_some_and(|(when, _)| now.duration_since(*when) > trigger.window)
            {
                t.growth.pop_front();
            }
            let (since, lowest) = t
                .growth
                .iter()
                .copied()
                .min_by(|a, b| a.1.total_cmp(&b.1))
                .unwrap_or((now, inuse));
            let gap_ok = t
                .last_growth_dump
                .is_none_or(|last| now.duration_since(last) >= self.options.min_dump_gap);
            if inuse - lowest >= trigger.size as f64 && gap_ok {
                due.push((
                    t.pid,
                    format!(
                        "growth: +{} in {} (trigger {} within {})",
                        crate::units::bytes(inuse - lowest),
                        humantime::format_duration(Duration::from_secs(
                            now.duration_since(since).as_secs()
                        )),
                        crate::units::bytes(trigger.size as f64),
                        humantime::format_duration(trigger.window)
                    ),
                ));
                t.last_growth_dump = Some(now);
                t.growth.clear();
                t.growth.push_back((now, inuse));
            }
        }
        for (pid, reason) in due {
            let path = self.write_profile(pid, &reason)?;
            self.clear_progress();
            let _ = writeln!(
                self.status,
                "memprobe: pid {pid}: {reason}: wrote {}",
                path.display()
            );
        }
        Ok(())
    }

    fn write_profile(&mut self, pid: u32, reason: &str) -> Result<PathBuf> {
        let t = self.tracked.get_mut(&pid).expect("tracked pid");
        let mut profile = t.heap.snapshot(t.maps.clone());
        let mut head = vec![
            ("command".to_owned(), t.command.clone()),
            ("reason".to_owned(), reason.to_owned()),
            ("snapshot".to_owned(), t.heaps.len().to_string()),
            (
                "elapsed_s".to_owned(),
                format!("{:.3}", self.started.elapsed().as_secs_f64()),
            ),
        ];
        if let Some(inner) = t.container_pid {
            head.push(("container_pid".into(), inner.to_string()));
        }
        profile.notes.splice(0..0, head);
        let seq = self.output.next_seq(pid);
        let symbolized = self.options.formats.iter().any(|f| *f != Format::Heap);
        if symbolized && t.namer.as_ref().is_none_or(|(maps, _)| *maps != t.maps) {
            let namer = Namer::for_process(pid, &t.maps);
            t.namer = Some((t.maps.clone(), namer));
        }
        // A JVM's JIT code is anonymous memory: its names come from HotSpot.
        let is_jvm = t.maps.contains("/libjvm.so");
        if symbolized && is_jvm && !t.exited && self.options.java_perfmap {
            crate::symbolize::perfmap::request_from_hotspot(pid, Duration::from_secs(10));
            let symbols =
                crate::symbolize::perfmap::read_for_process(pid, t.container_pid.unwrap_or(pid));
            if let Some((_, namer)) = t.namer.as_mut() {
                namer.set_jit(symbols);
            }
        }
        let mut first = None;
        for &format in &self.options.formats {
            let ext = format.extension();
            let namer = t.namer.as_mut().map(|(_, n)| n);
            let written = self
                .output
                .write_file(pid, seq, ext, |w| write_format(format, &profile, namer, w));
            let path = written.map_err(|cause| Error::Write {
                path: self
                    .output
                    .path()
                    .join(crate::output::files::file_name(pid, seq, ext)),
                cause,
            })?;
            if format == Format::Heap {
                t.heaps.push(path.clone());
            }
            first.get_or_insert(path.clone());
            t.files.push(path);
        }
        Ok(first.unwrap_or_default())
    }

    fn print_verbose_wrappers(&mut self, path: &str, allocator: &Allocator) {
        if !self.options.verbose {
            return;
        }
        for (wrapper, inner) in &allocator.wrappers {
            let _ = writeln!(
                self.status,
                "memprobe: {path}: {wrapper} not probed: every call passes to {inner}"
            );
        }
    }

    fn print_verbose_probes(&mut self, from: usize) {
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

    /// The one line scripts wait for.
    fn announce(&mut self) {
        let until = match (&self.options.targets, self.options.duration) {
            (_, Some(d)) => format!("for {}", humantime::format_duration(d)),
            (Targets::Launch(_), None) => "until it exits".into(),
            (Targets::Pids(_), None) => "until Ctrl-C or until the processes exit".into(),
            (Targets::All, None) => "until Ctrl-C".into(),
        };
        let probes = self.probes.attached.len();
        let line = match &self.options.targets {
            Targets::All => format!(
                "memprobe: attached {probes} probes system-wide to {} jemalloc files in {} \
                 processes, watching for more; profiling {until}",
                self.system_wide.len(),
                self.tracked.len()
            ),
            Targets::Launch(_) if probes == 0 => {
                let t = self.tracked.values().next();
                format!(
                    "memprobe: started pid {} ({}); no jemalloc in it yet, attaching when it \
                     loads one; profiling {until}",
                    t.map_or(0, |t| t.pid),
                    t.map_or("?", |t| t.command.as_str())
                )
            }
            _ => {
                let described: Vec<String> = self
                    .tracked
                    .values()
                    .map(|t| {
                        let mut libs: Vec<&str> = self
                            .probes
                            .attached
                            .iter()
                            .filter(|p| p.scope == Scope::Process(t.pid))
                            .map(|p| p.path.as_str())
                            .collect();
                        libs.dedup();
                        let container = t
                            .container_pid
                            .map(|c| format!(", pid {c} in its container"))
                            .unwrap_or_default();
                        format!(
                            "pid {} ({}{container}, {})",
                            t.pid,
                            t.command,
                            libs.join(", ")
                        )
                    })
                    .collect();
                format!(
                    "memprobe: attached {probes} probes to {}; profiling {until}",
                    described.join(", ")
                )
            }
        };
        let _ = writeln!(self.status, "{line}");
        self.announced = true;
        let _ = self.status.flush();
    }

    /// `--verbose`: probe hits per second per entry point since the last call.
    fn report_rates(&mut self, previous: &[u64], period: Duration) -> Vec<u64> {
        let hits = self.probes.probe_hits();
        let delta: Vec<u64> = hits
            .iter()
            .enumerate()
            .map(|(i, h)| h - previous.get(i).copied().unwrap_or(0))
            .collect();
        let costs = CostModel::default().costs(&self.probes.attached, &delta);
        let added: Duration = costs.iter().map(|c| c.added).sum();
        self.clear_progress();
        let _ = writeln!(
            self.status,
            "memprobe: probe hits: {}; ~{:.1}% of a CPU added to the targets",
            if costs.is_empty() {
                "none".to_owned()
            } else {
                rates(&costs, period, 6)
            },
            100.0 * added.as_secs_f64() / period.as_secs_f64()
        );
        hits
    }

    fn clear_progress(&mut self) {
        if self.options.progress {
            let _ = write!(self.status, "\r\x1b[2K");
        }
    }

    fn progress_line(&self, elapsed: Duration) -> String {
        let samples: u64 = self.tracked.values().map(|t| t.heap.samples).sum();
        let inuse: f64 = self.tracked.values().map(|t| t.heap.inuse_bytes()).sum();
        let counters = self.probes.counters();
        let kernel_drops =
            counters[Counter::RingBufferFull as usize] + counters[Counter::SampledSetFull as usize];
        let user_drops: u64 = self
            .tracked
            .values()
            .map(|t| t.heap.drops.live_table_full + t.heap.drops.stack_table_full)
            .sum();
        let snapshots: usize = self.tracked.values().map(|t| t.heaps.len()).sum();
        format!(
            "memprobe: {} elapsed, {} processes, {samples} samples, ~{} in use, {} dropped, \
             {snapshots} snapshots written",
            humantime::format_duration(Duration::from_secs(elapsed.as_secs())),
            self.tracked.values().filter(|t| !t.exited).count(),
            crate::units::bytes(inuse),
            kernel_drops + user_drops
        )
    }
}

/// Another tool's return probe on the same function (a system-wide one at
/// its entry, say) replaces the return address on the stack with the
/// kernel's trampoline in the `[uprobes]` area before our probe reads it:
/// such a caller is dropped (the frame-pointer walk above it stays) and
/// counted, rather than written as a frame.
fn drop_trampoline_caller(
    event: &mut Event,
    trampoline: Option<(u64, u64)>,
    heap: &mut ProcessHeap,
) {
    let (Event::Sampled { frames, .. }, Some((start, end))) = (event, trampoline) else {
        return;
    };
    if frames.first().is_some_and(|&f| f >= start && f < end) {
        frames.remove(0);
        heap.drops.trampoline_callers += 1;
    }
}

/// Writes one snapshot in one format.
fn write_format(
    format: Format,
    profile: &HeapProfile,
    namer: Option<&mut Namer>,
    out: &mut dyn Write,
) -> std::io::Result<()> {
    let mut fallback;
    let namer = match namer {
        Some(namer) => namer,
        None => {
            fallback = Namer::new(&profile.mapped_libraries, None);
            &mut fallback
        }
    };
    match format {
        Format::Heap => heap_v2::write(profile, out),
        Format::Pprof => pprof::write(profile, namer, out),
        Format::SymbolizedHeap => symbolized::write(profile, namer, out),
        Format::Folded | Format::Svg => {
            let stacks: Vec<folded::NamedStack> = profile
                .stacks
                .iter()
                .map(|s| {
                    let names = namer.stack_of_return_addresses(&s.frames);
                    (names, s.inuse_bytes.round().max(0.0) as u64)
                })
                .collect();
            if format == Format::Folded {
                folded::write(&stacks, out)
            } else {
                let title = format!("Bytes in use, pid {}", profile.pid);
                flamegraph::write(&folded::lines(&stacks), &title, out)
            }
        }
    }
}

/// Sends `pid` on `exits` when the process ends (pidfd: no polling, no pid reuse).
fn watch_exit(pid: u32, exits: mpsc::UnboundedSender<u32>) {
    // SAFETY: pidfd_open takes a pid and flags; the result is a new fd or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if fd < 0 {
        return;
    }
    // SAFETY: the fd was just returned to us and is owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
    // SAFETY: the AsyncFd owns the OwnedFd, which stays open until dropped.
    let Ok(fd) = (unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) }) else {
        return;
    };
    tokio::spawn(async move {
        if fd.readable().await.is_ok() {
            let _ = exits.send(pid);
        }
    });
}

/// Lines summarising a run, for the end of the run.
pub fn summary_lines(summary: &Summary) -> Vec<String> {
    let mut lines = Vec::new();
    let counters = &summary.kernel_counters;
    let per_second = |n: u64| n as f64 / summary.elapsed.as_secs_f64().max(1e-3);
    lines.push(format!(
        "memprobe: detached {} probes after {}; {} allocation calls ({:.0}/s), {} sampled, {} free calls, \
         {} return probe runs",
        summary.probes,
        humantime::format_duration(Duration::from_millis(summary.elapsed.as_millis() as u64)),
        counters[Counter::AllocCalls as usize],
        per_second(counters[Counter::AllocCalls as usize]),
        counters[Counter::SampledCalls as usize],
        counters[Counter::FreeCalls as usize],
        counters[Counter::ReturnHalves as usize],
    ));
    let kernel_drops = [
        (Counter::RingBufferFull, "ring buffer full"),
        (Counter::SampledSetFull, "kernel pointer set full"),
        (Counter::PendingFull, "pending table full"),
        (Counter::StackErrors, "stack unreadable"),
        (
            Counter::StackCopiesSkipped,
            "sent without a stack copy (ring buffer over half full; frame pointers only)",
        ),
    ];
    let dropped: Vec<String> = kernel_drops
        .iter()
        .filter(|(c, _)| counters[*c as usize] > 0)
        .map(|(c, what)| format!("{} {what}", counters[*c as usize]))
        .collect();
    if !dropped.is_empty() {
        lines.push(format!("memprobe: kernel drops: {}", dropped.join(", ")));
    }
    for p in &summary.processes {
        let files: Vec<String> = p.files.iter().map(|f| f.display().to_string()).collect();
        let d = p.drops;
        let drops = d.live_table_full + d.untracked_in_kernel + d.stack_table_full;
        let container = p
            .container_pid
            .map(|c| format!(", pid {c} in its container"))
            .unwrap_or_default();
        lines.push(format!(
            "memprobe: pid {} ({}{container}){}: {} samples, ~{} in use, {} dropped; wrote {}",
            p.pid,
            p.command,
            if p.exited { ", exited" } else { "" },
            p.samples,
            crate::units::bytes(p.inuse_bytes),
            drops,
            files.join(", ")
        ));
    }
    let hits: u64 = summary.probe_costs.iter().map(|c| c.hits).sum();
    let added: Duration = summary.probe_costs.iter().map(|c| c.added).sum();
    let seconds = summary.elapsed.as_secs_f64().max(1e-3);
    lines.push(format!(
        "memprobe: cost: {} probe hits ({}/s){}; estimated time added to the profiled \
         processes: {:.3} s ({:.1}% of one CPU); return probes: {}",
        hits,
        crate::run::cost::human_count(hits as f64 / seconds),
        if hits > 0 {
            format!(": {}", rates(&summary.probe_costs, summary.elapsed, 5))
        } else {
            String::new()
        },
        added.as_secs_f64(),
        100.0 * added.as_secs_f64() / seconds,
        summary.return_probes,
    ));
    if let Some(code) = summary.exit_code {
        lines.push(format!("memprobe: the command exited with code {code}"));
    }
    lines
}
