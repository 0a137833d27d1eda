//! jemalloc 5.3's inlined `malloc` fast path, recognised by decoding it:
//! the size above which it always falls back, the one slow-path function
//! every fallback leads to (`malloc_default`, exported or not), and where
//! the thread's allocated-bytes counter and its next-event threshold live
//! (fs-relative, through a GOT slot in a shared library or an immediate in
//! a static build). What sampling on the slow path needs to know about a
//! build.
use iced_x86::{Code, Decoder, DecoderOptions, FlowControl, Instruction, OpKind, Register};

use crate::binary::{elf::FunctionSymbols, placement};
use crate::discover::{
    by_code, entry_points,
    large_requests::{self, LargeRequestsProbe},
    served::SERVED,
};

/// Most instructions read from malloc's entry.
const MAX_INSTRUCTIONS: usize = 24;

/// Where a thread's TLS block is, relative to its fs base.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TlsOffset {
    /// In a GOT slot (at this address in the file) that the dynamic linker
    /// fills: read in the running process.
    GotSlot(u64),
    /// Known from the code (a static build).
    Immediate(i64),
}

/// A recognised fast path.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FastPath {
    /// Requests above this many bytes always take the slow path.
    pub large_above: u64,
    /// Address of the slow-path function in the file.
    pub slow_path: u64,
    pub tls: TlsOffset,
    /// The allocated-bytes counter, from the TLS block; the threshold is
    /// the next word.
    pub allocated: i64,
}

/// A recognised fast path, its addresses as file offsets, and where its
/// slow path's probe goes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SlowPath {
    pub fast: FastPath,
    pub placement: crate::binary::placement::Placement,
    /// Where the slow path sends the requests no thread cache holds,
    /// where that was found: probed instead of its entry.
    pub large_requests: Option<LargeRequestsProbe>,
    /// File-offset extents of jemalloc's own code between its slow path
    /// and the program: the served entry points and the functions they
    /// branch to (`operator new`'s fallback). A sample's leading frames
    /// there are not the program's.
    pub own_code: std::sync::Arc<[std::ops::Range<u64>]>,
}

/// jemalloc's version string in an ELF file's read-only data: the release,
/// before its build's git suffix.
pub fn version_in_file(data: &[u8]) -> Option<String> {
    crate::binary::elf::read_only_data(data)
        .into_iter()
        .find_map(version)
}

/// jemalloc's version string in `data` (`5.3.0-0-g54eaed1d...`): the
/// release, before its build's git suffix.
pub fn version(data: &[u8]) -> Option<String> {
    memchr::memmem::find_iter(data, b"-g").find_map(|at| {
        let hash = data.get(at + 2..at + 42)?;
        if !hash.iter().all(u8::is_ascii_hexdigit) {
            return None;
        }
        // Walk back over "MAJOR.MINOR.PATCH-N".
        let start = data[..at]
            .iter()
            .rposition(|b| !(b.is_ascii_digit() || *b == b'.' || *b == b'-'))
            .map_or(0, |p| p + 1);
        let release = std::str::from_utf8(&data[start..at]).ok()?;
        let (release, _commits) = release.rsplit_once('-')?;
        (release.split('.').count() == 3).then(|| release.to_owned())
    })
}

/// Decodes jemalloc's `malloc` at `address` (its code in `code`); `None`
/// when it is not 5.3's fast path as this knows it.
pub fn recognise(symbols: &FunctionSymbols, data: &[u8], address: u64) -> Option<FastPath> {
    let code = symbols.code(data, address, 256)?;
    let instructions: Vec<Instruction> = Decoder::with_ip(64, code, address, DecoderOptions::NONE)
        .into_iter()
        .take(MAX_INSTRUCTIONS)
        .take_while(|i| !i.is_invalid() && i.flow_control() != FlowControl::Return)
        .collect();
    let (large_above, large_branch) = size_check(&instructions)?;
    let (base, allocated) = counter_load(&instructions)?;
    let threshold_branch = threshold_check(&instructions, base, allocated)?;
    let tls = tls_source(&instructions, base)?;
    let slow_path = final_target(symbols, data, large_branch)?;
    let same = final_target(symbols, data, threshold_branch)? == slow_path;
    (same && symbols.is_function_start(slow_path)).then_some(FastPath {
        large_above,
        slow_path,
        tls,
        allocated,
    })
}

/// `cmp rdi, N; ja SLOW` (gcc) or `cmp rdi, N + 1; jae SLOW` (clang):
/// (N, SLOW).
fn size_check(instructions: &[Instruction]) -> Option<(u64, u64)> {
    let at = instructions.iter().position(|i| {
        matches!(i.code(), Code::Cmp_rm64_imm32 | Code::Cmp_rm64_imm8)
            && i.op0_kind() == OpKind::Register
            && i.op0_register() == Register::RDI
    })?;
    let jump = instructions.get(at + 1)?;
    let limit = instructions[at].immediate(1);
    match jump.code() {
        Code::Ja_rel32_64 | Code::Ja_rel8_64 => Some((limit, jump.near_branch_target())),
        Code::Jae_rel32_64 | Code::Jae_rel8_64 => {
            Some((limit.checked_sub(1)?, jump.near_branch_target()))
        }
        _ => None,
    }
}

