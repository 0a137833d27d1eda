//! Other tools' uprobe_multi links (another memprobe's among them) that
//! force a return on every call where memprobe has a probe: a link made
//! for another process is filtered out in a profiled one, and there a
//! uretprobe link, or a uprobe session, asks for the return half anyway
//! (see `shared`). The kernel lists every BPF link; a uprobe_multi link's
//! info gives its file, offsets, process and flags.
//!
//! A return link says so in its flags. A session does not (its attach
//! type is not in the link's info): another memprobe's is known by its
//! program's name, another tool's entry-only link and session look alike
//! and are left out.
use std::{
    collections::{HashMap, HashSet},
    io,
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
};

use aya_obj::generated::{bpf_attr, bpf_cmd, bpf_link_info, bpf_link_type, bpf_prog_info};
use profiler_common::programs;

use crate::{kernel::uprobe_multi::bpf_call as bpf, proc::FileId};

/// `BPF_F_UPROBE_MULTI_RETURN`.
const RETURN: u32 = 1;
/// Offsets read per link (memprobe's have one); a link with more is left
/// out.
const MAX_OFFSETS: usize = 4096;
/// Links read per scan, so that a host with very many costs a bounded
/// time; the rest are not seen.
const MAX_LINKS: usize = 100_000;

/// Places (file and offset) where another process's link forces returns,
/// with the processes each is made for.
pub type ForcingPlaces = HashMap<(FileId, u64), Vec<u32>>;

/// The places where links other than those of `own_programs` force a
/// return in processes other than theirs.
pub fn forcing_places(own_programs: &HashSet<u32>) -> ForcingPlaces {
    let mut places = ForcingPlaces::new();
    let mut id = 0;
    for _ in 0..MAX_LINKS {
        let Some(next) = next_link_id(id) else { break };
        id = next;
        let Some(link) = uprobe_multi_link(id) else {
            continue;
        };
        if own_programs.contains(&link.program) || link.pid == 0 || !link.forces_returns() {
            continue;
        }
        let Ok(meta) = std::fs::metadata(&link.path) else {
            continue;
        };
        let file = FileId::of(&meta);
        for &offset in &link.offsets {
            places.entry((file, offset)).or_default().push(link.pid);
        }
    }
    places
}

/// The id the kernel gave a program memprobe loaded.
pub fn program_id(program: &OwnedFd) -> Option<u32> {
    // SAFETY: bpf_prog_info is plain integers; all-zero asks for nothing.
    let mut info: bpf_prog_info = unsafe { std::mem::zeroed() };
    object_info(program.as_raw_fd(), &mut info).ok()?;
    Some(info.id)
}

/// What a uprobe_multi link's info tells.
struct MultiLink {
    program: u32,
    path: String,
    offsets: Vec<u64>,
    flags: u32,
    pid: u32,
}

impl MultiLink {
    /// A return link; or a session of another memprobe's, known by its
    /// program's name.
    fn forces_returns(&self) -> bool {
        self.flags & RETURN != 0 || program_name(self.program).is_some_and(is_memprobe_session)
    }
}

/// Whether a program's name, cut to 15 bytes by the kernel, is one of
/// memprobe's session programs'.
fn is_memprobe_session(name: String) -> bool {
    programs::session::ALL
        .iter()
        .any(|session| session.bytes().take(15).eq(name.bytes()))
}

fn next_link_id(start: u32) -> Option<u32> {
    // SAFETY: an all-zero bpf_attr is the kernel's "no options".
    let mut attr: bpf_attr = unsafe { std::mem::zeroed() };
    attr.__bindgen_anon_6.__bindgen_anon_1.start_id = start;
    bpf(bpf_cmd::BPF_LINK_GET_NEXT_ID, &mut attr).ok()?;
    // SAFETY: the kernel filled in the member it was asked for.
    Some(unsafe { attr.__bindgen_anon_6.next_id })
}

