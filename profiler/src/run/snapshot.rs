//! Snapshots: a process's profile written in every format asked for, when
//! it exits, on a timer, on SIGUSR1 and on growth.
use std::{
    path::PathBuf,
    time::{Duration, Instant},
};

use crate::{
    error::{Error, Result},
    output::{self, Format, files::file_name},
    run::Session,
    symbolize::{Namer, perfmap},
};

impl Session<'_> {
    pub(super) fn process_exited(&mut self, pid: u32) -> Result<()> {
        let Some(t) = self.tracked.get_mut(&pid) else {
            return Ok(());
        };
        if t.exited {
            return Ok(());
        }
        t.exited = true;
        // Its pid may come back as another program.
        t.stacks.reset_trust();
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
    pub(super) fn snapshot_all(&mut self, reason: &str) -> Result<()> {
        for pid in self.live_pids() {
            self.write_profile(pid, reason)?;
        }
        Ok(())
    }

    /// `--dump-on-growth`: a snapshot of each process whose estimated
    /// in-use bytes grew by the trigger's size within its window.
    pub(super) fn check_growth(&mut self) -> Result<()> {
        let Some(trigger) = self.options.dump_on_growth else {
            return Ok(());
        };
        let now = Instant::now();
        let min_gap = self.options.min_dump_gap;
        let due: Vec<(u32, String)> = self
            .tracked
            .values_mut()
            .filter(|t| !t.exited)
            .filter_map(|t| {
                let inuse = t.heap.inuse_bytes();
                Some((t.pid, t.growth.observe(now, inuse, trigger, min_gap)?))
            })
            .collect();
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
            perfmap::request_from_hotspot(pid, Duration::from_secs(10));
            let symbols = perfmap::read_for_process(pid, t.container_pid.unwrap_or(pid));
            if let Some((_, namer)) = t.namer.as_mut() {
                namer.set_jit(symbols);
            }
        }
        let mut first = None;
        for &format in &self.options.formats {
            let ext = format.extension();
            let namer = t.namer.as_mut().map(|(_, n)| n);
            let written = self.output.write_file(pid, seq, ext, |w| {
                output::write_format(format, &profile, namer, w)
            });
            let path = written.map_err(|cause| Error::Write {
                path: self.output.path().join(file_name(pid, seq, ext)),
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
}
