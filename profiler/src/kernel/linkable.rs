//! The eBPF object's programs made ready for `uprobe_multi` links, which
//! aya 0.14 cannot load (see `uprobe_multi`): parsed and relocated once
//! against the maps aya created, with the object's BTF loaded beside them,
//! and each program loaded into the kernel only when a link first needs it.
//!
//! The BTF matters: without it the verifier takes every global function
//! for a static one and checks it again at each call, and the sampling
//! programs' Python frame walk made their load several times dearer. Each
//! program verified costs memprobe's CPU (40 ms and more each here), so a
//! run loads only what it links.
use std::{
    collections::{HashMap, HashSet},
    ffi::CString,
    os::fd::{AsFd, AsRawFd, OwnedFd},
};

use aya::{Ebpf, maps::Map};
use aya_obj::generated::{bpf_attr, bpf_cmd, bpf_insn, bpf_prog_type};

use crate::kernel::uprobe_multi::{LinkError, LinkKind, bpf};

/// One program's code, relocated, with its BTF records.
struct ProgramCode {
    instructions: Vec<bpf_insn>,
    func_info: BtfRecords,
    line_info: BtfRecords,
}

/// A program's `bpf_func_info` or `bpf_line_info` records, as bytes.
struct BtfRecords {
    bytes: Vec<u8>,
    count: u32,
    record_size: u32,
}

/// The object's programs, ready to load.
pub struct LinkableCode {
    programs: HashMap<String, ProgramCode>,
    license: CString,
    /// The object's BTF as the kernel took it; `None` where it refused it
    /// (the programs then load without, verified more slowly).
    btf: Option<OwnedFd>,
}

impl LinkableCode {
    /// Parses `object` (the bytes aya loaded `ebpf` from) and relocates
    /// the programs named in `names` against `ebpf`'s maps.
    pub fn parse(ebpf: &Ebpf, object: &[u8], names: &[&str]) -> Result<Self, LinkError> {
        let mut obj =
            aya_obj::Object::parse(object).map_err(|e| LinkError::Object(e.to_string()))?;
        let btf = aya::features()
            .btf()
            .and_then(|features| obj.fixup_and_sanitize_btf(features).ok().flatten())
            .and_then(|btf| load_btf(&btf.to_bytes()));
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
        let mut programs = HashMap::new();
        for &name in names {
            let function = obj
                .programs
                .get(name)
                .and_then(|program| obj.functions.get(&program.function_key()))
                .ok_or_else(|| LinkError::MissingProgram(name.into()))?;
            let code = ProgramCode {
                instructions: function.instructions.clone(),
                func_info: BtfRecords {
                    bytes: function.func_info.func_info_bytes(),
                    count: function.func_info.len() as u32,
                    record_size: function.func_info_rec_size as u32,
                },
                line_info: BtfRecords {
                    bytes: function.line_info.line_info_bytes(),
                    count: function.line_info.len() as u32,
                    record_size: function.line_info_rec_size as u32,
                },
            };
            programs.insert(name.to_owned(), code);
        }
        Ok(Self {
            programs,
            license: obj.license.clone(),
            btf,
        })
    }

    /// Loads `name` into the kernel as a program for `kind`'s links.
    pub fn load(&self, name: &str, kind: LinkKind) -> Result<OwnedFd, LinkError> {
        let code = self
            .programs
            .get(name)
            .ok_or_else(|| LinkError::MissingProgram(name.into()))?;
        let mut log = vec![0u8; 64 * 1024];
        // Load without a log first, as libbpf does; ask for one only to
        // explain a refusal.
        self.load_logged(name, code, kind, None).map_err(|cause| {
            let _ = self.load_logged(name, code, kind, Some(&mut log));
            LinkError::Refused {
                program: name.into(),
                cause,
                log: verifier_tail(&log),
            }
        })
    }

    fn load_logged(
        &self,
        name: &str,
        code: &ProgramCode,
        kind: LinkKind,
        log: Option<&mut [u8]>,
    ) -> std::io::Result<OwnedFd> {
        // SAFETY: an all-zero bpf_attr is the kernel's "no options".
        let mut attr: bpf_attr = unsafe { std::mem::zeroed() };
        // SAFETY: writing plain integers into the prog-load member; every
        // pointer points into `code`, `self` or `log`, alive for the call.
        unsafe {
            let prog = &mut attr.__bindgen_anon_3;
            prog.prog_type = bpf_prog_type::BPF_PROG_TYPE_KPROBE as u32;
            prog.expected_attach_type = kind.attach_type();
            prog.insns = code.instructions.as_ptr() as u64;
            prog.insn_cnt = code.instructions.len() as u32;
            prog.license = self.license.as_ptr() as u64;
            for (slot, byte) in prog.prog_name.iter_mut().zip(name.bytes().take(15)) {
                *slot = byte as _;
            }
            if let Some(btf) = &self.btf {
                prog.prog_btf_fd = btf.as_raw_fd() as u32;
                if code.func_info.record_size > 0 {
                    prog.func_info = code.func_info.bytes.as_ptr() as u64;
                    prog.func_info_cnt = code.func_info.count;
                    prog.func_info_rec_size = code.func_info.record_size;
                }
                if code.line_info.record_size > 0 {
                    prog.line_info = code.line_info.bytes.as_ptr() as u64;
                    prog.line_info_cnt = code.line_info.count;
                    prog.line_info_rec_size = code.line_info.record_size;
                }
            }
            if let Some(log) = log {
                prog.log_level = 1;
                prog.log_buf = log.as_mut_ptr() as u64;
                prog.log_size = log.len() as u32;
            }
        }
        bpf(bpf_cmd::BPF_PROG_LOAD, &mut attr)
    }
}

/// The verifier's last three lines, to say why it refused a program.
fn verifier_tail(log: &[u8]) -> String {
    let text = String::from_utf8_lossy(log);
    let text = text.trim_end_matches('\0').trim();
    let tail: Vec<&str> = text.lines().rev().take(3).collect();
    if tail.is_empty() {
        return String::new();
    }
    let tail: Vec<&str> = tail.into_iter().rev().collect();
    format!(" (verifier: {})", tail.join(" | "))
}

/// Loads the object's BTF; `None` where the kernel refuses it.
fn load_btf(bytes: &[u8]) -> Option<OwnedFd> {
    // SAFETY: an all-zero bpf_attr is the kernel's "no options".
    let mut attr: bpf_attr = unsafe { std::mem::zeroed() };
    // SAFETY: writing plain integers into the BTF-load member; `bytes`
    // outlives the call.
    unsafe {
        let btf = &mut attr.__bindgen_anon_7;
        btf.btf = bytes.as_ptr() as u64;
        btf.btf_size = bytes.len() as u32;
    }
    bpf(bpf_cmd::BPF_BTF_LOAD, &mut attr).ok()
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
