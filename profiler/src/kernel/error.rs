//! What loading and attaching memprobe's programs can fail with.
use std::path::PathBuf;

use crate::{
    kernel::{LinkFailure, features::KernelFeature},
    proc::ProcessError,
};

#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    #[error(transparent)]
    Process(#[from] ProcessError),

    #[error("memprobe needs root to load eBPF programs and attach uprobes: run it with sudo")]
    NotRoot,

    #[error(
        "this kernel has no uprobe support ({} is missing): memprobe needs a kernel built with \
         CONFIG_UPROBES and CONFIG_UPROBE_EVENTS", .0.display()
    )]
    NoUprobes(PathBuf),

    #[error(
        "this kernel has no BTF ({} is missing): memprobe needs a kernel built with \
         CONFIG_DEBUG_INFO_BTF (Linux 5.8 or newer with BTF)", .0.display()
    )]
    NoBtf(PathBuf),

    #[error(
        "this kernel lacks {0}, which memprobe needs and nothing replaces: run memprobe on Linux \
         {since} or newer", since = .0.since()
    )]
    MissingKernelFeature(KernelFeature),

    #[error("loading {what} into the kernel failed")]
    Load {
        /// The object, a map or a program.
        what: String,
        #[source]
        cause: Box<dyn std::error::Error + Send + Sync>,
    },

    #[error(
        "uprobe sessions (Linux 6.13+) were asked for, but their programs cannot be made ({0}): \
         use --return-probes uretprobes here"
    )]
    SessionsRefused(String),

    #[error("more than 65535 allocator copies to probe")]
    TooManyCopies,

    #[error(
        "attaching {entry_point} in {} of pid {pid} failed{}",
        path.display(),
        undone_note(*undone)
    )]
    Attach {
        pid: u32,
        entry_point: String,
        path: PathBuf,
        #[source]
        cause: Box<LinkFailure>,
        /// The copy's probes attached before this one, detached again.
        undone: usize,
    },

    #[error("{what} failed")]
    Events {
        what: &'static str,
        #[source]
        cause: Box<dyn std::error::Error + Send + Sync>,
    },
}

/// What an attach that failed midway undid.
fn undone_note(undone: usize) -> String {
    match undone {
        0 => String::new(),
        n => format!(" (the {n} probes of this copy attached before it were detached)"),
    }
}

pub type Result<T, E = KernelError> = std::result::Result<T, E>;
