//! `uprobe_multi` links, made by hand: uprobe sessions (Linux 6.13+), where
//! one program runs at a call's entry and, only when the entry returned 0,
//! again at its return, so unsampled calls skip the return probe; and plain
//! entry probes linked the same way, which, unlike aya's perf-event
//! uprobes, give the target no per-task perf event to switch at every
//! context switch (2.3x a pipe ping-pong's CPU, see docs/overhead.md).
//!
//! aya 0.14 can load neither program kind's expected attach type nor create
//! its link, so this module does those two syscalls itself: it takes the
//! programs' instructions from the same eBPF object (aya-obj parses and
//! relocates them against the maps aya already created) and attaches them
//! with `BPF_LINK_CREATE`. Everything else (maps, uretprobes) stays with
//! aya.
use std::{
    collections::{HashMap, HashSet},
    ffi::CString,
    io,
    os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd},
    path::Path,
};

use aya::{Ebpf, maps::Map};
use aya_obj::generated::{bpf_attr, bpf_cmd, bpf_insn, bpf_prog_type};

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
    fn attach_type(self) -> u32 {
        match self {
            LinkKind::Session => 57,
            LinkKind::Entry => 48,
        }
    }
}

/// Programs loaded for one kind of `uprobe_multi` link, ready to attach.
pub struct MultiPrograms {
    kind: LinkKind,
    programs: HashMap<String, OwnedFd>,
}

/// Why the programs cannot be loaded; the caller falls back to aya's
/// perf-event uprobes and uretprobes.
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
}

impl MultiPrograms {
    /// Loads `names` from `object` (the bytes aya loaded `ebpf` from) as
    /// `kind`, with their map references pointing at `ebpf`'s maps. A kernel
    /// may load them and still refuse their links (6.1 does).
    pub fn load(
        ebpf: &Ebpf,
        object: &[u8],
        names: &[&str],
        kind: LinkKind,
    ) -> Result<Self, LinkError> {
        let mut obj =
            aya_obj::Object::parse(object).map_err(|e| LinkError::Object(e.to_string()))?;
        let mut fds = Vec::new();
        for name in obj.maps.keys() {
            // Sections aya skips (.bss and friends) have no map; we use none.
            let Some(map) = ebpf.map(name) else { continue };
            let fd = map_fd(map).ok_or_else(|| LinkError::MissingMap(name.clone()))?;
            fds.push((name.clone(), fd));
        }
        let text_sections: HashSet<usize> = obj.functions.keys().map(|(index, _)| *index).collect();
        let maps = obj.maps.clone();
        obj.relocate_maps(
            fds.iter()
                .filter_map(|(name, fd)| Some((name.as_str(), *fd, maps.get(name)?))),
            &text_sections,
        )
        .map_err(|e| LinkError::Object(e.to_string()))?;
        obj.relocate_calls(&text_sections)
            .map_err(|e| LinkError::Object(e.to_string()))?;
        let license = obj.license.clone();
        let mut programs = HashMap::new();
        for &name in names {
            let program = obj
                .programs
                .get(name)
                .ok_or_else(|| LinkError::MissingProgram(name.into()))?;
            let function = obj
                .functions
                .get(&program.function_key())
                .ok_or_else(|| LinkError::MissingProgram(name.into()))?;
            let fd = load_program(name, &function.instructions, &license, kind)?;
            programs.insert(name.to_owned(), fd);
        }
        Ok(Self { kind, programs })
    }

    /// Attaches `program` at `offset` in the file at `path`, in process
    /// `pid` only (0: every process), at the call's return if `returns`
    /// (an entry link). Dropping the link detaches it.
    pub fn attach(
        &self,
        program: &str,
        (path, offset): (&Path, u64),
        cookie: u64,
        pid: u32,
        returns: bool,
    ) -> io::Result<OwnedFd> {
        /// `BPF_F_UPROBE_MULTI_RETURN`.
        const RETURN: u32 = 1;
        let prog = self
            .programs
            .get(program)
            .ok_or_else(|| io::Error::other(format!("program {program} not loaded as a link")))?;
        let path = CString::new(path.as_os_str().as_encoded_bytes())
            .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
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
        bpf(bpf_cmd::BPF_LINK_CREATE, &mut attr)
    }

    /// The ids the kernel gave the programs.
    pub fn program_ids(&self) -> Vec<u32> {
        self.programs
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

fn load_program(
    name: &str,
    instructions: &[bpf_insn],
    license: &CString,
    kind: LinkKind,
) -> Result<OwnedFd, LinkError> {
    let mut log = vec![0u8; 64 * 1024];
    let load = |log_level: u32, log: &mut [u8]| {
        // SAFETY: an all-zero bpf_attr is the kernel's "no options".
        let mut attr: bpf_attr = unsafe { std::mem::zeroed() };
        // SAFETY: writing plain integers into the prog-load member.
        unsafe {
            let prog = &mut attr.__bindgen_anon_3;
            prog.prog_type = bpf_prog_type::BPF_PROG_TYPE_KPROBE as u32;
            prog.expected_attach_type = kind.attach_type();
            prog.insns = instructions.as_ptr() as u64;
            prog.insn_cnt = instructions.len() as u32;
            prog.license = license.as_ptr() as u64;
            for (slot, byte) in prog.prog_name.iter_mut().zip(name.bytes().take(15)) {
                *slot = byte as _;
            }
            if log_level > 0 {
                prog.log_level = log_level;
                prog.log_buf = log.as_mut_ptr() as u64;
                prog.log_size = log.len() as u32;
            }
        }
        bpf(bpf_cmd::BPF_PROG_LOAD, &mut attr)
    };
    // Load without a log first, as libbpf does; ask for one only to explain
    // a refusal.
    load(0, &mut log).map_err(|cause| {
        let _ = load(1, &mut log);
        let text = String::from_utf8_lossy(&log);
        let text = text.trim_end_matches('\0').trim();
        let tail: Vec<&str> = text.lines().rev().take(3).collect();
        let log = if tail.is_empty() {
            String::new()
        } else {
            let tail: Vec<&str> = tail.into_iter().rev().collect();
            format!(" (verifier: {})", tail.join(" | "))
        };
        LinkError::Refused {
            program: name.into(),
            cause,
            log,
        }
    })
}

fn bpf(cmd: bpf_cmd, attr: &mut bpf_attr) -> io::Result<OwnedFd> {
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

/// The fd of a map aya created, for the kinds of maps the object has.
fn map_fd(map: &Map) -> Option<std::os::fd::RawFd> {
    let data = match map {
        Map::Array(data)
        | Map::HashMap(data)
        | Map::LruHashMap(data)
        | Map::PerCpuArray(data)
        | Map::PerCpuHashMap(data)
        | Map::RingBuf(data) => data,
        _ => return None,
    };
    Some(data.fd().as_fd().as_raw_fd())
}