/// Link `id`'s info, if it is a uprobe_multi link still there.
fn uprobe_multi_link(id: u32) -> Option<MultiLink> {
    let fd = fd_by_id(bpf_cmd::BPF_LINK_GET_FD_BY_ID, id)?;
    // First with no buffers, for its type and number of offsets: the
    // union's buffers mean other things for other types of link.
    // SAFETY: bpf_link_info is plain integers; all-zero asks for nothing.
    let mut info: bpf_link_info = unsafe { std::mem::zeroed() };
    object_info(fd.as_raw_fd(), &mut info).ok()?;
    if info.type_ != bpf_link_type::BPF_LINK_TYPE_UPROBE_MULTI as u32 {
        return None;
    }
    // SAFETY: the kernel filled in the uprobe_multi member.
    let count = unsafe { info.__bindgen_anon_1.uprobe_multi.count } as usize;
    let mut path = vec![0u8; 4096];
    let mut offsets = vec![0u64; count.min(MAX_OFFSETS)];
    // SAFETY: writing plain integers into the uprobe_multi member; the
    // buffers outlive the call that fills them.
    unsafe {
        let multi = &mut info.__bindgen_anon_1.uprobe_multi;
        multi.path = path.as_mut_ptr() as u64;
        multi.path_size = path.len() as u32;
        multi.offsets = offsets.as_mut_ptr() as u64;
        multi.count = offsets.len() as u32;
    }
    // A link with more offsets than fit is refused (ENOSPC) and left out.
    object_info(fd.as_raw_fd(), &mut info).ok()?;
    // SAFETY: as above.
    let multi = unsafe { info.__bindgen_anon_1.uprobe_multi };
    let end = path.iter().position(|&b| b == 0).unwrap_or(path.len());
    Some(MultiLink {
        program: info.prog_id,
        path: String::from_utf8_lossy(&path[..end]).into_owned(),
        offsets,
        flags: multi.flags,
        pid: multi.pid,
    })
}

/// Program `id`'s name (at most 15 bytes).
fn program_name(id: u32) -> Option<String> {
    let fd = fd_by_id(bpf_cmd::BPF_PROG_GET_FD_BY_ID, id)?;
    // SAFETY: bpf_prog_info is plain integers; all-zero asks for nothing.
    let mut info: bpf_prog_info = unsafe { std::mem::zeroed() };
    object_info(fd.as_raw_fd(), &mut info).ok()?;
    let name: Vec<u8> = info
        .name
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    Some(String::from_utf8_lossy(&name).into_owned())
}

/// `BPF_OBJ_GET_INFO_BY_FD` into `info`, a kernel info struct.
fn object_info<T>(fd: i32, info: &mut T) -> io::Result<()> {
    // SAFETY: as above.
    let mut attr: bpf_attr = unsafe { std::mem::zeroed() };
    attr.info.bpf_fd = fd as u32;
    attr.info.info_len = std::mem::size_of::<T>() as u32;
    attr.info.info = info as *mut T as u64;
    bpf(bpf_cmd::BPF_OBJ_GET_INFO_BY_FD, &mut attr).map(|_| ())
}

/// A fd of the link or program (by `cmd`) with that id, if still there.
fn fd_by_id(cmd: bpf_cmd, id: u32) -> Option<OwnedFd> {
    // SAFETY: an all-zero bpf_attr is the kernel's "no options".
    let mut attr: bpf_attr = unsafe { std::mem::zeroed() };
    // One slot holds the id for every kind of object.
    attr.__bindgen_anon_6.__bindgen_anon_1.start_id = id;
    let fd = bpf(cmd, &mut attr).ok()?;
    // SAFETY: a fresh fd that nothing else owns.
    Some(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn return_links_force_returns() {
        let link = |flags| MultiLink {
            program: u32::MAX,
            path: String::new(),
            offsets: vec![],
            flags,
            pid: 1,
        };
        // A program that does not exist has no name: only the flag counts.
        assert!(link(RETURN).forces_returns());
        assert!(!link(0).forces_returns());
    }

    #[test]
    fn memprobe_sessions_are_known_by_their_cut_names() {
        assert!(is_memprobe_session("session_slow_pa".into()));
        assert!(is_memprobe_session("session_size_ar".into()));
        assert!(!is_memprobe_session("session_slow".into()));
        assert!(!is_memprobe_session("uprobe_malloc".into()));
    }
}
