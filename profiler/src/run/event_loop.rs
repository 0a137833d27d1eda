//! The run's loop: events drained as they come, snapshots on signals,
//! timers and requests, windows opened and closed when due, and once a
//! rescan interval a tick of the run's parts, until a reason to stop.
use std::process::ExitStatus;

use aya::maps::{MapData, RingBuf};
use tokio::{
    io::unix::{AsyncFd, AsyncFdReadyMutGuard},
    signal::unix::Signal,
    sync::mpsc,
};

use crate::{
    error::Result,
    run::{
        Session, SessionOptions,
        cost::CostLedger,
        events_error,
        publish::Publishing,
        snapshots::SnapshotKind,
        targets::checked::LaunchedCommand,
        waits::{Signals, sleep_until, tick_of, wait_launched},
    },
};

/// Why the run stopped.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Stop {
    Duration,
    Signal(i32),
    AllExited,
}

/// Ticks between two readings of other tools' links (`kernel::foreign`).
const FOREIGN_LINKS_EVERY: u64 = 10;

/// How often the ring is drained without being woken: the frequent
/// records wake memprobe only once the ring fills past an eighth (a
/// wake-up costs the profiled thread more than its trap, see the eBPF
/// `ring` module), so this bounds how late the others are read.
const DRAIN_EVERY: std::time::Duration = std::time::Duration::from_millis(50);

/// What the loop waits on besides the ring, the processes and the
/// endpoints, and what its ticks keep.
struct Clocks {
    signals: Signals,
    /// `--interval`.
    snapshots: Option<tokio::time::Interval>,
    /// `--duration`.
    deadline: Option<tokio::time::Instant>,
    ticker: tokio::time::Interval,
    ticks: u64,
    /// [`DRAIN_EVERY`].
    drains: tokio::time::Interval,
    /// The costs as of the last `--verbose` rates.
    last_rates: CostLedger,
}

impl Clocks {
    fn new(options: &SessionOptions, signals: Signals) -> Result<Self> {
        let now = tokio::time::Instant::now();
        Ok(Self {
            signals,
            snapshots: options
                .snapshot_interval
                .map(|period| tokio::time::interval_at(now + period, period)),
            deadline: options.duration.map(|d| now + d),
            ticker: tokio::time::interval(options.rescan_interval),
            ticks: 0,
            drains: quiet_interval(DRAIN_EVERY),
            last_rates: CostLedger::default(),
        })
    }
}

/// A timer of `period` that skips the ticks a busy loop missed.
fn quiet_interval(period: std::time::Duration) -> tokio::time::Interval {
    let mut interval = tokio::time::interval(period);
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    interval
}

/// `--duration` reached, Ctrl-C or SIGTERM.
async fn stop(
    deadline: Option<tokio::time::Instant>,
    interrupt: &mut Signal,
    terminate: &mut Signal,
) -> Stop {
    tokio::select! {
        _ = sleep_until(deadline) => Stop::Duration,
        _ = interrupt.recv() => Stop::Signal(libc::SIGINT),
        _ = terminate.recv() => Stop::Signal(libc::SIGTERM),
    }
}

impl Session<'_> {
    /// Drains events, takes snapshots and rescans until a reason to stop.
    pub(super) async fn collect(
        &mut self,
        ring: &mut AsyncFd<RingBuf<MapData>>,
        mut launched: Option<&mut LaunchedCommand>,
        mut exit_rx: mpsc::UnboundedReceiver<u32>,
        signals: Signals,
    ) -> Result<(Stop, Option<std::io::Result<ExitStatus>>)> {
        let mut clocks = Clocks::new(&self.options, signals)?;
        loop {
            let window_change = self
                .next_window_change()
                .map(tokio::time::Instant::from_std);
            tokio::select! {
                readable = ring.readable_mut() => self.drain_ready(readable)?,
                stop = stop(clocks.deadline, &mut clocks.signals.interrupt, &mut clocks.signals.terminate) => {
                    return Ok((stop, None));
                }
                _ = clocks.signals.snapshot.recv() => {
                    self.drain(ring.get_mut());
                    self.snapshot_all("SIGUSR1", SnapshotKind::Requested);
                }
                _ = tick_of(&mut clocks.snapshots) => {
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
                    if self.nothing_left() {
                        return Ok((Stop::AllExited, None));
                    }
                }
                Some(request) = Publishing::next_request(self.publishing.as_mut()) => {
                    self.drain(ring.get_mut());
                    self.answer(request);
                }
                _ = sleep_until(window_change) => self.change_windows(ring.get_mut()),
                _ = clocks.drains.tick() => {
                    self.drain(ring.get_mut());
                }
                _ = clocks.ticker.tick() => {
                    self.drain(ring.get_mut());
                    self.tick(&mut clocks)?;
                    // Every process detached over budget: nothing to profile.
                    if self.nothing_left() {
                        return Ok((Stop::AllExited, None));
                    }
                }
            }
        }
    }

    /// Drains the ring once the kernel said it holds records.
    pub(in crate::run) fn drain_ready(
        &mut self,
        readable: std::io::Result<AsyncFdReadyMutGuard<'_, RingBuf<MapData>>>,
    ) -> Result<()> {
        let mut guard = readable.map_err(|e| events_error("reading the ring buffer", e))?;
        // Left ready while records remain: the kernel wakes a reader only
        // once it has caught up.
        if self.drain(guard.get_inner_mut()) {
            guard.clear_ready();
        }
        Ok(())
    }

    /// Whether the run has nothing left to profile: every named process
    /// exited or was detached.
    fn nothing_left(&self) -> bool {
        self.scope.ends_when_all_exit() && self.tracked.values().all(|t| t.exited)
    }

    /// Once a rescan interval, in this order: the probes' hits priced (the
    /// parts after judge what they cost), new libraries and processes,
    /// growth triggers, the budget, jemalloc's own profilers, silent
    /// allocators, the endpoints' figures, the snapshots written, and what
    /// a terminal or `--verbose` is told.
    fn tick(&mut self, clocks: &mut Clocks) -> Result<()> {
        if clocks.ticks.is_multiple_of(FOREIGN_LINKS_EVERY) {
            self.probes.read_foreign_links();
        }
        let forced = self.costs.price(&self.probes);
        self.say_forced_returns(&forced);
        self.keep_costs_measured();
        self.rescan()?;
        // Each part's answer is carried out before the next is asked: a
        // process the budget detaches is no longer watched.
        let grown = self.growth_actions();
        self.apply(grown);
        let over_budget = self.budget_actions();
        self.apply(over_budget);
        let switched = self.own_profiler_actions();
        self.apply(switched);
        self.end_frees_on_request();
        let silent = self.silence_actions();
        self.apply(silent);
        self.publish();
        self.record_written()?;
        self.keep_memory_read();
        clocks.ticks += 1;
        if self.options.verbose && clocks.ticks.is_multiple_of(10) {
            let period = self.options.rescan_interval * 10;
            clocks.last_rates = self.report_rates(&clocks.last_rates, period);
        }
        if self.options.progress {
            let line = self.progress_line(self.started.elapsed());
            let _ = write!(self.status, "\r\x1b[2K{line}");
            let _ = self.status.flush();
        }
        Ok(())
    }
}
