//! What reading written profiles back can fail with.
use std::{io, path::PathBuf};

use crate::output::{WriteError, heap_v2::read::ParseError};

#[derive(Debug, thiserror::Error)]
pub enum OfflineError {
    #[error("cannot read {}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        cause: io::Error,
    },

    #[error(
        "cannot read {} as a heap profile: {cause}; give a .heap file written by memprobe \
         or by jemalloc", path.display()
    )]
    BadProfile { path: PathBuf, cause: ParseError },

    #[error(
        "no memprobe.<pid>.<seq>.heap files in {}: point at the --output folder of a run",
        .0.display()
    )]
    NoSnapshots(PathBuf),

    #[error(transparent)]
    Write(#[from] WriteError),

    /// Writing to the writer a caller gave (the binary names it).
    #[error("writing the output failed")]
    Output(#[source] io::Error),
}
