//! The summary at the end of a run: per process, what it gave and where
//! it went; what the kernel dropped; what the probes cost.
use std::{path::PathBuf, time::Duration};

use profiler_common::Counter;

use crate::{
    kernel::{KernelCounters, KernelProbes},
    profile::{Drops, MemoryAccount},
    run::{
        SessionOptions,
        budget::Budget,
        cost::{CostLedger, CostModel, ProbeCost, rates},
        process::Tracked,
        snapshots::ProcessSnapshots,
    },
};

/// What happened to one process.
#[derive(Clone, Debug)]
pub struct ProcessSummary {
    pub pid: u32,
    pub container_pid: Option<u32>,
    pub command: String,
    pub samples: u64,
    /// Bytes in use; `None` where no free was tracked over the run
    /// (`--track allocations`), where only what was allocated is known.
    pub inuse_bytes: Option<f64>,
    pub allocated_bytes: f64,
    pub files: Vec<PathBuf>,
    /// The `heap_v2` snapshots among `files`, in order.
    pub heaps: Vec<PathBuf>,
    pub drops: Drops,
    pub exited: bool,
    /// Probes detached for costing more than `--max-overhead`.
    pub detached: Option<usize>,
    /// Its `# tracking:` note, once the budget dropped its frees or
    /// detached its allocators' probes.
    pub tracking: Option<String>,
    /// `--interval` snapshots skipped while earlier ones were still to be
    /// written.
    pub skipped_snapshots: u64,
    /// Old snapshots removed for `--keep` or `--max-disk`.
    pub removed_snapshots: u64,
    /// Its allocators ("glibc in libc.so.6") and their allocation calls
    /// (`None` where system-wide probes do not tell processes apart).
    pub allocator_calls: Vec<(String, Option<u64>)>,
    /// Its resident memory accounted for, as of its last snapshot that
    /// could read it.
    pub memory: Option<MemoryAccount>,
    /// Bytes it allocated after its threads' last windows, counted in the
    /// shape of their samples there (see `windows::tails`).
    pub after_last_windows: u64,
}

/// The share of what a process allocated that, counted after its threads'
/// last windows, gets a line of its own: past it, a program that changed
/// what it allocates after its last window (a batch job's last phase, run
/// unprobed once its window closed) may be shown largely as it was.
const AFTER_LAST_WINDOWS_SAID: f64 = 0.25;

impl ProcessSummary {
    /// `after_last_windows`: see [`Self::after_last_windows`].
    pub(super) fn of(
        t: Tracked,
        snapshots: ProcessSnapshots,
        budget: &Budget,
        after_last_windows: u64,
    ) -> Self {
        let removed_snapshots = snapshots.removed();
        let tracking = budget.tracking_note(t.pid);
        // In use means something where frees were followed, if only until
        // the budget dropped them (not under `--track allocations`).
        let frees_tracked = !t.heap.allocations_only() || budget.frees_dropped(t.pid);
        Self {
            pid: t.pid,
            container_pid: t.container_pid,
            command: t.command,
            samples: t.heap.samples,
            inuse_bytes: frees_tracked.then(|| t.heap.inuse_bytes()),
            allocated_bytes: t.heap.alloc_bytes(),
            files: snapshots.files,
            heaps: snapshots.heaps,
            drops: t.heap.drops,
            exited: t.exited,
            detached: budget.detached(t.pid),
            tracking,
            skipped_snapshots: snapshots.skipped,
            removed_snapshots,
            allocator_calls: t.allocator_calls,
            memory: snapshots.account,
            after_last_windows,
        }
    }
}

#[derive(Clone, Debug)]
pub struct Summary {
    pub processes: Vec<ProcessSummary>,
    pub probes: usize,
    pub elapsed: Duration,
    pub kernel_counters: KernelCounters,
    /// In launch mode: the command's exit code (128 + signal if killed).
    pub exit_code: Option<i32>,
    /// Hits and estimated cost per entry point, busiest first.
    pub probe_costs: Vec<ProbeCost>,
    /// Context switches of main threads that carried perf-event probes,
    /// and the time those added (see `CostModel::switch_per_event`).
    pub switch_cost: (u64, Duration),
    /// The per-hit costs the estimate used.
    pub cost_model: CostModel,
    /// How calls got their return half, and why.
    pub return_probes: String,
    /// Where the files went, and whether to list each one.
    pub output_dir: PathBuf,
    pub verbose: bool,
}

impl Summary {
    /// What the probes did and cost over a run of `elapsed`, read before
    /// they are detached; its processes and exit code are filled later.
    pub(super) fn of_probes(
        probes: &KernelProbes,
        ledger: &CostLedger,
        cost_model: CostModel,
        elapsed: Duration,
        options: &SessionOptions,
    ) -> Self {
        Self {
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
        }
    }
}

