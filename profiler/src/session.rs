//! One profiling run: attach, collect until told to stop, write, detach.
use std::{
    collections::{BTreeMap, HashMap},
    io::Write,
    os::fd::{FromRawFd, OwnedFd},
    path::PathBuf,
    time::{Duration, Instant},
};

use aya::maps::{MapData, RingBuf};
use tokio::{
    io::{Interest, unix::AsyncFd},
    signal::unix::{SignalKind, signal},
    sync::mpsc,
};

use crate::{
    checks,
    collector::{CollectorOptions, Drops, ProcessHeap},
    error::{Error, Result},
    events::{Event, decode},
    kernel::{KernelOptions, KernelProbes},
    output::{files::OutputDir, heap_v2},
    target::{Target, read_maps},
};

/// Everything a run needs to know.
#[derive(Clone, Debug)]
pub struct SessionOptions {
    pub pids: Vec<u32>,
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
}

impl Default for SessionOptions {
    fn default() -> Self {
        Self {
            pids: Vec::new(),
            duration: None,
            output_dir: PathBuf::from("."),
            kernel: KernelOptions::default(),
            collector: CollectorOptions::default(),
            verbose: false,
            progress: false,
        }
    }
}

/// What happened to one process.
#[derive(Clone, Debug)]
pub struct ProcessSummary {
    pub pid: u32,
    pub command: String,
    pub samples: u64,
    pub inuse_bytes: f64,
    pub files: Vec<PathBuf>,
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
}

/// Why the run stopped.
#[derive(Debug, PartialEq, Eq)]
enum Stop {
    Duration,
    Interrupted,
    Terminated,
    AllExited,
}

struct Tracked {
    target: Target,
    heap: ProcessHeap,
    maps: String,
    exited: bool,
    files: Vec<PathBuf>,
}

/// Runs a session; status lines go to `status` (stderr in the binary).
pub async fn run(options: SessionOptions, status: &mut dyn Write) -> Result<Summary> {
    checks::require_root()?;
    checks::require_kernel_support()?;
    // Every target is checked before anything is loaded or attached.
    let mut tracked: BTreeMap<u32, Tracked> = BTreeMap::new();
    for &pid in &options.pids {
        let target = Target::inspect(pid)?;
        let maps = read_maps(pid)?;
        let heap = ProcessHeap::new(pid, options.collector.clone());
        tracked.insert(
            pid,
            Tracked {
                target,
                heap,
                maps,
                exited: false,
                files: Vec::new(),
            },
        );
    }

    let mut probes = KernelProbes::load(&options.kernel)?;
    for t in tracked.values() {
        probes.attach(&t.target)?;
    }
    if options.verbose {
        for p in &probes.attached {
            let _ = writeln!(
                status,
                "memprobe: pid {}: {} at {}+{:#x}{}",
                p.pid,
                p.symbol,
                p.path,
                p.file_offset,
                if p.with_return {
                    " (entry and return)"
                } else {
                    " (entry)"
                }
            );
        }
    }
    let started = Instant::now();
    let described: Vec<String> = tracked
        .values()
        .map(|t| {
            let libs: Vec<&str> = t.target.jemalloc.iter().map(|j| j.path.as_str()).collect();
            format!(
                "pid {} ({}, {})",
                t.target.pid,
                t.target.command,
                libs.join(", ")
            )
        })
        .collect();
    let until = match options.duration {
        Some(d) => format!("for {}", humantime::format_duration(d)),
        None => "until Ctrl-C".into(),
    };
    let _ = writeln!(
        status,
        "memprobe: attached {} probes to {}; profiling {until}",
        probes.attached.len(),
        described.join(", "),
    );
    let _ = status.flush();

    // SAFETY: the ring buffer owns its fd and keeps it open while it lives,
    // which is as long as the AsyncFd that owns the ring buffer.
    let mut ring =
        unsafe { AsyncFd::register_with_interest(probes.take_events()?, Interest::READABLE) }
            .map_err(|e| Error::Events(e.to_string()))?;
    let (exit_tx, mut exit_rx) = mpsc::unbounded_channel();
    for &pid in tracked.keys() {
        watch_exit(pid, exit_tx.clone());
    }
    let mut interrupt =
        signal(SignalKind::interrupt()).map_err(|e| Error::Events(e.to_string()))?;
    let mut terminate =
        signal(SignalKind::terminate()).map_err(|e| Error::Events(e.to_string()))?;
    let deadline = options.duration.map(|d| tokio::time::Instant::now() + d);
    let mut ticker = tokio::time::interval(Duration::from_secs(1));
    let mut output = OutputDir::new(&options.output_dir);

    let stop = loop {
        tokio::select! {
            readable = ring.readable_mut() => {
                let mut guard = readable.map_err(|e| Error::Events(e.to_string()))?;
                drain(guard.get_inner_mut(), &mut tracked);
                guard.clear_ready();
            }
            _ = sleep_until(deadline) => break Stop::Duration,
            _ = interrupt.recv() => break Stop::Interrupted,
            _ = terminate.recv() => break Stop::Terminated,
            Some(pid) = exit_rx.recv() => {
                drain(ring.get_mut(), &mut tracked);
                if let Some(t) = tracked.get_mut(&pid) {
                    t.exited = true;
                    let path = write_profile(&mut output, t)?;
                    let _ = writeln!(status, "{}memprobe: process {pid} exited; wrote its final profile {}", clear_line(options.progress), path.display());
                }
                if tracked.values().all(|t| t.exited) {
                    break Stop::AllExited;
                }
            }
            _ = ticker.tick() => {
                for t in tracked.values_mut().filter(|t| !t.exited) {
                    // Keep the last good copy: the process may be gone next time.
                    if let Ok(maps) = read_maps(t.target.pid) {
                        t.maps = maps;
                    }
                }
                if options.progress {
                    let _ = write!(status, "\r{}", progress_line(started.elapsed(), &tracked, &probes));
                    let _ = status.flush();
                }
            }
        }
    };
    drain(ring.get_mut(), &mut tracked);
    let elapsed = started.elapsed();
    if options.progress {
        let _ = write!(status, "{}", clear_line(true));
    }
    if options.verbose {
        let reason = match stop {
            Stop::Duration => "duration reached",
            Stop::Interrupted => "interrupted",
            Stop::Terminated => "terminated",
            Stop::AllExited => "every process exited",
        };
        let _ = writeln!(status, "memprobe: stopping: {reason}");
    }
    for t in tracked.values_mut().filter(|t| !t.exited) {
        write_profile(&mut output, t)?;
    }
    let kernel_counters = probes.counters().to_vec();
    let probe_count = probes.attached.len();
    // Detach before reporting: the target runs unprobed from here on.
    drop(ring);
    drop(probes);
    let processes = tracked
        .into_values()
        .map(|t| ProcessSummary {
            pid: t.target.pid,
            command: t.target.command,
            samples: t.heap.samples,
            inuse_bytes: t.heap.inuse_bytes(),
            files: t.files,
            drops: t.heap.drops,
            exited: t.exited,
        })
        .collect();
    Ok(Summary {
        processes,
        probes: probe_count,
        elapsed,
        kernel_counters,
    })
}

