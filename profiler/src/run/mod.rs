//! One profiling run: check the targets, load and attach, collect until
//! told to stop, write, detach. Rescans once a second for libraries loaded
//! later and, with `--all`, for processes started later.
mod allocators;
mod attach;
mod budget;
pub mod calibrate;
pub mod cost;
mod drain;
mod found;
mod growth;
pub mod launch;
mod options;
mod own_sampling;
mod process;
mod publish;
mod recalibration;
mod retention;
mod snapshot;
mod status;
mod waits;
pub mod windows;
mod writer;

use std::{
    collections::{BTreeMap, HashSet},
    io::Write,
    process::ExitStatus,
    sync::{Arc, Mutex},
    time::Instant,
};

use aya::maps::{MapData, RingBuf};
use tokio::{
    io::{Interest, unix::AsyncFd},
    sync::{mpsc, oneshot},
};

pub use options::{GrowthTrigger, Sampling, SessionOptions, Targets};
pub use retention::Retention;
pub use status::{ProcessSummary, Summary, summary_lines};
pub use windows::WindowTiming;

use crate::{
    discover::{Allocator, AllocatorCache, AllocatorKind, Found, allocators_in_file},
    error::{Error, Result},
    kernel::{KernelProbes, Scope, features},
    output::files::OutputDir,
    proc::{FileId, command_name, parse_maps, read_maps},
    run::{
        cost::{CostLedger, CostModel},
        launch::PredictedFile,
        process::Tracked,
        recalibration::Recalibration,
        snapshot::SnapshotKind,
        waits::{
            Signals, exit_code_of, next_request, sleep_until, tick_of, wait_for_command,
            wait_launched,
        },
        writer::SnapshotWriter,
    },
    serve::{Endpoints, Published, SnapshotRequest},
};

/// Why the run stopped.
#[derive(Debug, PartialEq, Eq)]
enum Stop {
    Duration,
    Signal(i32),
    AllExited,
}

/// Ticks between two readings of other tools' links (`kernel::foreign`).
const FOREIGN_LINKS_EVERY: u64 = 10;

struct Session<'a> {
    options: SessionOptions,
    status: &'a mut dyn Write,
    probes: KernelProbes,
    cache: AllocatorCache,
    tracked: BTreeMap<u32, Tracked>,
    /// Files probed system-wide (`--all`).
    system_wide: HashSet<(FileId, AllocatorKind)>,
    next_instance: u16,
    output: OutputDir,
    /// Names and writes snapshots off the loop.
    writer: SnapshotWriter,
    exits: mpsc::UnboundedSender<u32>,
    /// When the probes were attached: snapshots say how long after.
    started: Instant,
    /// Whether the run was announced: attach failures after that are
    /// warnings.
    announced: bool,
    /// What `--listen`'s endpoints show, and their requests for profiles.
    published: Option<Arc<Mutex<Published>>>,
    snapshot_requests: Option<mpsc::Receiver<SnapshotRequest>>,
    /// What a probe hit costs on this host, as last measured.
    cost_model: CostModel,
    recalibration: Recalibration,
    /// The probes' hits and the time they added, priced each tick.
    ledger: CostLedger,
}

/// The targets as checked before anything is loaded.
enum Checked {
    /// Running processes: their maps and the allocator copies found.
    Pids(Vec<(u32, String, Vec<Found>)>),
    All,
    /// The command, and the files it is predicted to map with the
    /// allocator copies each holds.
    Launch(
        Vec<std::ffi::OsString>,
        Vec<(PredictedFile, Vec<Arc<Allocator>>)>,
    ),
}

/// A launched command: its pid and, once it exits, its status.
struct LaunchedCommand {
    pid: u32,
    exit: Option<oneshot::Receiver<std::io::Result<ExitStatus>>>,
}