/// `mov reg, fs:[BASE + A]`: (BASE, A).
fn counter_load(instructions: &[Instruction]) -> Option<(Register, i64)> {
    instructions.iter().find_map(|i| {
        let fs_load = i.code() == Code::Mov_r64_rm64
            && i.op1_kind() == OpKind::Memory
            && i.segment_prefix() == Register::FS
            && i.memory_base() != Register::None;
        fs_load.then(|| (i.memory_base(), i.memory_displacement64() as i64))
    })
}

/// `cmp reg, fs:[BASE + A + 8]; jae SLOW` (or `cmp fs:[...], reg; jbe
/// SLOW`): SLOW.
fn threshold_check(instructions: &[Instruction], base: Register, allocated: i64) -> Option<u64> {
    let at = instructions.iter().position(|i| {
        i.mnemonic() == iced_x86::Mnemonic::Cmp
            && i.segment_prefix() == Register::FS
            && i.memory_base() == base
            && i.memory_displacement64() as i64 == allocated + 8
    })?;
    past_threshold(&instructions[at], instructions.get(at + 1)?)
}

/// Where `jump` goes when the counter `compare` tests reaches its
/// threshold (the memory operand): `jae` after `cmp counter, threshold`,
/// `jbe` after `cmp threshold, counter`.
pub(crate) fn past_threshold(compare: &Instruction, jump: &Instruction) -> Option<u64> {
    let expected: &[Code] = if compare.op0_kind() == OpKind::Memory {
        &[Code::Jbe_rel32_64, Code::Jbe_rel8_64]
    } else {
        &[Code::Jae_rel32_64, Code::Jae_rel8_64]
    };
    expected
        .contains(&jump.code())
        .then(|| jump.near_branch_target())
}

/// Where BASE came from: `mov BASE, [rip + slot]` or `mov BASE, imm`.
pub(crate) fn tls_source(instructions: &[Instruction], base: Register) -> Option<TlsOffset> {
    instructions.iter().find_map(|i| {
        if i.op0_kind() != OpKind::Register || i.op0_register() != base {
            return None;
        }
        match i.code() {
            Code::Mov_r64_rm64 if i.is_ip_rel_memory_operand() => {
                Some(TlsOffset::GotSlot(i.ip_rel_memory_address()))
            }
            Code::Mov_r64_imm64 | Code::Mov_rm64_imm32 => {
                Some(TlsOffset::Immediate(i.immediate(1) as i64))
            }
            _ => None,
        }
    })
}

/// Where a branch ends up, through one `jmp` at its target.
pub(crate) fn final_target(symbols: &FunctionSymbols, data: &[u8], target: u64) -> Option<u64> {
    let code = symbols.code(data, target, 16)?;
    let first = Decoder::with_ip(64, code, target, DecoderOptions::NONE).decode();
    if first.flow_control() == FlowControl::UnconditionalBranch
        && first.op0_kind() == OpKind::NearBranch64
    {
        return Some(first.near_branch_target());
    }
    Some(target)
}

/// A recognised fast path with its addresses as file offsets (what
/// uprobes and `/proc/PID/mem` take), and its slow path's probe placed.
pub(crate) fn in_file_offsets(
    symbols: &FunctionSymbols,
    data: &[u8],
    fast: FastPath,
    prefix: &str,
) -> Option<SlowPath> {
    let code = symbols.code(data, fast.slow_path, 64)?;
    let reads = entry_points::registers_read(profiler_common::CallShape::SlowPath);
    let placement = placement::place(code, fast.slow_path, reads, true);
    let tls = match fast.tls {
        TlsOffset::GotSlot(slot) => TlsOffset::GotSlot(symbols.file_offset(slot)?),
        immediate => immediate,
    };
    let large_requests = large_requests::find(symbols, data, fast.slow_path)
        .and_then(|found| found.in_file(symbols, data));
    let mut own_code = own_code(symbols, data, prefix, &SERVED);
    // Its samples' leading frames are jemalloc's too.
    own_code.extend(large_requests.as_ref().map(|l| l.function.clone()));
    Some(SlowPath {
        fast: FastPath {
            slow_path: symbols.file_offset(fast.slow_path)?,
            tls,
            ..fast
        },
        placement,
        large_requests,
        own_code: own_code.into(),
    })
}

