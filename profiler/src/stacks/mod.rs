//! Turning what the kernel sent about a sampled call into its stack:
//! DWARF unwinding of the copied stack, frame-pointer trust, the uretprobe
//! trampoline.
pub(crate) mod unwind;