/// Runs a session; status lines go to `status` (stderr in the binary).
pub async fn run(options: SessionOptions, status: &mut dyn Write) -> Result<Summary> {
    features::require_root()?;
    features::require_kernel_support()?;
    let mut cache = AllocatorCache::new(options.debug_dir.clone(), options.allocators.clone());
    let checked = check_targets(&options, &mut cache)?;
    // Bound before anything is attached: a bad address undoes nothing.
    let endpoints = options
        .listen
        .map(|address| Endpoints::bind(address, &options.access))
        .transpose()?;
    let output = OutputDir::new(&options.output_dir);
    output.prepare()?;
    output.remove_stale_temporaries();
    let mut probes = KernelProbes::load(&options.kernel, options.sample_interval)?;
    // Before anything is attached: the timing copy must run alone.
    let (cost_model, calibration_error) = match calibrate::measure(&mut probes) {
        Ok(model) => (model, None),
        Err(error) => (CostModel::default(), Some(error)),
    };
    probes.reset_counters();
    let (exits, exit_rx) = mpsc::unbounded_channel();
    let mut session = Session {
        writer: SnapshotWriter::start(output.clone(), options.debug_dir.clone()),
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
        published: None,
        snapshot_requests: None,
        cost_model,
        recalibration: Recalibration::default(),
        ledger: CostLedger::default(),
    };
    if session.options.verbose {
        let line = match calibration_error {
            Some(error) => format!(
                "probe costs not measured ({}): estimates use defaults",
                crate::error::chain(&error)
            ),
            None => format!(
                "probe costs: {}; on endbr64 (CET builds' first instruction) {:.1} µs",
                session.cost_model,
                session.cost_model.endbr64.as_secs_f64() * 1e6
            ),
        };
        let _ = writeln!(session.status, "memprobe: {line}");
    }
    let mut launched = session.attach_targets(checked)?;
    if let Some(endpoints) = endpoints {
        session.serve(endpoints);
    }
    session.announce();
    session.started = Instant::now();
    // SAFETY: the ring buffer owns its fd and keeps it open while it lives,
    // which is as long as the AsyncFd that owns the ring buffer.
    let mut ring = unsafe {
        AsyncFd::register_with_interest(session.probes.take_events()?, Interest::READABLE)
    }
    .map_err(|e| events_error("watching the ring buffer", e.into_parts().1))?;
    let (stop, exit_status) = session
        .collect(&mut ring, launched.as_mut(), exit_rx)
        .await?;
    session.finish(stop, ring, launched, exit_status).await
}

/// Every named target is checked before anything is loaded or attached.
fn check_targets(options: &SessionOptions, cache: &mut AllocatorCache) -> Result<Checked> {
    let (debug_dir, wanted) = (options.debug_dir.as_deref(), &options.allocators);
    Ok(match &options.targets {
        Targets::Pids(pids) => {
            let mut initial = Vec::new();
            for &pid in pids.iter() {
                let maps = read_maps(pid)?;
                let found = cache.require(pid, &parse_maps(&maps), &command_name(pid))?;
                initial.push((pid, maps, found));
            }
            Checked::Pids(initial)
        }
        Targets::Launch(command) => {
            let program = command.first().ok_or(Error::NoCommand)?;
            let executable = launch::resolve_program(program)?;
            let mut predicted = Vec::new();
            for file in launch::predict_files(&executable)? {
                let allocators = allocators_in_file(&file.path, debug_dir, wanted)?;
                predicted.push((file, allocators));
            }
            Checked::Launch(command.clone(), predicted)
        }
        Targets::All => Checked::All,
    })
}

