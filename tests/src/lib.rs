//! Helpers for the integration tests: build fixtures, run them and the real
//! `memprobe` binary, read the results with the real `jeprof`.
use std::path::{Path, PathBuf};

pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_owned()
}

/// The binary under test: `MEMPROBE_BIN` (set by `cargo xtask test`), else
/// the release build.
pub fn memprobe_bin() -> PathBuf {
    let path = std::env::var_os("MEMPROBE_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join("target/release/memprobe"));
    assert!(
        path.exists(),
        "{} missing: run `cargo xtask test` (or `cargo build --release`)",
        path.display()
    );
    path
}

mod fixtures;
mod prometheus;
mod reading;
mod running;
pub use fixtures::*;
pub use prometheus::*;
pub use reading::*;
pub use running::*;
