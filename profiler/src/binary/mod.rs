//! Reading binaries: ELF files' symbols, segments and read-only data
//! ([`elf`]), decoding x86-64 code ([`code`]), and where in a function a
//! probe can go so that the kernel emulates its instruction ([`placement`]).
//! What allocators are and how each compiles is `discover`'s.
pub mod code;
pub mod elf;
pub mod placement;