impl Session<'_> {
    /// Attaches to the checked targets; in launch mode starts the command
    /// once every probe is in place.
    fn attach_targets(&mut self, checked: Checked) -> Result<Option<LaunchedCommand>> {
        match checked {
            Checked::Pids(initial) => {
                for (pid, maps, found) in initial {
                    self.track(pid, maps);
                    self.attach_found(pid, found)?;
                }
                Ok(None)
            }
            Checked::All => self.scan_all().map(|()| None),
            Checked::Launch(command, predicted) => {
                let child = launch::spawn_gated(&command)?;
                let pid = child.pid;
                self.track(pid, String::new());
                if let Some(t) = self.tracked.get_mut(&pid) {
                    t.command = launch::command_name(&command[0]);
                }
                for (file, allocators) in &predicted {
                    for allocator in allocators {
                        let path = file.path.to_string_lossy().into_owned();
                        self.attach_file(Scope::Process(pid), &path, &file.path, allocator)?;
                        if let Some(t) = self.tracked.get_mut(&pid) {
                            t.attached_files.insert((file.file, allocator.kind));
                        }
                    }
                }
                // Only now may the command run: every probe is in place.
                let (pid, exit) = child.release();
                Ok(Some(LaunchedCommand {
                    pid,
                    exit: Some(exit),
                }))
            }
        }
    }

    /// Drains events, takes snapshots and rescans until a reason to stop.
    async fn collect(
        &mut self,
        ring: &mut AsyncFd<RingBuf<MapData>>,
        mut launched: Option<&mut LaunchedCommand>,
        mut exit_rx: mpsc::UnboundedReceiver<u32>,
    ) -> Result<(Stop, Option<std::io::Result<ExitStatus>>)> {
        let mut signals = Signals::new()?;
        let mut snapshot_timer = self
            .options
            .snapshot_interval
            .map(|period| tokio::time::interval_at(tokio::time::Instant::now() + period, period));
        let deadline = self
            .options
            .duration
            .map(|d| tokio::time::Instant::now() + d);
        let mut ticker = tokio::time::interval(self.options.rescan_interval);
        let mut ticks: u64 = 0;
        let mut last_rates = CostLedger::default();
        loop {
            let window_change = self
                .next_window_change()
                .map(tokio::time::Instant::from_std);
            tokio::select! {
                readable = ring.readable_mut() => {
                    let mut guard = readable.map_err(|e| events_error("reading the ring buffer", e))?;
                    // Left ready while records remain: the kernel wakes a
                    // reader only once it has caught up.
                    if self.drain(guard.get_inner_mut()) {
                        guard.clear_ready();
                    }
                }
                _ = sleep_until(deadline) => return Ok((Stop::Duration, None)),
                _ = signals.interrupt.recv() => return Ok((Stop::Signal(libc::SIGINT), None)),
                _ = signals.terminate.recv() => return Ok((Stop::Signal(libc::SIGTERM), None)),
                _ = signals.snapshot.recv() => {
                    self.drain(ring.get_mut());
                    self.snapshot_all("SIGUSR1", SnapshotKind::Requested);
                }
                _ = tick_of(&mut snapshot_timer) => {
                    self.drain(ring.get_mut());
                    self.snapshot_all("interval", SnapshotKind::Periodic);
                }
                status = wait_launched(launched.as_deref_mut()) => {
                    self.drain(ring.get_mut());
                    if let Some(launched) = &launched {
                        self.process_exited(launched.pid)?;
                    }
                    return Ok((Stop::AllExited, Some(status)));
                }
                Some(pid) = exit_rx.recv() => {
                    self.drain(ring.get_mut());
                    self.process_exited(pid)?;
                    let all_gone = self.tracked.values().all(|t| t.exited);
                    if all_gone && matches!(self.options.targets, Targets::Pids(_)) {
                        return Ok((Stop::AllExited, None));
                    }
                }
                Some(request) = next_request(&mut self.snapshot_requests) => {
                    self.drain(ring.get_mut());
                    self.answer(request);
                }
                _ = sleep_until(window_change) => {
                    self.change_windows(ring.get_mut());
                }
                _ = ticker.tick() => {
                    self.drain(ring.get_mut());
                    self.tick(&mut ticks, &mut last_rates)?;
                    // Every process detached over budget: nothing to profile.
                    let all_done = self.tracked.values().all(|t| t.exited);
                    if all_done && matches!(self.options.targets, Targets::Pids(_)) {
                        return Ok((Stop::AllExited, None));
                    }
                }
            }
        }
    }

    /// Once a rescan interval: new libraries and processes, growth
    /// triggers, `--verbose` rates, the status line.
    fn tick(&mut self, ticks: &mut u64, last_rates: &mut CostLedger) -> Result<()> {
        if ticks.is_multiple_of(FOREIGN_LINKS_EVERY) {
            self.probes.read_foreign_links();
        }
        let forced = self.ledger.update(&self.cost_model, &self.probes);
        self.say_forced_returns(&forced);
        self.keep_costs_measured();
        self.rescan()?;
        self.check_growth();
        self.enforce_budget();
        self.watch_own_profilers();
        self.check_silent_allocators();
        self.publish();
        self.record_written()?;
        *ticks += 1;
        if self.options.verbose && ticks.is_multiple_of(10) {
            *last_rates = self.report_rates(last_rates, self.options.rescan_interval * 10);
        }
        if self.options.progress {
            let line = self.progress_line(self.started.elapsed());
            let _ = write!(self.status, "\r\x1b[2K{line}");
            let _ = self.status.flush();
        }
        Ok(())
    }

    /// `--verbose`: why the run stops, and how many probe counter slots
    /// it used (bounded: a part attached again takes back its own).
    fn say_why_stopping(&mut self, stop: &Stop) {
        let reason = match stop {
            Stop::Duration => "duration reached",
            Stop::Signal(libc::SIGINT) => "interrupted",
            Stop::Signal(_) => "terminated",
            Stop::AllExited => "every process exited",
        };
        let _ = writeln!(self.status, "memprobe: stopping: {reason}");
        let _ = writeln!(
            self.status,
            "memprobe: {} probe counter slots used over the run",
            self.probes.attached.len()
        );
    }

    /// The last snapshots, detaching, waiting for a launched command, and
    /// the summary.
    async fn finish(
        mut self,
        stop: Stop,
        mut ring: AsyncFd<RingBuf<MapData>>,
        launched: Option<LaunchedCommand>,
        mut exit_status: Option<std::io::Result<ExitStatus>>,
    ) -> Result<Summary> {
        self.drain(ring.get_mut());
        let elapsed = self.started.elapsed();
        self.clear_progress();
        if self.options.verbose {
            self.say_why_stopping(&stop);
        }
        self.last_windows(ring.get_mut()).await;
        // The last snapshots hold owned data: the probes can go before
        // they are written.
        self.snapshot_all("end of run", SnapshotKind::Last);
        let Session {
            probes,
            mut tracked,
            status,
            mut writer,
            options,
            cost_model,
            mut ledger,
            ..
        } = self;
        let kernel_counters = probes.counters();
        let probe_count = probes.attached_now();
        ledger.update(&cost_model, &probes);
        let probe_costs = ledger.costs(&probes.attached);
        let switch_cost = ledger.switch_costs();
        let return_probes = probes.return_probes_used();
        // Detach before anything else: the targets run unprobed from here on.
        drop(ring);
        drop(probes);
        if !writer.is_idle() && options.progress {
            let _ = writeln!(status, "memprobe: detached; writing the last snapshots");
        }
        for done in writer.finish() {
            snapshot::record(
                done,
                &mut tracked,
                status,
                (options.progress, options.retention),
            )?;
        }
        if let Some(launched) = launched {
            exit_status = Some(wait_for_command(launched, &stop, exit_status, status).await);
        }
        let exit_code = match exit_status {
            Some(Ok(status)) => Some(exit_code_of(status)),
            Some(Err(cause)) => {
                return Err(Error::Launch {
                    program: options.targets.command_program(),
                    cause,
                });
            }
            None => None,
        };
        Ok(Summary {
            processes: tracked
                .into_values()
                .filter(|t| !t.files.is_empty())
                .map(ProcessSummary::of)
                .collect(),
            probes: probe_count,
            elapsed,
            kernel_counters,
            exit_code,
            probe_costs,
            switch_cost,
            cost_model,
            return_probes,
            output_dir: options.output_dir.clone(),
            verbose: options.verbose,
        })
    }

    /// Tracked processes that have not exited.
    fn live_pids(&self) -> Vec<u32> {
        self.tracked
            .values()
            .filter(|t| !t.exited)
            .map(|t| t.pid)
            .collect()
    }
}

fn events_error(
    what: &'static str,
    cause: impl Into<Box<dyn std::error::Error + Send + Sync>>,
) -> Error {
    Error::Events {
        what,
        cause: cause.into(),
    }
}
