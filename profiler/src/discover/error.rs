//! What finding a process's allocators can fail with.
use std::path::PathBuf;

use crate::proc::ProcessError;

#[derive(Debug, thiserror::Error)]
pub enum DiscoverError {
    #[error(transparent)]
    Process(#[from] ProcessError),

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
}
