//! What must hold before anything is loaded: privileges and kernel support.
use std::path::PathBuf;

use crate::error::{Error, Result};

/// Where the kernel's sysfs is. `MEMPROBE_SYSFS` points the checks at
/// another tree; the test suite uses it to play a kernel without uprobes.
fn sysfs() -> PathBuf {
    std::env::var_os("MEMPROBE_SYSFS")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/sys"))
}

pub fn require_root() -> Result<()> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Err(Error::NotRoot);
    }
    Ok(())
}

/// uprobes through perf events, and BTF for the loader.
pub fn require_kernel_support() -> Result<()> {
    let sysfs = sysfs();
    let uprobe = sysfs.join("bus/event_source/devices/uprobe/type");
    if !uprobe.exists() {
        return Err(Error::NoUprobes(uprobe));
    }
    let btf = sysfs.join("kernel/btf/vmlinux");
    if !btf.exists() {
        return Err(Error::NoBtf(btf));
    }
    Ok(())
}
