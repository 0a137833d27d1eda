//! What writing a profile's files can fail with.
use std::{io, path::PathBuf};

#[derive(Debug, thiserror::Error)]
#[error("writing {}", path.display())]
pub struct WriteError {
    pub path: PathBuf,
    #[source]
    pub cause: io::Error,
}
