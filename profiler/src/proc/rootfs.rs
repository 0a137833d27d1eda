//! Opening files named by a profiled process inside its root directory
//! (`/proc/PID/root`), as memprobe runs as root and the names come from the
//! target: nothing it planted can lead memprobe out of its root.
use std::{
    ffi::CString,
    fs::File,
    io,
    os::unix::{ffi::OsStrExt, io::FromRawFd},
    path::Path,
};

/// Opens `path` (absolute, as the process sees it) inside the directory
/// `root`: `..` and symlinks, absolute ones too, resolve within `root`, so
/// a file planted by the target cannot lead memprobe elsewhere.
pub fn open_in_root(root: &Path, path: &Path) -> io::Result<File> {
    open(root, path, libc::O_NOFOLLOW)
}

/// As [`open_in_root`], but a symlink as the last component is followed
/// too, still within `root` (distributions' `.build-id` links are symlinks).
pub fn open_in_root_following(root: &Path, path: &Path) -> io::Result<File> {
    open(root, path, 0)
}

/// Opens the directory `path` inside `root` (see [`open_in_root`]).
pub fn open_dir_in_root(root: &Path, path: &Path) -> io::Result<File> {
    open(root, path, libc::O_DIRECTORY | libc::O_NOFOLLOW)
}

fn open(root: &Path, path: &Path, last: libc::c_int) -> io::Result<File> {
    let root = CString::new(root.as_os_str().as_bytes())?;
    let relative = path.strip_prefix("/").unwrap_or(path);
    let relative = CString::new(relative.as_os_str().as_bytes())?;
    // SAFETY: plain syscalls on NUL-terminated paths and a valid open_how.
    unsafe {
        let dir = libc::open(
            root.as_ptr(),
            libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC,
        );
        if dir < 0 {
            return Err(io::Error::last_os_error());
        }
        let mut how: libc::open_how = std::mem::zeroed();
        how.flags = (libc::O_RDONLY | libc::O_CLOEXEC | last) as u64;
        how.resolve = libc::RESOLVE_IN_ROOT | libc::RESOLVE_NO_MAGICLINKS;
        let fd = libc::syscall(
            libc::SYS_openat2,
            dir,
            relative.as_ptr(),
            &how as *const libc::open_how,
            std::mem::size_of::<libc::open_how>(),
        );
        let error = io::Error::last_os_error();
        libc::close(dir);
        if fd < 0 {
            return Err(error);
        }
        Ok(File::from_raw_fd(fd as i32))
    }
}

#[cfg(test)]
mod tests {
    use std::io::Read;

    use super::*;

    #[test]
    fn a_planted_symlink_cannot_lead_out_of_the_root() {
        let root = std::env::temp_dir().join(format!("memprobe-root-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(root.join("tmp")).unwrap();
        std::fs::create_dir_all(root.join("etc")).unwrap();
        std::fs::write(root.join("etc/hostname"), "inside").unwrap();
        // /tmp/perf-1.map -> /etc/hostname: must mean the root's own /etc.
        std::os::unix::fs::symlink("/etc/hostname", root.join("tmp/perf-1.map")).unwrap();
        // Opened through the link? O_NOFOLLOW refuses the final symlink...
        assert!(open_in_root(&root, Path::new("/tmp/perf-1.map")).is_err());
        // ...and where the last link is followed, it resolves in the root.
        let mut text = String::new();
        open_in_root_following(&root, Path::new("/tmp/perf-1.map"))
            .unwrap()
            .read_to_string(&mut text)
            .unwrap();
        assert_eq!(text, "inside");
        // ...and a path through a symlinked folder stays inside the root.
        std::os::unix::fs::symlink("/etc", root.join("tmp/etc")).unwrap();
        let mut text = String::new();
        open_in_root(&root, Path::new("/tmp/etc/hostname"))
            .unwrap()
            .read_to_string(&mut text)
            .unwrap();
        assert_eq!(text, "inside");
        assert!(open_in_root(&root, Path::new("/../../etc/passwd")).is_err());
        let _ = std::fs::remove_dir_all(&root);
    }
}
