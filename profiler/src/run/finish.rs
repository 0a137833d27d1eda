//! The end of a run: the last windows and snapshots, the probes detached
//! before anything else, the writer finished, a launched command waited
//! for, and the summary.
use std::process::ExitStatus;

use aya::maps::{MapData, RingBuf};
use tokio::io::unix::AsyncFd;

use crate::{
    error::{Error, Result},
    run::{
        ProcessSummary, Session, Summary,
        event_loop::Stop,
        snapshots::SnapshotKind,
        targets::checked::LaunchedCommand,
        waits::{exit_code_of, wait_for_command},
    },
};

impl Session<'_> {
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

    /// What the ring still holds, the last windows, and every process's
    /// last snapshot (owned data: the probes can go before it is written).
    async fn take_last_snapshots(&mut self, stop: &Stop, ring: &mut AsyncFd<RingBuf<MapData>>) {
        self.drain(ring.get_mut());
        self.clear_progress();
        if self.options.verbose {
            self.say_why_stopping(stop);
        }
        self.last_windows(ring).await;
        self.snapshot_all("end of run", SnapshotKind::Last);
    }

    /// The last snapshots, detaching, waiting for a launched command, and
    /// the summary.
    pub(super) async fn finish(
        mut self,
        stop: Stop,
        mut ring: AsyncFd<RingBuf<MapData>>,
        launched: Option<LaunchedCommand>,
        exit_status: Option<std::io::Result<ExitStatus>>,
    ) -> Result<Summary> {
        let elapsed = self.started.elapsed();
        self.take_last_snapshots(&stop, &mut ring).await;
        let Session {
            probes,
            tracked,
            status,
            mut snapshots,
            options,
            mut costs,
            budget,
            sampling,
            ..
        } = self;
        costs.price(&probes);
        let mut summary =
            Summary::of_probes(&probes, &costs.ledger, costs.model, elapsed, &options);
        // Detach before anything else: the targets run unprobed from here on.
        drop(ring);
        drop(probes);
        if !snapshots.writer.is_idle() && options.progress {
            let _ = writeln!(status, "memprobe: detached; writing the last snapshots");
        }
        for done in snapshots.writer.finish() {
            snapshots.record(done, status, options.progress)?;
        }
        summary.processes = tracked
            .into_values()
            .map(|t| (snapshots.take(t.pid), t))
            .filter(|(written, _)| !written.files.is_empty())
            .map(|(written, t)| {
                let after = (sampling.windows(t.pid)).map_or(0, |w| w.counted_after_last_windows());
                ProcessSummary::of(t, written, &budget, after)
            })
            .collect();
        if let Some(launched) = launched {
            let exit = wait_for_command(launched, &stop, exit_status, status).await;
            let exit = exit.map_err(|cause| Error::Launch {
                program: options.targets.command_program(),
                cause,
            })?;
            summary.exit_code = Some(exit_code_of(exit));
        }
        Ok(summary)
    }
}
