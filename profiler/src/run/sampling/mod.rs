//! How a process's allocation calls are sampled beyond memprobe's own
//! byte countdown at every call: jemalloc's `malloc` in short windows
//! ([`windows`], the default), or through jemalloc's own profiler where it
//! runs ([`own_profiler`]).
pub(super) mod own_profiler;
pub mod windows;
