//! Integration tests: the real memprobe binary, real eBPF programs in the
//! kernel, real fixture processes, real jeprof. They need root, as in CI.
mod suite;
