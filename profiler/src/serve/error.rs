//! What serving `--listen`'s endpoints can fail with, before the run
//! starts.
use std::{io, net::SocketAddr, path::PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error(
        "cannot listen on {address}: give a free address and port you may bind, such as \
         127.0.0.1:6060"
    )]
    Listen {
        address: SocketAddr,
        #[source]
        cause: io::Error,
    },

    #[error("--listen {address}: {reason}")]
    UnsafeListen {
        address: SocketAddr,
        reason: &'static str,
    },

    #[error("{what} {}", path.display())]
    AccessFile {
        what: &'static str,
        path: PathBuf,
        #[source]
        cause: Box<dyn std::error::Error + Send + Sync>,
    },
}
