//! The library's errors, typed: no message strings where a cause fits.
//! Each message says what is wrong and what to do.
//! An underlying error is its `#[source]` and is not repeated in the
//! message: the binary prints the chain (`{:#}`), and [`chain`] does the
//! same inside the library.
use std::{io, path::PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("no process with pid {0}: check the pid with `ps -e` and that the process still runs")]
    NoSuchProcess(u32),

    #[error(
        "process {pid} ({command}): {found}; memprobe profiles jemalloc, glibc malloc, mimalloc \
         and tcmalloc (see --allocator)"
    )]
    NoAllocator {
        pid: u32,
        command: String,
        found: String,
    },

    #[error("{}: {found}; or leave jemalloc out with --allocator", .path.display())]
    HiddenJemalloc { path: PathBuf, found: String },

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
    MissingKernelFeature(crate::kernel::features::KernelFeature),

    #[error("cannot read {}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        cause: io::Error,
    },

    #[error("loading {what} into the kernel failed")]
    Load {
        /// The object, a map or a program.
        what: String,
        #[source]
        cause: Box<dyn std::error::Error + Send + Sync>,
    },

    #[error("uprobe sessions (Linux 6.13+) were asked for: use --return-probes uretprobes here")]
    SessionsRefused(#[source] crate::kernel::uprobe_multi::LinkError),

    #[error("more than 65535 allocator copies to probe")]
    TooManyCopies,

    #[error("attaching {entry_point} in {} of pid {pid} failed", path.display())]
    Attach {
        pid: u32,
        entry_point: String,
        path: PathBuf,
        #[source]
        cause: Box<crate::kernel::LinkFailure>,
    },

    #[error("{cause}; the {detached} probes of this copy attached before it were detached")]
    AttachUndone { cause: Box<Error>, detached: usize },

    #[error(
        "cannot read {} as a heap profile: {cause}; give a .heap file written by memprobe \
         or by jemalloc", path.display()
    )]
    BadProfile {
        path: PathBuf,
        cause: crate::output::heap_v2::read::ParseError,
    },

    #[error(
        "no memprobe.<pid>.<seq>.heap files in {}: point at the --output folder of a run",
        .0.display()
    )]
    NoSnapshots(PathBuf),

    #[error("no command given after --: write the command to run after `--`")]
    NoCommand,

    #[error("cannot launch {}: command not found in PATH", .0.display())]
    CommandNotFound(PathBuf),

    #[error("cannot launch {}", program.display())]
    Launch {
        program: PathBuf,
        #[source]
        cause: io::Error,
    },

    #[error(
        "cannot listen on {address}: give a free address and port you may bind, such as \
         127.0.0.1:6060"
    )]
    Listen {
        address: std::net::SocketAddr,
        #[source]
        cause: io::Error,
    },

    #[error("--listen {address}: {reason}")]
    UnsafeListen {
        address: std::net::SocketAddr,
        reason: &'static str,
    },

    #[error("{what} {}", path.display())]
    AccessFile {
        what: &'static str,
        path: PathBuf,
        #[source]
        cause: Box<dyn std::error::Error + Send + Sync>,
    },

    #[error("{what} failed")]
    Events {
        what: &'static str,
        #[source]
        cause: Box<dyn std::error::Error + Send + Sync>,
    },

    #[error("writing {}", path.display())]
    Write {
        path: PathBuf,
        #[source]
        cause: io::Error,
    },

    /// Writing to the writer a caller gave (the binary names it).
    #[error("writing the output failed")]
    Output(#[source] io::Error),
}

/// An error and its sources, as one line: "what: why: why".
pub fn chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
