//! What reading a process from /proc can fail with.
use std::{io, path::PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum ProcessError {
    #[error("no process with pid {0}: check the pid with `ps -e` and that the process still runs")]
    NoSuchProcess(u32),

    #[error("cannot read {}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        cause: io::Error,
    },
}