/// "wrote 6 snapshots to DIR (6 heap, 6 pb.gz, ...)": the folder and a
/// count per format; `--verbose` lists the files.
fn files_written(files: &[PathBuf], dir: &std::path::Path, removed: u64) -> String {
    let mut per_format: Vec<(String, usize)> = Vec::new();
    for file in files {
        let name = file.file_name().unwrap_or_default().to_string_lossy();
        // memprobe.<pid>.<seq>.<ext>, where ext may hold dots (pb.gz).
        let ext = name.splitn(4, '.').nth(3).unwrap_or("").to_owned();
        match per_format.iter_mut().find(|(e, _)| *e == ext) {
            Some((_, n)) => *n += 1,
            None => per_format.push((ext, 1)),
        }
    }
    let snapshots = per_format.iter().map(|(_, n)| *n).max().unwrap_or(0);
    let counts: Vec<String> = per_format.iter().map(|(e, n)| format!("{n} {e}")).collect();
    let removed = match removed {
        0 => String::new(),
        n => format!("; removed {n} older ones (--keep, --max-disk)"),
    };
    format!(
        "wrote {} snapshot{} to {} ({}){removed}",
        snapshots,
        if snapshots == 1 { "" } else { "s" },
        dir.display(),
        counts.join(", ")
    )
}

/// "memprobe: kernel drops: ..." when the kernel dropped anything.
fn kernel_drops_line(counters: &KernelCounters) -> Option<String> {
    let kernel_drops = [
        (Counter::RingBufferFull, "ring buffer full"),
        (
            Counter::FreesPutOff,
            "frees of sampled pointers told late (ring buffer full: each at its address's next \
             free)",
        ),
        (Counter::SampledSetFull, "kernel pointer set full"),
        (Counter::PendingFull, "pending table full"),
        (Counter::StackErrors, "stack unreadable"),
        (
            Counter::WindowsThinned,
            "windows sampled as sparsely as at entry from when the ring buffer was half full \
             (a thread's, to the window's end)",
        ),
        (
            Counter::CrowdedCalls,
            "windowed calls sampled 8 times sparser (ring buffer three quarters full)",
        ),
        (
            Counter::SmallStackCopies,
            "sent with a small stack copy (ring buffer over half full)",
        ),
        (
            Counter::StackCopiesSkipped,
            "sent without a stack copy (ring buffer three quarters full; frame pointers only)",
        ),
        (
            Counter::PythonStacksLost,
            "sent without their Python frames (ring buffer full)",
        ),
        (
            Counter::ExitsLost,
            "thread exits untold (their table full: what each allocated after its last window is \
             in no profile)",
        ),
    ];
    let dropped: Vec<String> = kernel_drops
        .iter()
        .filter(|(c, _)| counters.get(*c) > 0)
        .map(|(c, what)| format!("{} {what}", counters.get(*c)))
        .collect();
    let remedy = if counters.get(Counter::RingBufferFull) + counters.get(Counter::FreesPutOff) > 0 {
        " (a larger --ring-buffer loses fewer)"
    } else {
        ""
    };
    (!dropped.is_empty()).then(|| format!("memprobe: kernel drops: {}{remedy}", dropped.join(", ")))
}

/// "memprobe: pid N: no allocation call seen through ..." when its
/// allocators were probed and none was called.
fn uncalled_allocators_line(p: &ProcessSummary) -> Option<String> {
    let counted: Vec<u64> = p.allocator_calls.iter().filter_map(|(_, n)| *n).collect();
    if counted.is_empty() || counted.iter().any(|&n| n > 0) {
        return None;
    }
    let found: Vec<&str> = p.allocator_calls.iter().map(|(l, _)| l.as_str()).collect();
    Some(format!(
        "memprobe: pid {}: no allocation call seen through the allocators found ({}): it \
         allocates through another allocator, or was idle",
        p.pid,
        found.join(", ")
    ))
}

/// "memprobe: pid N: X of the Y it allocated (Z%) came after ..." where
/// that share is past [`AFTER_LAST_WINDOWS_SAID`].
fn after_last_windows_line(p: &ProcessSummary) -> Option<String> {
    let after = p.after_last_windows as f64;
    let share = after / p.allocated_bytes.max(1.0);
    (share > AFTER_LAST_WINDOWS_SAID).then(|| {
        format!(
            "memprobe: pid {}: {} of the {} it allocated ({:.0}%) came after its threads' last \
             windows and is counted where their samples there were: what it allocated \
             otherwise since is not seen (--sampling entry sees every call)",
            p.pid,
            crate::units::bytes(after),
            crate::units::bytes(p.allocated_bytes),
            100.0 * share.min(1.0)
        )
    })
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
        counters.get(Counter::AllocCalls),
        per_second(counters.get(Counter::AllocCalls)),
        counters.get(Counter::SampledCalls),
        counters.get(Counter::FreeCalls),
        counters.get(Counter::ReturnHalves),
    ));
    lines.extend(kernel_drops_line(counters));
    for p in &summary.processes {
        lines.extend(process_lines(p, summary));
    }
    lines.extend(cost_lines(summary));
    if let Some(code) = summary.exit_code {
        lines.push(format!("memprobe: the command exited with code {code}"));
    }
    lines
}

