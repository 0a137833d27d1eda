//! What must hold before anything is loaded: privileges and kernel support.
//!
//! Each kernel feature is detected by trying it, never by the version
//! number (distributions backport): sysfs entries for uprobes and BTF, a
//! map or a helper the kernel loads or refuses for the BPF parts. Uprobe
//! sessions, which have a fallback, are tried where the kernel can refuse
//! them: at the first link (see `kernel`).
use std::{fmt, path::PathBuf};

use aya::{
    maps::MapType,
    programs::ProgramType,
    sys::{BpfHelper, is_helper_supported, is_map_supported},
};

use crate::kernel::error::{KernelError, Result};

/// The kernel features memprobe uses, each with the first Linux release
/// that has it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KernelFeature {
    /// BPF ring buffer maps: the event stream.
    RingBuffer,
    /// BPF links for perf-event probes: attach cookies ride on them.
    PerfLink,
    /// `bpf_get_attach_cookie` in uprobe programs: which entry point fired.
    AttachCookie,
    /// Uprobe sessions: a return half only for sampled calls. Optional:
    /// without them every call also traps at its return.
    UprobeSessions,
    /// uprobe_multi links filtered by process: probes without a per-task
    /// perf event. Optional: without them the target's main thread pays
    /// at every context switch.
    UprobeMulti,
}

impl KernelFeature {
    /// Every feature without which memprobe cannot run, in probe order.
    pub const REQUIRED: [KernelFeature; 3] = [Self::RingBuffer, Self::PerfLink, Self::AttachCookie];

    pub fn name(self) -> &'static str {
        match self {
            Self::RingBuffer => "BPF ring buffers",
            Self::PerfLink => "BPF links for uprobes",
            Self::AttachCookie => "BPF attach cookies for uprobes",
            Self::UprobeSessions => "uprobe sessions",
            Self::UprobeMulti => "uprobe_multi links",
        }
    }

    /// The first Linux release with the feature.
    pub fn since(self) -> &'static str {
        match self {
            Self::RingBuffer => "5.8",
            Self::PerfLink | Self::AttachCookie => "5.15",
            Self::UprobeSessions => "6.13",
            // 6.6 to 6.9 filter them by thread, which memprobe checks.
            Self::UprobeMulti => "6.10",
        }
    }

    /// The name `MEMPROBE_KERNEL_LACKS` takes.
    fn key(self) -> &'static str {
        match self {
            Self::RingBuffer => "ring-buffer",
            Self::PerfLink => "perf-link",
            Self::AttachCookie => "attach-cookie",
            Self::UprobeSessions => "uprobe-sessions",
            Self::UprobeMulti => "uprobe-multi",
        }
    }

    /// Asks the kernel. `None`: the probe itself failed, and loading will
    /// say why.
    fn present(self) -> Option<bool> {
        if pretended_missing(self) {
            return Some(false);
        }
        match self {
            Self::RingBuffer => is_map_supported(MapType::RingBuf).ok(),
            Self::PerfLink => Some(aya::features().bpf_perf_link()),
            Self::AttachCookie => {
                is_helper_supported(ProgramType::KProbe, BpfHelper::BPF_FUNC_get_attach_cookie).ok()
            }
            // Known only at link time.
            Self::UprobeSessions | Self::UprobeMulti => None,
        }
    }
}

impl fmt::Display for KernelFeature {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} (Linux {}+)", self.name(), self.since())
    }
}

/// `MEMPROBE_KERNEL_LACKS=ring-buffer,...` makes the checks report those
/// features missing: the test suite plays an old kernel with it, as it
/// plays a kernel without uprobes with `MEMPROBE_SYSFS`.
pub fn pretended_missing(feature: KernelFeature) -> bool {
    std::env::var("MEMPROBE_KERNEL_LACKS")
        .is_ok_and(|lacks| lacks.split(',').any(|key| key.trim() == feature.key()))
}

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
        return Err(KernelError::NotRoot);
    }
    Ok(())
}

/// uprobes through perf events, BTF for the loader, and the BPF features
/// without a fallback. Run as root: the BPF probes load tiny programs.
pub fn require_kernel_support() -> Result<()> {
    let sysfs = sysfs();
    let uprobe = sysfs.join("bus/event_source/devices/uprobe/type");
    if !uprobe.exists() {
        return Err(KernelError::NoUprobes(uprobe));
    }
    let btf = sysfs.join("kernel/btf/vmlinux");
    if !btf.exists() {
        return Err(KernelError::NoBtf(btf));
    }
    for feature in KernelFeature::REQUIRED {
        if feature.present() == Some(false) {
            return Err(KernelError::MissingKernelFeature(feature));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_feature_says_which_and_since_when() {
        let message = KernelError::MissingKernelFeature(KernelFeature::AttachCookie).to_string();
        assert!(message.contains("BPF attach cookies for uprobes (Linux 5.15+)"));
        assert!(message.contains("Linux 5.15 or newer"));
        assert!(!message.contains('\n'));
    }
}
