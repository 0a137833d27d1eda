//! What profiled processes map, told by the kernel at once (the `mmap`,
//! `munmap` and `mremap` syscalls' tracepoints): a file's code, so that an
//! allocator in a `dlopen`ed library is probed within milliseconds of its
//! mapping instead of at the next rescan; anonymous memory with the stack
//! that mapped it, and the ranges unmapped or moved, for the memory
//! account. Only processes in [`maps::WATCHED`] are told of.
use aya::{Ebpf, programs::TracePoint};
use profiler_common::{maps, programs};

use crate::kernel::{KernelProbes, LinkFailure};

/// Loads and attaches both programs, for the whole run; why not, on a
/// kernel or host without syscall tracepoints or tracefs (rescans still
/// find new libraries, within a second).
pub(super) fn attach(ebpf: &mut Ebpf) -> Result<(), LinkFailure> {
    for (name, event) in [
        (programs::MMAP_ENTER, "sys_enter_mmap"),
        (programs::MMAP_EXIT, "sys_exit_mmap"),
        (programs::MUNMAP_ENTER, "sys_enter_munmap"),
        (programs::MREMAP_ENTER, "sys_enter_mremap"),
        (programs::MREMAP_EXIT, "sys_exit_mremap"),
    ] {
        let program: &mut TracePoint = ebpf
            .program_mut(name)
            .ok_or_else(|| LinkFailure::MissingProgram(name.into()))?
            .try_into()
            .map_err(LinkFailure::program(name))?;
        program.load().map_err(LinkFailure::program(name))?;
        program
            .attach("syscalls", event)
            .map_err(|cause| LinkFailure::Tracepoint { event, cause })?;
    }
    Ok(())
}

impl KernelProbes {
    /// Has the kernel tell of what `pid` maps from now on, or stop. A full
    /// table only leaves its new libraries to the rescans, and its
    /// mappings unexplained.
    pub fn watch_mapped_code(&mut self, pid: u32, watched: bool) {
        if self.mapped_code_unavailable.is_none() {
            self.set_pid(maps::WATCHED, pid, watched);
        }
    }
}
