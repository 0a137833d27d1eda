//! What a profile says of itself: who it is of, why it was taken, how its
//! allocations were found, sampled and tracked, and what was dropped;
//! written where each format keeps comments (`# key: value` lines in
//! `heap_v2`, which jeprof skips; pprof's comments), and read back.
use crate::profile::Drops;

#[derive(Clone, Debug, Default, PartialEq)]
pub struct ProfileNotes {
    /// The process's command name.
    pub command: Option<String>,
    /// Why the snapshot was taken.
    pub reason: Option<String>,
    /// Its number among the process's snapshots, and its seconds since the
    /// probes were attached.
    pub snapshot: Option<u64>,
    pub elapsed_s: Option<f64>,
    /// The process's pid inside its container.
    pub container_pid: Option<u32>,
    /// Each allocator probed, with its allocation calls.
    pub allocators: Option<String>,
    /// How allocator copies were found where no symbol named them.
    pub allocator: Option<String>,
    /// How jemalloc's `malloc` was sampled (in windows, at entry, by its
    /// own profiler).
    pub malloc_sampling: Option<String>,
    /// Whether frees were followed (`--track allocations`, the budget).
    pub tracking: Option<String>,
    /// The CPython it runs, and whether its frames were read.
    pub python: Option<String>,
    /// Periodic snapshots skipped while earlier ones were written.
    pub skipped_snapshots: Option<u64>,
    /// Samples taken, and what was lost or how stacks were walked.
    pub samples: Option<u64>,
    pub drops: Drops,
    /// For a profile of the change over a span (the endpoints' `seconds`).
    pub delta_seconds: Option<u64>,
    /// Notes memprobe does not know, kept as read (another version's).
    pub other: Vec<(String, String)>,
}

impl ProfileNotes {
    /// Each note that is set, as `(key, value)`, in the order written.
    pub fn lines(&self) -> Vec<(String, String)> {
        let mut lines: Vec<(&str, Option<String>)> = vec![
            ("command", self.command.clone()),
            ("reason", self.reason.clone()),
            ("snapshot", self.snapshot.map(|n| n.to_string())),
            ("elapsed_s", self.elapsed_s.map(|s| format!("{s:.3}"))),
            ("container_pid", self.container_pid.map(|p| p.to_string())),
            ("allocators", self.allocators.clone()),
            ("allocator", self.allocator.clone()),
            ("malloc_sampling", self.malloc_sampling.clone()),
            ("tracking", self.tracking.clone()),
            ("python", self.python.clone()),
            (
                "skipped_snapshots",
                self.skipped_snapshots.map(|n| n.to_string()),
            ),
            ("memprobe_samples", self.samples.map(|n| n.to_string())),
        ];
        for (key, count) in self.drop_counts() {
            lines.push((key, (count > 0).then(|| count.to_string())));
        }
        lines.push(("delta_seconds", self.delta_seconds.map(|s| s.to_string())));
        lines
            .into_iter()
            .filter_map(|(key, value)| Some((key.to_owned(), value?)))
            .chain(self.other.iter().cloned())
            .collect()
    }

    /// Takes one `key: value` note read back.
    pub fn read(&mut self, key: &str, value: &str) {
        let text = || Some(value.to_owned());
        match key {
            "command" => self.command = text(),
            "reason" => self.reason = text(),
            "snapshot" => self.snapshot = value.parse().ok(),
            "elapsed_s" => self.elapsed_s = value.parse().ok(),
            "container_pid" => self.container_pid = value.parse().ok(),
            "allocators" => self.allocators = text(),
            "allocator" => self.allocator = text(),
            "malloc_sampling" => self.malloc_sampling = text(),
            "tracking" => self.tracking = text(),
            "python" => self.python = text(),
            "skipped_snapshots" => self.skipped_snapshots = value.parse().ok(),
            "memprobe_samples" => self.samples = value.parse().ok(),
            "delta_seconds" => self.delta_seconds = value.parse().ok(),
            _ => match self.drop_count(key) {
                Some(count) => *count = value.parse().unwrap_or(0),
                None => self.other.push((key.to_owned(), value.to_owned())),
            },
        }
    }

    /// Each drop counter and its note's key.
    fn drop_counts(&self) -> [(&'static str, u64); 10] {
        let d = &self.drops;
        [
            ("dropped_live_table_full", d.live_table_full),
            ("dropped_untracked_in_kernel", d.untracked_in_kernel),
            ("dropped_stack_table_full", d.stack_table_full),
            ("dropped_unmatched_returns", d.unmatched_returns),
            ("stack_errors", d.stack_errors),
            ("callers_hidden_by_other_uretprobes", d.trampoline_callers),
            ("stacks_unwound_by_dwarf", d.dwarf_unwound),
            ("stacks_truncated", d.truncated_stacks),
            ("stacks_by_trusted_frame_pointers", d.trusted_frame_pointers),
            ("python_frames_dropped", d.python_frames_dropped),
        ]
    }

    fn drop_count(&mut self, key: &str) -> Option<&mut u64> {
        let d = &mut self.drops;
        Some(match key {
            "dropped_live_table_full" => &mut d.live_table_full,
            "dropped_untracked_in_kernel" => &mut d.untracked_in_kernel,
            "dropped_stack_table_full" => &mut d.stack_table_full,
            "dropped_unmatched_returns" => &mut d.unmatched_returns,
            "stack_errors" => &mut d.stack_errors,
            "callers_hidden_by_other_uretprobes" => &mut d.trampoline_callers,
            "stacks_unwound_by_dwarf" => &mut d.dwarf_unwound,
            "stacks_truncated" => &mut d.truncated_stacks,
            "stacks_by_trusted_frame_pointers" => &mut d.trusted_frame_pointers,
            "python_frames_dropped" => &mut d.python_frames_dropped,
            _ => return None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notes_read_back_as_written() {
        let notes = ProfileNotes {
            command: Some("redis-server".into()),
            reason: Some("interval".into()),
            snapshot: Some(3),
            elapsed_s: Some(12.5),
            samples: Some(42),
            python: Some("3.11.2 (/usr/bin/python3.11), frames read".into()),
            drops: Drops {
                stack_errors: 2,
                python_frames_dropped: 1,
                ..Drops::default()
            },
            other: vec![("from_elsewhere".into(), "1".into())],
            ..ProfileNotes::default()
        };
        let lines = notes.lines();
        assert_eq!(lines[0], ("command".into(), "redis-server".into()));
        assert!(lines.contains(&("elapsed_s".into(), "12.500".into())));
        // Counters at zero are not written.
        assert!(!lines.iter().any(|(k, _)| k == "dropped_live_table_full"));
        let mut read = ProfileNotes::default();
        for (key, value) in &lines {
            read.read(key, value);
        }
        assert_eq!(read, notes);
    }
}
