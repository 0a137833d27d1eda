//! `--keep N` and `--max-disk SIZE`: a long unattended run keeps a bounded
//! number and size of snapshots per process, removing the oldest first and
//! never the newest.
use std::{collections::VecDeque, path::PathBuf};

/// The bounds; `None` for no bound.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Retention {
    /// Snapshots kept per process.
    pub keep: Option<usize>,
    /// Bytes of snapshot files kept per process.
    pub max_disk: Option<u64>,
}

/// One process's snapshots on disk, oldest first.
#[derive(Debug, Default)]
pub(in crate::run) struct KeptSnapshots {
    snapshots: VecDeque<(Vec<PathBuf>, u64)>,
    bytes: u64,
    /// Snapshots removed to stay within the bounds.
    pub removed: u64,
}

impl KeptSnapshots {
    /// Adds a snapshot's files; returns the files of the snapshots removed
    /// to make room (already deleted from disk).
    pub fn add(&mut self, files: Vec<PathBuf>, retention: Retention) -> Vec<PathBuf> {
        let size: u64 = files
            .iter()
            .filter_map(|f| std::fs::symlink_metadata(f).ok())
            .map(|m| m.len())
            .sum();
        self.snapshots.push_back((files, size));
        self.bytes += size;
        let mut removed = Vec::new();
        while self.snapshots.len() > 1 && self.over(retention) {
            let Some((files, size)) = self.snapshots.pop_front() else {
                break;
            };
            for file in &files {
                // Our own file in our own folder; a link put in its place
                // is removed as a link.
                let _ = std::fs::remove_file(file);
            }
            self.bytes -= size;
            self.removed += 1;
            removed.extend(files);
        }
        removed
    }

    fn over(&self, retention: Retention) -> bool {
        retention
            .keep
            .is_some_and(|keep| self.snapshots.len() > keep)
            || retention.max_disk.is_some_and(|max| self.bytes > max)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn oldest_go_first_and_the_newest_always_stays() {
        let dir = std::env::temp_dir().join(format!("memprobe-keep-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = |n: u32, bytes: usize| {
            let path = dir.join(format!("memprobe.1.{n}.heap"));
            std::fs::write(&path, vec![b'x'; bytes]).unwrap();
            path
        };
        let keep_two = Retention {
            keep: Some(2),
            max_disk: None,
        };
        let mut kept = KeptSnapshots::default();
        assert!(kept.add(vec![file(0, 10)], keep_two).is_empty());
        assert!(kept.add(vec![file(1, 10)], keep_two).is_empty());
        assert_eq!(
            kept.add(vec![file(2, 10)], keep_two),
            vec![dir.join("memprobe.1.0.heap")]
        );
        assert!(!dir.join("memprobe.1.0.heap").exists());
        // A size bound smaller than one snapshot still keeps the newest.
        let tiny = Retention {
            keep: None,
            max_disk: Some(5),
        };
        assert_eq!(kept.add(vec![file(3, 10)], tiny).len(), 2);
        assert!(dir.join("memprobe.1.3.heap").exists());
        assert_eq!(kept.removed, 3);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
