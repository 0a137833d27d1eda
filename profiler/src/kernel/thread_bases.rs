//! Every thread's fs base in a process, listed by a task iterator (Linux
//! 5.8+, with BTF): where each keeps its TLS, so that jemalloc's
//! per-thread counters can be read from userspace when a process's
//! windows begin, whether the thread allocates then or not.
use std::io::Read;

use aya::{Btf, Ebpf, programs::Iter};
use profiler_common::{ThreadBase, programs};

use crate::kernel::KernelProbes;

/// The most a listing reads: 16 bytes a thread, a million threads.
const MAX_LISTING: u64 = 16 << 20;

/// Loads the iterator; why not where the kernel refuses it.
pub(super) fn load(ebpf: &mut Ebpf) -> Result<(), String> {
    let btf = Btf::from_sys_fs().map_err(|e| e.to_string())?;
    let program: &mut Iter = ebpf
        .program_mut(programs::THREAD_BASES)
        .ok_or("missing")?
        .try_into()
        .map_err(|e: aya::programs::ProgramError| e.to_string())?;
    program.load("task", &btf).map_err(|e| e.to_string())
}

impl KernelProbes {
    /// Each thread of `pid` with its fs base (threads not started in user
    /// space yet have none, and are left out); `None` where the kernel
    /// cannot list them.
    pub fn thread_bases(&mut self, pid: u32) -> Option<Vec<(u32, u64)>> {
        if !self.knows_fsbase || self.threads_unlisted.is_some() {
            return None;
        }
        let program: &mut Iter = self
            .ebpf
            .program_mut(programs::THREAD_BASES)?
            .try_into()
            .ok()?;
        let link = program.attach().ok()?;
        let file = program.take_link(link).ok()?.into_file().ok()?;
        let mut listing = Vec::new();
        file.take(MAX_LISTING).read_to_end(&mut listing).ok()?;
        Some(
            listing
                .chunks_exact(size_of::<ThreadBase>())
                .map(parse)
                .filter(|t| t.tgid == pid)
                .map(|t| (t.tid, t.fsbase))
                .collect(),
        )
    }
}

fn parse(record: &[u8]) -> ThreadBase {
    let word = |at: usize, n: usize| {
        let mut bytes = [0u8; 8];
        bytes[..n].copy_from_slice(&record[at..at + n]);
        u64::from_le_bytes(bytes)
    };
    ThreadBase {
        tgid: word(0, 4) as u32,
        tid: word(4, 4) as u32,
        fsbase: word(8, 8),
    }
}