/// The extents (file offsets) of the entry points `names` (bare or with
/// `prefix`) and of every function they branch to directly.
pub(crate) fn own_code(
    symbols: &FunctionSymbols,
    data: &[u8],
    prefix: &str,
    names: &[&str],
) -> Vec<std::ops::Range<u64>> {
    // A function's length: to the next start the call frame information
    // knows, else its symbol's size.
    let length = |address: u64, size: u64| {
        let end = symbols
            .next_function_start(address)
            .unwrap_or(address + size);
        end.saturating_sub(address)
    };
    let mut extents = Vec::new();
    let found_by_code = symbols
        .names()
        .filter(|name| name.starts_with(by_code::OPERATOR_NEW))
        .map(str::to_owned);
    let served = names
        .iter()
        .flat_map(|name| [name.to_string(), format!("{prefix}{name}")])
        .chain(found_by_code)
        .filter_map(|name| symbols.function(&name));
    for function in served {
        let len = length(function.address, function.size);
        extents.push((function.address, len));
        let Some(code) = symbols.code(data, function.address, len) else {
            continue;
        };
        for target in crate::binary::code::branch_targets(code, function.address) {
            if target != function.address && symbols.is_function_start(target) {
                extents.push((target, length(target, 0)));
            }
        }
    }
    let mut ranges: Vec<std::ops::Range<u64>> = extents
        .into_iter()
        .filter(|&(_, len)| len > 0)
        .filter_map(|(address, len)| {
            let offset = symbols.file_offset(address)?;
            Some(offset..offset + len)
        })
        .collect();
    ranges.sort_by_key(|r| (r.start, r.end));
    ranges.dedup();
    ranges
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    fn fast_path_of(path: &Path, malloc: &str) -> Option<(FastPath, FunctionSymbols)> {
        let Ok(data) = std::fs::read(path) else {
            eprintln!("skipped: {} is not there", path.display());
            return None;
        };
        let symbols = FunctionSymbols::parse(&data).unwrap();
        let address = symbols.function(malloc).unwrap().address;
        Some((
            recognise(&symbols, &data, address).expect("recognised"),
            symbols,
        ))
    }

    #[test]
    fn reads_jemallocs_version_string() {
        let path = Path::new("/usr/lib/x86_64-linux-gnu/libjemalloc.so.2");
        let Ok(data) = std::fs::read(path) else {
            return;
        };
        assert_eq!(version(&data).as_deref(), Some("5.3.0"));
        assert_eq!(version(b"nothing here -gXYZ"), None);
        let built = b"\0JEMALLOC 5.3.1-12-g0123456789abcdef0123456789abcdef01234567\0";
        assert_eq!(version(built).as_deref(), Some("5.3.1"));
    }

    /// Debian's libjemalloc2 5.3.0: the TLS offset in a GOT slot, the
    /// counters at +0x338 and +0x340, `malloc_default` not exported but a
    /// function start in `.eh_frame`.
    #[test]
    fn debians_shared_libjemalloc() {
        let path = Path::new("/usr/lib/x86_64-linux-gnu/libjemalloc.so.2");
        let Some((fast, symbols)) = fast_path_of(path, "malloc") else {
            return;
        };
        assert_eq!(fast.large_above, 4096);
        assert_eq!(fast.allocated, 0x338);
        assert!(matches!(fast.tls, TlsOffset::GotSlot(_)), "{fast:?}");
        assert!(symbols.is_function_start(fast.slow_path));
        let malloc = symbols.function("malloc").unwrap().address;
        assert_ne!(fast.slow_path, malloc);
    }

    /// jemalloc's own code between its slow path and the program: malloc,
    /// operator new and what they branch to, the slow path among it; not
    /// free, which the program calls itself.
    #[test]
    fn own_code_covers_the_served_entry_points_and_their_fallbacks() {
        let path = Path::new("/usr/lib/x86_64-linux-gnu/libjemalloc.so.2");
        let Ok(data) = std::fs::read(path) else {
            return;
        };
        let symbols = FunctionSymbols::parse(&data).unwrap();
        let malloc = symbols.function("malloc").unwrap();
        let fast = recognise(&symbols, &data, malloc.address).unwrap();
        let slow = in_file_offsets(&symbols, &data, fast, "").unwrap();
        let inside = |offset: u64| slow.own_code.iter().any(|r| r.contains(&offset));
        for name in ["malloc", "_Znwm"] {
            let function = symbols.function(name).unwrap();
            assert!(
                inside(function.file_offset + 1),
                "{name}: {:x?}",
                slow.own_code
            );
        }
        assert!(inside(slow.fast.slow_path + 1), "{:x?}", slow.own_code);
        assert!(!inside(symbols.function("free").unwrap().file_offset + 1));
    }

    /// A build without that shape is not recognised: glibc's malloc.
    #[test]
    fn glibc_malloc_is_not_jemallocs_fast_path() {
        let path = Path::new("/lib/x86_64-linux-gnu/libc.so.6");
        let Ok(data) = std::fs::read(path) else {
            return;
        };
        let symbols = FunctionSymbols::parse(&data).unwrap();
        let malloc = symbols.function("malloc").unwrap().address;
        assert_eq!(recognise(&symbols, &data, malloc), None);
    }
}
