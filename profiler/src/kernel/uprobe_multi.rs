//! `uprobe_multi` links, made by hand: uprobe sessions (Linux 6.13+), where
//! one program runs at a call's entry and, only when the entry returned 0,
//! again at its return, so unsampled calls skip the return probe; and plain
//! entry probes linked the same way, which, unlike aya's perf-event
//! uprobes, give the target no per-task perf event to switch at every
//! context switch (2.3x a pipe ping-pong's CPU, see docs/overhead.md).
//!
//! aya 0.14 can load neither program kind's expected attach type nor create
//! its link, so memprobe does those two syscalls itself: `linkable` loads
//! the programs from the same eBPF object, and this module links them with
//! `BPF_LINK_CREATE`. Everything else (maps, uretprobes) stays with aya.
use std::{
    collections::HashMap,
    ffi::CString,
    io,
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
    path::Path,
    sync::Arc,
};

use aya_obj::generated::{bpf_attr, bpf_cmd};

use crate::kernel::linkable::LinkableCode;

/// What the programs are loaded and linked as.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LinkKind {
    /// Uprobe sessions: entry and, when the entry asks, return half.
    Session,
    /// Entry probes alone.
    Entry,
}

impl LinkKind {
    /// `enum bpf_attach_type`'s value: `BPF_TRACE_UPROBE_MULTI` is 48;
    /// aya-obj's bindings predate `BPF_TRACE_UPROBE_SESSION`, 57.
    pub(super) fn attach_type(self) -> u32 {
        match self {
            LinkKind::Session => 57,
            LinkKind::Entry => 48,
        }
    }
}

/// Programs for one kind of `uprobe_multi` link, each loaded into the
/// kernel at its first link.
pub struct MultiPrograms {
    kind: LinkKind,
    code: Arc<LinkableCode>,
    loaded: HashMap<&'static str, OwnedFd>,
}

/// Why a program was not linked.
#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    #[error("the eBPF object: {0}")]
    Object(String),
    #[error("map {0} was not created")]
    MissingMap(String),
    #[error("program {0} is not in the eBPF object")]
    MissingProgram(String),
    #[error("the kernel refused {program}: {cause}{log}")]
    Refused {
        program: String,
        cause: io::Error,
        log: String,
    },
    #[error("the kernel refused the link: {0}")]
    Link(io::Error),
}

impl LinkError {
    /// Whether the kernel lacks the link's kind: it refused the program
    /// (a kernel may not know its attach type), or refused the link as
    /// [`kernel_lacks`] tells.
    pub fn kernel_lacks(&self) -> bool {
        match self {
            LinkError::Refused { .. } => true,
            LinkError::Link(e) => kernel_lacks(e),
            _ => false,
        }
    }
}

impl MultiPrograms {
    /// `code`'s programs for `kind`'s links; none loaded yet.
    pub fn new(code: Arc<LinkableCode>, kind: LinkKind) -> Self {
        Self {
            kind,
            code,
            loaded: HashMap::new(),
        }
    }

    /// Attaches `program` at `offset` in the file at `path`, in process
    /// `pid` only (0: every process), at the call's return if `returns`
    /// (an entry link), loading it first if no link has yet. Dropping the
    /// link detaches it. A kernel may load a program and still refuse its
    /// links (6.1 does).
    pub fn attach(
        &mut self,
        program: &'static str,
        (path, offset): (&Path, u64),
        cookie: u64,
        pid: u32,
        returns: bool,
    ) -> Result<OwnedFd, LinkError> {
        /// `BPF_F_UPROBE_MULTI_RETURN`.
        const RETURN: u32 = 1;
        if !self.loaded.contains_key(program) {
            let fd = self.code.load(program, self.kind)?;
            self.loaded.insert(program, fd);
        }
        let prog = &self.loaded[program];
        let path = CString::new(path.as_os_str().as_encoded_bytes())
            .map_err(|_| LinkError::Link(io::Error::from(io::ErrorKind::InvalidInput)))?;
        let offsets = [offset];
        let cookies = [cookie];
        // SAFETY: an all-zero bpf_attr is the kernel's "no options".
        let mut attr: bpf_attr = unsafe { std::mem::zeroed() };
        // SAFETY: writing plain integers into the link_create member.
        unsafe {
            let link = &mut attr.link_create;
            link.__bindgen_anon_1.prog_fd = prog.as_raw_fd() as u32;
            link.attach_type = self.kind.attach_type();
            let multi = &mut link.__bindgen_anon_3.uprobe_multi;
            multi.path = path.as_ptr() as u64;
            multi.offsets = offsets.as_ptr() as u64;
            multi.cookies = cookies.as_ptr() as u64;
            multi.cnt = 1;
            multi.pid = pid;
            multi.flags = if returns { RETURN } else { 0 };
        }
        bpf(bpf_cmd::BPF_LINK_CREATE, &mut attr).map_err(LinkError::Link)
    }

    /// The ids the kernel gave the programs loaded so far.
    pub fn program_ids(&self) -> Vec<u32> {
        self.loaded
            .values()
            .filter_map(super::foreign::program_id)
            .collect()
    }
}

/// Whether a refused link means the kernel lacks the kind: before 6.13
/// `BPF_LINK_CREATE` rejects sessions (before 6.6, every uprobe_multi link)
/// with EINVAL; a kernel built without uprobe_multi says EOPNOTSUPP.
pub fn kernel_lacks(error: &io::Error) -> bool {
    /// The kernel's internal ENOTSUPP, which leaks to userspace in places.
    const ENOTSUPP: i32 = 524;
    matches!(
        error.raw_os_error(),
        Some(libc::EINVAL | libc::EOPNOTSUPP | ENOTSUPP)
    )
}

pub(super) fn bpf(cmd: bpf_cmd, attr: &mut bpf_attr) -> io::Result<OwnedFd> {
    let fd = bpf_call(cmd, attr)?;
    // SAFETY: the kernel returned a fresh fd that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// The `bpf` syscall; its result, never negative.
pub(super) fn bpf_call(cmd: bpf_cmd, attr: &mut bpf_attr) -> io::Result<i64> {
    // SAFETY: `attr` is a valid bpf_attr for `cmd` and outlives the call;
    // every pointer in it points at memory alive for the call.
    let result = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd as libc::c_int,
            attr as *mut bpf_attr,
            std::mem::size_of::<bpf_attr>() as libc::c_uint,
        )
    };
    if result < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(result)
}