/// One process's lines in the summary: what it gave, and where it went.
fn process_lines(p: &ProcessSummary, summary: &Summary) -> Vec<String> {
    let mut lines = Vec::new();
    let d = p.drops;
    let drops = d.live_table_full + d.untracked_in_kernel + d.stack_table_full;
    let container = p
        .container_pid
        .map(|c| format!(", pid {c} in its container"))
        .unwrap_or_default();
    lines.push(format!(
        "memprobe: pid {} ({}{container}){}: {} samples, ~{}, {} dropped{}; {}",
        p.pid,
        p.command,
        match (p.detached, p.exited) {
            (Some(n), _) => format!(", {n} probes detached over --max-overhead"),
            (None, true) => ", exited".to_owned(),
            (None, false) => String::new(),
        },
        p.samples,
        match p.inuse_bytes {
            Some(bytes) => format!("{} in use", crate::units::bytes(bytes)),
            None => format!("{} allocated", crate::units::bytes(p.allocated_bytes)),
        },
        drops,
        match p.skipped_snapshots {
            0 => String::new(),
            n => format!(", {n} interval snapshots skipped while earlier ones were written"),
        },
        files_written(&p.files, &summary.output_dir, p.removed_snapshots)
    ));
    if let Some(tracking) = &p.tracking {
        lines.push(format!("memprobe: pid {}: tracking {tracking}", p.pid));
    }
    lines.extend(uncalled_allocators_line(p));
    lines.extend(after_last_windows_line(p));
    if let Some(account) = &p.memory {
        let account = account.lines();
        lines.extend(
            account
                .iter()
                .map(|l| format!("memprobe: pid {}: memory: {l}", p.pid)),
        );
    }
    if summary.verbose {
        lines.push(format!(
            "memprobe:   allocators: {}",
            super::targets::allocator_calls::describe(&p.allocator_calls)
        ));
        lines.extend(
            p.files
                .iter()
                .map(|f| format!("memprobe:   {}", f.display())),
        );
    }
    lines
}

/// What the probes cost: the hits, the switches perf-event probes rode
/// and the time they added; then what a hit costs on this host and how
/// the kernel runs the probes.
fn cost_lines(summary: &Summary) -> [String; 2] {
    let hits: u64 = summary.probe_costs.iter().map(|c| c.hits).sum();
    let (switches, switched) = summary.switch_cost;
    let added = summary
        .probe_costs
        .iter()
        .map(|c| c.added)
        .sum::<Duration>()
        + switched;
    let seconds = summary.elapsed.as_secs_f64().max(1e-3);
    let cost = format!(
        "memprobe: cost: {} probe hits ({}/s){}{}; estimated time added to the profiled \
         processes: {:.3} s ({:.1}% of one CPU)",
        hits,
        crate::run::cost::human_count(hits as f64 / seconds),
        if hits > 0 {
            format!(": {}", rates(&summary.probe_costs, summary.elapsed, 5))
        } else {
            String::new()
        },
        match switches {
            0 => String::new(),
            n => format!(
                "; {n} context switches of threads carrying perf-event probes ({:.3} s)",
                switched.as_secs_f64()
            ),
        },
        added.as_secs_f64(),
        100.0 * added.as_secs_f64() / seconds,
    );
    let how = format!(
        "memprobe: cost {}; return probes: {}",
        summary.cost_model, summary.return_probes,
    );
    [cost, how]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A process that allocated 24 MiB, `after` of it after its threads'
    /// last windows.
    fn allocated_after_windows(after: u64) -> ProcessSummary {
        ProcessSummary {
            pid: 7,
            container_pid: None,
            command: "sites".into(),
            samples: 100,
            inuse_bytes: None,
            allocated_bytes: 24.0 * 1048576.0,
            files: Vec::new(),
            heaps: Vec::new(),
            drops: Drops::default(),
            exited: false,
            detached: None,
            tracking: None,
            skipped_snapshots: 0,
            removed_snapshots: 0,
            allocator_calls: Vec::new(),
            memory: None,
            after_last_windows: after,
        }
    }

    #[test]
    fn much_allocated_after_the_last_windows_is_said() {
        let line = after_last_windows_line(&allocated_after_windows(18 << 20)).unwrap();
        assert!(
            line.starts_with("memprobe: pid 7: 18.0 MiB of the 24.0 MiB it allocated (75%)"),
            "{line}"
        );
        assert!(
            line.ends_with("(--sampling entry sees every call)"),
            "{line}"
        );
        // A server's tail since its last window, one gap's worth, is not.
        assert_eq!(
            after_last_windows_line(&allocated_after_windows(1 << 20)),
            None
        );
        assert_eq!(after_last_windows_line(&allocated_after_windows(0)), None);
    }

    #[test]
    fn files_are_counted_by_format_in_their_folder() {
        let files: Vec<PathBuf> = ["heap", "pb.gz", "sym.heap"]
            .iter()
            .flat_map(|ext| {
                (0..2).map(move |seq| PathBuf::from(format!("/o/memprobe.7.{seq}.{ext}")))
            })
            .collect();
        assert_eq!(
            files_written(&files, std::path::Path::new("/o"), 0),
            "wrote 2 snapshots to /o (2 heap, 2 pb.gz, 2 sym.heap)"
        );
    }
}
