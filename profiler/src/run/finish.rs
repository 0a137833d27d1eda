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

    /// The last snapshots, detaching, waiting for a launched command, and
    /// the summary.
    pub(super) async fn finish(
        mut self,
        stop: Stop,
        mut ring: AsyncFd<RingBuf<MapData>>,
        launched: Option<LaunchedCommand>,
        exit_status: Option<std::io::Result<ExitStatus>>,
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
            tracked,
            status,
            mut snapshots,
            options,
            cost_model,
            mut ledger,
            budget,
            ..
        } = self;
        ledger.update(&cost_model, &probes);
        let mut summary = Summary {
            processes: Vec::new(),
            probes: probes.attached_now(),
            elapsed,
            kernel_counters: probes.counters(),
            exit_code: None,
            probe_costs: ledger.costs(&probes.attached),
            switch_cost: ledger.switch_costs(),
            cost_model,
            return_probes: probes.return_probes_used(),
            output_dir: options.output_dir.clone(),
            verbose: options.verbose,
        };
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
            .map(|(written, t)| ProcessSummary::of(t, written, &budget))
            .collect();
        summary.exit_code = match launched {
            Some(launched) => {
                let exit = wait_for_command(launched, &stop, exit_status, status).await;
                let status = exit.map_err(|cause| Error::Launch {
                    program: options.targets.command_program(),
                    cause,
                })?;
                Some(exit_code_of(status))
            }
            None => None,
        };
        Ok(summary)
    }
}
