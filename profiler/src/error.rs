//! The library's errors, typed: no message strings where a cause fits.
//! Each area has its own (`proc`, `discover`, `kernel`, `output`, `serve`,
//! `offline`); this one gathers them, with the run's own.
//! Each message says what is wrong and what to do.
//! An underlying error is its `#[source]` and is not repeated in the
//! message: the binary prints the chain (`{:#}`), and [`chain`] does the
//! same inside the library.
use std::{io, path::PathBuf};

use crate::{
    discover::DiscoverError, kernel::KernelError, offline::OfflineError, output::WriteError,
    proc::ProcessError, serve::ServeError,
};

/// Every error a run or an offline command can end with: each area's
/// own, and the run's.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Process(#[from] ProcessError),

    #[error(transparent)]
    Discover(#[from] DiscoverError),

    #[error(transparent)]
    Kernel(#[from] KernelError),

    #[error(transparent)]
    Write(#[from] WriteError),

    #[error(transparent)]
    Serve(#[from] ServeError),

    #[error(transparent)]
    Offline(#[from] OfflineError),

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

    #[error("cannot read {}", path.display())]
    Read {
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
