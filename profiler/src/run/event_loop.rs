//! The run's loop: events drained as they come, snapshots on signals,
//! timers and requests, windows opened and closed when due, and once a
//! rescan interval a tick of the run's parts, until a reason to stop.
use std::process::ExitStatus;

use aya::maps::{MapData, RingBuf};
use tokio::{io::unix::AsyncFd, sync::mpsc};

use crate::{
    error::Result,
    run::{
        Session,
        cost::CostLedger,
        events_error,
        snapshots::SnapshotKind,
        targets::checked::LaunchedCommand,
        waits::{Signals, next_request, sleep_until, tick_of, wait_launched},
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

impl Session<'_> {
    /// Drains events, takes snapshots and rescans until a reason to stop.
    pub(super) async fn collect(
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
                    if all_gone && self.scope.ends_when_all_exit() {
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
                    if all_done && self.scope.ends_when_all_exit() {
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
}
