//! One profiling run: check the targets, load and attach, collect until
//! told to stop, write, detach. Rescans once a second for libraries loaded
//! later and, with `--all`, for processes started later.
mod actions;
mod budget;
pub mod cost;
mod drain;
mod event_loop;
mod finish;
mod frees_on_request;
mod memory;
mod notice;
mod options;
mod own_cpus;
mod process;
mod publish;
mod python;
mod sampling;
mod scope;
mod snapshots;
mod status;
mod summary;
mod targets;
mod waits;

use std::{
    collections::{BTreeMap, HashSet},
    io::Write,
    time::Instant,
};

use tokio::{
    io::{Interest, unix::AsyncFd},
    sync::mpsc,
};

pub use options::{Growing, GrowthTrigger, Sampling, SessionOptions, Targets};
pub use sampling::windows::WindowTiming;
pub use snapshots::retention::Retention;
pub use summary::{ProcessSummary, Summary, summary_lines};

use crate::{
    discover::{AllocatorCache, AllocatorKind},
    error::{Error, Result},
    kernel::{KernelError, KernelProbes, features},
    output::files::OutputDir,
    proc::FileId,
    run::{
        budget::Budget,
        cost::{Costs, calibrate},
        frees_on_request::FreesOnRequest,
        process::Tracked,
        publish::Publishing,
        sampling::SamplingState,
        scope::RunScope,
        snapshots::{Snapshots, writer::SnapshotWriter},
        targets::{checked::check_targets, looks::LastLooks},
    },
    serve::Endpoints,
};

struct Session<'a> {
    options: SessionOptions,
    /// What the kind of targets decides, settled once.
    scope: RunScope,
    status: &'a mut dyn Write,
    probes: KernelProbes,
    cache: AllocatorCache,
    tracked: BTreeMap<u32, Tracked>,
    /// Files probed system-wide (`--all`).
    system_wide: HashSet<(FileId, AllocatorKind)>,
    /// `--all`: each process's maps as of its last look.
    looks: LastLooks,
    next_instance: u16,
    output: OutputDir,
    /// Snapshots: the writer, and what each process's left.
    snapshots: Snapshots,
    exits: mpsc::UnboundedSender<u32>,
    /// When the probes were attached: snapshots say how long after.
    started: Instant,
    /// Whether the run was announced: attach failures after that are
    /// warnings.
    announced: bool,
    /// What `--listen`'s endpoints show, and their requests for profiles.
    publishing: Option<Publishing>,
    /// What the probes cost: per hit, as last measured, and their hits.
    costs: Costs,
    /// `--max-overhead`.
    budget: Budget,
    /// How each process's calls are sampled beyond the byte countdown.
    sampling: SamplingState,
    /// Under `--track allocations`, frees followed for a while on request.
    frees_on_request: FreesOnRequest,
}

/// Runs a session; status lines go to `status` (stderr in the binary).
pub async fn run(options: SessionOptions, status: &mut dyn Write) -> Result<Summary> {
    features::require_root()?;
    features::require_kernel_support()?;
    // First: reading the targets' files and timing the probes are bursts
    // of memprobe's work too (some 0.2 s of a CPU).
    let own_cpus = match &options.targets {
        Targets::Pids(pids) => own_cpus::keep_off(pids),
        Targets::All | Targets::Launch(_) => None,
    };
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
    let measured = calibrate::measure(&mut probes);
    probes.reset_counters();
    let (exits, exit_rx) = mpsc::unbounded_channel();
    let mut session = Session::new(options, status, probes, cache, output, exits);
    session.take_first_costs(measured);
    // Listened for before the first probe goes in: a Ctrl-C right after
    // the attach must detach and write, not kill memprobe.
    let signals = waits::Signals::new()?;
    let mut launched = session.attach_targets(checked)?;
    if let Some(endpoints) = endpoints {
        session.serve(endpoints);
    }
    session.announce();
    if let Some(own_cpus) = own_cpus {
        let _ = writeln!(session.status, "{}", own_cpus.status_line());
    }
    session.started = Instant::now();
    // SAFETY: the ring buffer owns its fd and keeps it open while it lives,
    // which is as long as the AsyncFd that owns the ring buffer.
    let mut ring = unsafe {
        AsyncFd::register_with_interest(session.probes.take_events()?, Interest::READABLE)
    }
    .map_err(|e| events_error("watching the ring buffer", e.into_parts().1))?;
    let (stop, exit_status) = session
        .collect(&mut ring, launched.as_mut(), exit_rx, signals)
        .await?;
    session.finish(stop, ring, launched, exit_status).await
}

impl<'a> Session<'a> {
    fn new(
        options: SessionOptions,
        status: &'a mut dyn Write,
        probes: KernelProbes,
        cache: AllocatorCache,
        output: OutputDir,
        exits: mpsc::UnboundedSender<u32>,
    ) -> Self {
        let scope = RunScope::of(&options.targets);
        // System-wide probes are shared by every process: none is detached
        // from one for its cost.
        let budget = (options.max_overhead).filter(|_| scope.budget_applies(options.sampling));
        let snapshots = Snapshots::new(
            SnapshotWriter::start(output.clone(), options.debug_dir.clone()),
            options.retention,
            (options.dump_on_growth.clone(), options.min_dump_gap),
        );
        Self {
            scope,
            snapshots,
            output,
            options,
            status,
            probes,
            cache,
            tracked: BTreeMap::new(),
            system_wide: HashSet::new(),
            looks: LastLooks::default(),
            next_instance: 0,
            exits,
            started: Instant::now(),
            announced: false,
            publishing: None,
            costs: Costs::default(),
            budget: Budget::new(budget),
            sampling: SamplingState::default(),
            frees_on_request: FreesOnRequest::default(),
        }
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
}

fn events_error(
    what: &'static str,
    cause: impl Into<Box<dyn std::error::Error + Send + Sync>>,
) -> Error {
    KernelError::Events {
        what,
        cause: cause.into(),
    }
    .into()
}
