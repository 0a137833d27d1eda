//! memprobe: a heap profiler for processes that use jemalloc, attached with
//! uprobes to a running process, writing profiles that jeprof reads.
//!
//! The path of a run: [`target`] finds jemalloc in a process, [`kernel`]
//! loads the eBPF programs and attaches them, [`events`] decodes what they
//! send, [`collector`] keeps the live set and the per-stack estimates,
//! [`output`] writes the profiles, and [`session`] ties it together.
pub mod analysis;
pub mod checks;
pub mod code;
pub mod collector;
pub mod cost;
pub mod debug_files;
pub mod discovery;
pub mod elf;
pub mod entry_points;
pub mod error;
pub mod events;
pub mod format;
pub mod input;
pub mod kernel;
pub mod launch;
pub mod offline;
pub mod output;
pub mod perfmap;
pub mod placement;
pub mod profile;
pub mod report;
pub mod rootfs;
pub mod sampling;
pub mod session;
pub mod size_class;
pub mod symbolize;
pub mod target;
pub mod unwind;
pub mod uprobe_session;

pub use error::{Error, Result};