fn clear_line(progress: bool) -> &'static str {
    if progress { "\r\x1b[2K" } else { "" }
}

async fn sleep_until(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}

fn drain(ring: &mut RingBuf<MapData>, tracked: &mut BTreeMap<u32, Tracked>) {
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
        if let Some(t) = tracked.get_mut(&pid) {
            t.heap.apply(event);
        }
    }
}

fn write_profile(output: &mut OutputDir, t: &mut Tracked) -> Result<PathBuf> {
    let profile = t.heap.snapshot(t.maps.clone());
    let seq = output.next_seq(t.target.pid);
    let path = output
        .write_file(t.target.pid, seq, "heap", |w| heap_v2::write(&profile, w))
        .map_err(|source| Error::Write {
            path: output
                .path()
                .join(crate::output::files::file_name(t.target.pid, seq, "heap")),
            source,
        })?;
    t.files.push(path.clone());
    Ok(path)
}

fn progress_line(
    elapsed: Duration,
    tracked: &BTreeMap<u32, Tracked>,
    probes: &KernelProbes,
) -> String {
    let samples: u64 = tracked.values().map(|t| t.heap.samples).sum();
    let inuse: f64 = tracked.values().map(|t| t.heap.inuse_bytes()).sum();
    let counters = probes.counters();
    let kernel_drops = counters[profiler_common::Counter::RingBufferFull as usize]
        + counters[profiler_common::Counter::SampledSetFull as usize];
    let user_drops: u64 = tracked
        .values()
        .map(|t| t.heap.drops.live_table_full + t.heap.drops.stack_table_full)
        .sum();
    format!(
        "memprobe: {} elapsed, {samples} samples, ~{} in use, {} dropped",
        humantime::format_duration(Duration::from_secs(elapsed.as_secs())),
        crate::format::bytes(inuse),
        kernel_drops + user_drops
    )
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
    use profiler_common::Counter;
    let per_second = |n: u64| n as f64 / summary.elapsed.as_secs_f64().max(1e-3);
    lines.push(format!(
        "memprobe: detached {} probes after {}; {} allocation calls ({:.0}/s), {} sampled, {} free calls",
        summary.probes,
        humantime::format_duration(Duration::from_millis(summary.elapsed.as_millis() as u64)),
        counters[Counter::AllocCalls as usize],
        per_second(counters[Counter::AllocCalls as usize]),
        counters[Counter::SampledCalls as usize],
        counters[Counter::FreeCalls as usize],
    ));
    let kernel_drops = [
        (Counter::RingBufferFull, "ring buffer full"),
        (Counter::SampledSetFull, "kernel pointer set full"),
        (Counter::PendingFull, "pending table full"),
        (Counter::StackErrors, "stack unreadable"),
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
        lines.push(format!(
            "memprobe: pid {} ({}){}: {} samples, ~{} in use, {} dropped; wrote {}",
            p.pid,
            p.command,
            if p.exited { " exited" } else { "" },
            p.samples,
            crate::format::bytes(p.inuse_bytes),
            drops,
            files.join(", ")
        ));
    }
    lines
}

/// Per-process samples by pid, for tests and reports.
pub fn samples_by_pid(summary: &Summary) -> HashMap<u32, u64> {
    summary
        .processes
        .iter()
        .map(|p| (p.pid, p.samples))
        .collect()
}
