//! What a run says while it runs: the line scripts wait for, the status
//! line on a terminal, `--verbose` rates, forced returns.
use std::{collections::BTreeMap, time::Duration};

use profiler_common::Counter;

use crate::{
    kernel::Scope,
    run::{
        Session,
        cost::{CostLedger, rates},
        notice::CostNotice,
        process::Tracked,
        scope::RunScope,
    },
};

impl Session<'_> {
    /// The one line scripts wait for.
    pub(super) fn announce(&mut self) {
        let until = match (self.scope, self.options.duration) {
            (_, Some(d)) => format!("for {}", humantime::format_duration(d)),
            (RunScope::Launch, None) => "until it exits".into(),
            (RunScope::Pids, None) => "until Ctrl-C or until the processes exit".into(),
            (RunScope::All, None) => "until Ctrl-C".into(),
        };
        let probes = self.probes.attached.len();
        let line = match self.scope {
            RunScope::All if self.options.sampling == crate::run::Sampling::Windows => format!(
                "memprobe: attached {probes} probes to {} processes, each its own (jemalloc's \
                 malloc in windows), watching for more; profiling {until}",
                self.tracked.len()
            ),
            RunScope::All => format!(
                "memprobe: attached {probes} probes system-wide to {} allocators ({}) in {} \
                 processes, watching for more; profiling {until}",
                self.system_wide.len(),
                self.system_wide_kinds(),
                self.tracked.len()
            ),
            RunScope::Launch if probes == 0 => {
                let t = self.tracked.values().next();
                format!(
                    "memprobe: started pid {} ({}); no allocator in it yet, attaching when it \
                     loads one; profiling {until}",
                    t.map_or(0, |t| t.pid),
                    t.map_or("?", |t| t.command.as_str())
                )
            }
            _ => {
                let described: Vec<String> = self
                    .tracked
                    .values()
                    .map(|t| self.describe_target(t))
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

    /// "pid 42 (redis-server, jemalloc in /usr/lib/.../libjemalloc.so.2)".
    fn describe_target(&self, t: &Tracked) -> String {
        let mut libs: Vec<String> = self
            .probes
            .attached
            .iter()
            .filter(|p| p.scope == Scope::Process(t.pid))
            .map(|p| format!("{} in {}", p.allocator, p.path))
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
    }

    /// "glibc, jemalloc": the kinds of allocator probed system-wide.
    fn system_wide_kinds(&self) -> String {
        let mut kinds: Vec<_> = self.system_wide.iter().map(|(_, kind)| *kind).collect();
        kinds.sort();
        kinds.dedup();
        let names: Vec<&str> = kinds.iter().map(|k| k.name()).collect();
        names.join(", ")
    }

    /// Says, once per process and file, that the probes at `forced` (probe
    /// indexes) now trap at every return for another profiled process's
    /// probes at the same place (see `kernel::shared`).
    pub(super) fn say_forced_returns(&mut self, forced: &[usize]) {
        let mut by_file: BTreeMap<(u32, &str), Vec<String>> = BTreeMap::new();
        for probe in forced.iter().filter_map(|&i| self.probes.attached.get(i)) {
            if let Scope::Process(pid) = probe.scope {
                let symbols = by_file.entry((pid, &probe.path)).or_default();
                symbols.push(probe.symbol.clone());
            }
        }
        let notices: Vec<CostNotice> = by_file
            .into_iter()
            .map(|((pid, path), symbols)| CostNotice::ForcedReturns {
                pid,
                path: path.to_owned(),
                symbols,
            })
            .collect();
        for notice in notices {
            self.say(notice);
        }
    }

    pub(super) fn report_rates(&mut self, previous: &CostLedger, period: Duration) -> CostLedger {
        let recent = self.costs.ledger.since(previous);
        let costs = recent.costs(&self.probes.attached);
        let (switches, switched) = recent.switch_costs();
        let added = costs.iter().map(|c| c.added).sum::<Duration>() + switched;
        self.clear_progress();
        let _ = writeln!(
            self.status,
            "memprobe: probe hits: {}{}; ~{:.1}% of a CPU added to the targets",
            if costs.is_empty() {
                "none".to_owned()
            } else {
                rates(&costs, period, 6)
            },
            match switches {
                0 => String::new(),
                n => format!(
                    "; context switches of threads carrying perf-event probes: {}/s",
                    crate::run::cost::human_count(n as f64 / period.as_secs_f64())
                ),
            },
            100.0 * added.as_secs_f64() / period.as_secs_f64()
        );
        self.costs.ledger.clone()
    }

    pub(super) fn clear_progress(&mut self) {
        if self.options.progress {
            let _ = write!(self.status, "\r\x1b[2K");
        }
    }

    pub(super) fn progress_line(&self, elapsed: Duration) -> String {
        let samples: u64 = self.tracked.values().map(|t| t.heap.samples).sum();
        // No free tracked (`--track allocations`): what was allocated.
        let (heap, measure) = if self.options.collector.allocations_only {
            let allocated = self.tracked.values().map(|t| t.heap.alloc_bytes());
            (allocated.sum::<f64>(), "allocated")
        } else {
            let inuse = self.tracked.values().map(|t| t.heap.inuse_bytes());
            (inuse.sum::<f64>(), "in use")
        };
        let counters = self.probes.counters();
        let kernel_drops =
            counters.get(Counter::RingBufferFull) + counters.get(Counter::SampledSetFull);
        let user_drops: u64 = self
            .tracked
            .values()
            .map(|t| t.heap.drops.live_table_full + t.heap.drops.stack_table_full)
            .sum();
        let snapshots = self.snapshots.written();
        format!(
            "memprobe: {} elapsed, {} processes, {samples} samples, ~{} {measure}, {} dropped, \
             {snapshots} snapshots written",
            humantime::format_duration(Duration::from_secs(elapsed.as_secs())),
            self.tracked.values().filter(|t| !t.exited).count(),
            crate::units::bytes(heap),
            kernel_drops + user_drops
        )
    }
}
