//! The one-trap floor: a uprobe_multi link at memprobe's `free` place whose
//! BPF program only adds one to a counter. Any design that follows frees
//! exactly pays this at least, one trap per free, and nothing is cheaper to
//! attach: the link is the kind memprobe's own probes use (no per-task
//! perf event switched at every context switch, unlike the two-trap
//! floor's counters), and the program is eleven instructions.
//!
//! Made with raw `bpf(2)` calls: the bench needs no eBPF object of its own.
use std::{
    ffi::CString,
    io,
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
};

use anyhow::{Context, Result};

use super::floor::{CountsHits, Place};

/// `enum bpf_cmd` values.
const BPF_MAP_CREATE: i64 = 0;
const BPF_MAP_LOOKUP_ELEM: i64 = 1;
const BPF_PROG_LOAD: i64 = 5;
const BPF_LINK_CREATE: i64 = 28;
/// `BPF_MAP_TYPE_ARRAY`, `BPF_PROG_TYPE_KPROBE`, `BPF_TRACE_UPROBE_MULTI`.
const ARRAY: u32 = 2;
const KPROBE: u32 = 2;
const UPROBE_MULTI: u32 = 48;

/// `union bpf_attr`, as bytes aligned like it: every command's fields used
/// here fit in its first 72 bytes, and the rest stays zero as the kernel
/// requires.
#[repr(C, align(8))]
struct Attr([u8; 128]);

impl Default for Attr {
    fn default() -> Self {
        Self([0; 128])
    }
}

impl Attr {
    fn put_u32(&mut self, at: usize, value: u32) -> &mut Self {
        self.0[at..at + 4].copy_from_slice(&value.to_ne_bytes());
        self
    }

    fn put_u64(&mut self, at: usize, value: u64) -> &mut Self {
        self.0[at..at + 8].copy_from_slice(&value.to_ne_bytes());
        self
    }

    fn call(&mut self, cmd: i64) -> io::Result<i64> {
        // SAFETY: the attribute is 128 initialised bytes; every pointer
        // written into it outlives the call.
        let ret = unsafe { libc::syscall(libc::SYS_bpf, cmd, self.0.as_mut_ptr(), self.0.len()) };
        if ret < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(ret)
    }

    fn new_fd(&mut self, cmd: i64) -> io::Result<OwnedFd> {
        let fd = self.call(cmd)?;
        // SAFETY: a new descriptor that nothing else owns.
        Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
    }
}

/// One eBPF instruction: opcode, registers (destination in the low
/// nibble), offset, immediate.
fn insn(code: u8, dst: u8, src: u8, off: i16, imm: i32) -> u64 {
    let mut bytes = [0u8; 8];
    bytes[0] = code;
    bytes[1] = dst | (src << 4);
    bytes[2..4].copy_from_slice(&off.to_ne_bytes());
    bytes[4..8].copy_from_slice(&imm.to_ne_bytes());
    u64::from_ne_bytes(bytes)
}

/// `counter[0] += 1; return 0;` with the counter map's descriptor.
fn counting_program(map: i32) -> Vec<u64> {
    vec![
        insn(0x62, 10, 0, -4, 0), // *(u32 *)(r10 - 4) = 0: the key
        insn(0xbf, 2, 10, 0, 0),  // r2 = r10
        insn(0x07, 2, 0, 0, -4),  // r2 += -4
        insn(0x18, 1, 1, 0, map), // r1 = the map (ld_imm64, map fd)
        insn(0x00, 0, 0, 0, 0),   // (its upper half)
        insn(0x85, 0, 0, 0, 1),   // r0 = bpf_map_lookup_elem(r1, r2)
        insn(0x15, 0, 0, 2, 0),   // if r0 == 0 skip two
        insn(0xb7, 1, 0, 0, 1),   // r1 = 1
        insn(0xdb, 0, 1, 0, 0),   // lock *(u64 *)(r0 + 0) += r1
        insn(0xb7, 0, 0, 0, 0),   // r0 = 0
        insn(0x95, 0, 0, 0, 0),   // exit
    ]
}

/// The one-trap floor attached to one process; detached when dropped.
pub(super) struct OneTrap {
    counter: OwnedFd,
    _program: OwnedFd,
    _link: OwnedFd,
}

impl OneTrap {
    /// Attaches the counting program at `place` in process `pid` only.
    pub(super) fn attach(pid: u32, (path, offset): &Place) -> Result<Self> {
        let counter = Attr::default()
            .put_u32(0, ARRAY)
            .put_u32(4, 4)
            .put_u32(8, 8)
            .put_u32(12, 1)
            .new_fd(BPF_MAP_CREATE)
            .context("creating the one-trap floor's counter map")?;
        let program = counting_program(counter.as_raw_fd());
        let license = c"GPL";
        let program = Attr::default()
            .put_u32(0, KPROBE)
            .put_u32(4, program.len() as u32)
            .put_u64(8, program.as_ptr() as u64)
            .put_u64(16, license.as_ptr() as u64)
            .put_u32(68, UPROBE_MULTI)
            .new_fd(BPF_PROG_LOAD)
            .context("loading the one-trap floor's program")?;
        let path = CString::new(path.as_str())?;
        let offsets = [*offset];
        let link = Attr::default()
            .put_u32(0, program.as_raw_fd() as u32)
            .put_u32(8, UPROBE_MULTI)
            .put_u64(16, path.as_ptr() as u64)
            .put_u64(24, offsets.as_ptr() as u64)
            .put_u32(48, 1)
            .put_u32(56, pid)
            .new_fd(BPF_LINK_CREATE)
            .with_context(|| format!("a uprobe_multi link at {path:?}+{offset:#x} (Linux 6.6+)"))?;
        Ok(Self {
            counter,
            _program: program,
            _link: link,
        })
    }
}

impl CountsHits for OneTrap {
    fn hits(&self) -> Result<u64> {
        let key = 0u32;
        let mut count = 0u64;
        Attr::default()
            .put_u32(0, self.counter.as_raw_fd() as u32)
            .put_u64(8, &key as *const u32 as u64)
            .put_u64(16, &mut count as *mut u64 as u64)
            .call(BPF_MAP_LOOKUP_ELEM)
            .context("reading the one-trap floor's counter")?;
        Ok(count)
    }
}
