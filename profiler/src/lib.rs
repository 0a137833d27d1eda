//! memprobe: a heap profiler for processes that use jemalloc, glibc malloc,
//! mimalloc or tcmalloc, attached with uprobes to a running process,
//! writing profiles that jeprof reads.
//!
//! One folder per stage of a run, in the order data flows:
//! [`proc`] reads processes (maps, roots), [`binary`] reads ELF files and
//! decodes their code, [`discover`] finds allocators and
//! where to probe them, [`kernel`] loads and attaches the eBPF programs and
//! decodes their events, [`stacks`] unwinds sampled stacks, [`python`] puts
//! a CPython process's Python frames among them, [`collect`]
//! keeps live samples and per-stack estimates, [`symbolize`] names frames,
//! [`account`] says whose a process's resident memory is, [`output`] writes profiles (and reads `heap_v2` back), [`offline`]
//! reads written profiles back (report, diff, leaks, convert), [`serve`]
//! answers scrapers while a run goes on (`--listen`), and [`run`] ties
//! them together. Each imports only the stages before it (checked by
//! `tests/stages.rs`); each area has its own error type, which [`Error`]
//! gathers for the run.
pub(crate) mod account;
pub(crate) mod binary;
pub(crate) mod clock;
pub mod collect;
pub(crate) mod discover;
mod error;
pub mod kernel;
pub mod offline;
pub mod output;
pub(crate) mod proc;
pub(crate) mod profile;
pub(crate) mod python;
pub mod run;
pub(crate) mod serve;
pub(crate) mod stacks;
pub(crate) mod symbolize;
pub(crate) mod units;

pub use discover::AllocatorKind;
pub use error::{Error, Result};
pub use serve::AccessOptions;
