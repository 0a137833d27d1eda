//! Placing outputs on disk: atomically (a temporary file, then a rename
//! that never replaces), never through a symlink, never over an existing file.
use crate::output::WriteError;
use std::{
    collections::HashMap,
    ffi::CString,
    fs::{File, OpenOptions},
    io::{self, BufWriter, Write},
    os::unix::{ffi::OsStrExt, fs::OpenOptionsExt},
    path::{Path, PathBuf},
};

/// The output folder of a run, and the next sequence number per process.
#[derive(Clone, Debug)]
pub struct OutputDir {
    dir: PathBuf,
    next_seq: HashMap<u32, u64>,
}

impl OutputDir {
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self {
            dir: dir.into(),
            next_seq: HashMap::new(),
        }
    }

    /// Creates the folder if needed, before a run rather than at its end.
    pub fn prepare(&self) -> Result<(), WriteError> {
        std::fs::create_dir_all(&self.dir).map_err(|cause| WriteError {
            path: self.dir.clone(),
            cause,
        })
    }

    pub fn path(&self) -> &Path {
        &self.dir
    }

    /// Removes temporaries left by a memprobe that was killed while writing
    /// (`.memprobe.*.<writer pid>.tmp` whose writer is gone); returns how
    /// many. Finished files only ever appear whole, by rename.
    pub fn remove_stale_temporaries(&self) -> usize {
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return 0;
        };
        let mut removed = 0;
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let Some(writer) = name
                .strip_prefix(".memprobe.")
                .and_then(|rest| rest.strip_suffix(".tmp"))
                .and_then(|rest| rest.rsplit('.').next())
                .and_then(|pid| pid.parse::<i32>().ok())
            else {
                continue;
            };
            // SAFETY: signal 0 only asks whether the process exists.
            let gone = unsafe { libc::kill(writer, 0) } != 0
                && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH);
            let is_file = entry.file_type().is_ok_and(|t| t.is_file());
            if gone && is_file && std::fs::remove_file(entry.path()).is_ok() {
                removed += 1;
            }
        }
        removed
    }

    /// Reserves the next sequence number for `pid` for which no file of
    /// any format exists yet: files of an earlier run stay untouched.
    pub fn next_seq(&mut self, pid: u32) -> u64 {
        let seq = self.next_seq.entry(pid).or_insert(0);
        while super::Format::ALL.iter().any(|f| {
            self.dir
                .join(file_name(pid, *seq, f.extension()))
                .symlink_metadata()
                .is_ok()
        }) {
            *seq += 1;
        }
        let reserved = *seq;
        *seq += 1;
        reserved
    }

    /// Writes `memprobe.<pid>.<seq>.<ext>` with `write`, atomically.
    pub fn write_file(
        &self,
        pid: u32,
        seq: u64,
        ext: &str,
        write: impl FnOnce(&mut dyn Write) -> io::Result<()>,
    ) -> io::Result<PathBuf> {
        let target = self.dir.join(file_name(pid, seq, ext));
        let temporary = self.dir.join(format!(
            ".{}.{}.tmp",
            file_name(pid, seq, ext),
            std::process::id()
        ));
        let file = create_new(&temporary)?;
        let result = (|| {
            let mut out = BufWriter::new(file);
            write(&mut out)?;
            let file = out.into_inner().map_err(|e| e.into_error())?;
            file.sync_all()?;
            rename_no_replace(&temporary, &target)
        })();
        if result.is_err() {
            let _ = std::fs::remove_file(&temporary);
        }
        result.map(|()| target)
    }
}

pub fn file_name(pid: u32, seq: u64, ext: &str) -> String {
    format!("memprobe.{pid}.{seq}.{ext}")
}

/// O_EXCL never follows a symlink planted at the path: it fails instead.
fn create_new(path: &Path) -> io::Result<File> {
    OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o644)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
}

/// `renameat2(RENAME_NOREPLACE)`: fails with EEXIST instead of replacing.
fn rename_no_replace(from: &Path, to: &Path) -> io::Result<()> {
    let from = CString::new(from.as_os_str().as_bytes())?;
    let to = CString::new(to.as_os_str().as_bytes())?;
    // SAFETY: both are valid NUL-terminated paths.
    let rc = unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            from.as_ptr(),
            libc::AT_FDCWD,
            to.as_ptr(),
            libc::RENAME_NOREPLACE,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fresh folder, removed when the test ends, failed or not.
    struct Scratch(PathBuf);

    impl std::ops::Deref for Scratch {
        type Target = Path;
        fn deref(&self) -> &Path {
            &self.0
        }
    }

    impl AsRef<Path> for Scratch {
        fn as_ref(&self) -> &Path {
            &self.0
        }
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn scratch(name: &str) -> Scratch {
        let dir =
            std::env::temp_dir().join(format!("memprobe-files-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }

    #[test]
    fn skips_existing_files_and_symlinks() {
        let dir = scratch("skip");
        std::fs::write(dir.join("memprobe.7.0.heap"), "old").unwrap();
        std::os::unix::fs::symlink("/etc/passwd", dir.join("memprobe.7.1.heap")).unwrap();
        let mut out = OutputDir::new(dir.to_path_buf());
        let seq = out.next_seq(7);
        assert_eq!(seq, 2);
        let path = out
            .write_file(7, seq, "heap", |w| w.write_all(b"new"))
            .unwrap();
        assert_eq!(std::fs::read_to_string(path).unwrap(), "new");
        assert_eq!(
            std::fs::read_to_string(dir.join("memprobe.7.0.heap")).unwrap(),
            "old"
        );
        assert_eq!(out.next_seq(7), 3);
    }

    #[test]
    fn stale_temporaries_of_dead_writers_are_removed() {
        let dir = scratch("stale");
        // pid_max is at most 4194304: this writer cannot exist.
        std::fs::write(dir.join(".memprobe.7.0.heap.4194305.tmp"), "half").unwrap();
        let live = format!(".memprobe.7.1.heap.{}.tmp", std::process::id());
        std::fs::write(dir.join(&live), "being written").unwrap();
        let out = OutputDir::new(dir.to_path_buf());
        assert_eq!(out.remove_stale_temporaries(), 1);
        assert!(dir.join(&live).exists());
    }

    #[test]
    fn never_replaces_and_leaves_no_temporary() {
        let dir = scratch("noreplace");
        std::os::unix::fs::symlink("/nonexistent", dir.join("memprobe.1.0.svg")).unwrap();
        let out = OutputDir::new(dir.to_path_buf());
        let err = out
            .write_file(1, 0, "svg", |w| w.write_all(b"x"))
            .unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::AlreadyExists);
        let failed = out
            .write_file(1, 5, "heap", |_| Err(io::Error::other("writer failed")))
            .unwrap_err();
        assert_eq!(failed.to_string(), "writer failed");
        let names: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        assert_eq!(names, ["memprobe.1.0.svg"]);
    }
}
