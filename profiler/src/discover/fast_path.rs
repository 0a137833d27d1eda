//! jemalloc 5.3's inlined `malloc` fast path, recognised by decoding it:
//! the size above which it always falls back, the one slow-path function
//! every fallback leads to (`malloc_default`, exported or not), and where
//! the thread's allocated-bytes counter and its next-event threshold live
//! (fs-relative, through a GOT slot in a shared library or an immediate in
//! a static build; in a block `__tls_get_addr` finds, in a library built
//! to be loaded with dlopen). What sampling on the slow path needs to know
//! about a build.
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
    /// Not at a fixed place (general-dynamic TLS, in a library loaded with
    /// `dlopen`): the `tls_index` (module id, offset in its block) at this
    /// address in the file, which the dynamic linker fills and the code
    /// passes to `__tls_get_addr`.
    TlsIndex(u64),
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
    let (base, allocated, tls) = match counter_load(&instructions) {
        Some((base, allocated)) => (base, allocated, tls_source(&instructions, base)?),
        None => general_dynamic(code, address, &instructions)?,
    };
    let segment = match tls {
        TlsOffset::TlsIndex(_) => Register::None,
        _ => Register::FS,
    };
    let threshold_branch = threshold_check(&instructions, segment, base, allocated)?;
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

/// The general-dynamic TLS sequence, `data16 lea rdi, [rip + INDEX];
/// data16 data16 rex.W call __tls_get_addr` (padded so that the linker
/// can relax it, and only it, in place), then `mov reg, [rax + A]`: (rax,
/// A, INDEX).
fn general_dynamic(
    code: &[u8],
    address: u64,
    instructions: &[Instruction],
) -> Option<(Register, i64, TlsOffset)> {
    let bytes = |i: &Instruction| code.get((i.ip() - address) as usize..).unwrap_or_default();
    let at = instructions.windows(2).position(|pair| {
        let [lea, call] = pair else { return false };
        lea.code() == Code::Lea_r64_m
            && lea.op0_register() == Register::RDI
            && lea.is_ip_rel_memory_operand()
            && bytes(lea).starts_with(&[0x66, 0x48, 0x8d, 0x3d])
            && call.flow_control() == FlowControl::Call
            && bytes(call).starts_with(&[0x66, 0x66, 0x48, 0xe8])
    })?;
    let index = instructions[at].ip_rel_memory_address();
    let allocated = instructions[at + 2..].iter().find_map(|i| {
        let load = i.code() == Code::Mov_r64_rm64
            && i.op1_kind() == OpKind::Memory
            && i.memory_base() == Register::RAX
            && i.memory_index() == Register::None;
        load.then(|| i.memory_displacement64() as i64)
    })?;
    Some((Register::RAX, allocated, TlsOffset::TlsIndex(index)))
}

/// `cmp reg, SEGMENT:[BASE + A + 8]; jae SLOW` (or `cmp [...], reg; jbe
/// SLOW`): SLOW.
fn threshold_check(
    instructions: &[Instruction],
    segment: Register,
    base: Register,
    allocated: i64,
) -> Option<u64> {
    let at = instructions.iter().position(|i| {
        i.mnemonic() == iced_x86::Mnemonic::Cmp
            && i.segment_prefix() == segment
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

/// Most register moves and pops before the `jmp` a branch ends up at.
const MAX_EPILOGUE: usize = 8;

/// Where a branch ends up, through one `jmp` at its target, or after the
/// register moves and pops before it (the epilogue of a `malloc` that
/// saved registers, as the builds inside pyarrow and polars have: `add
/// rsp, 8; pop rbx; mov rdi, rbp; pop rbp; jmp SLOW`).
pub(crate) fn final_target(symbols: &FunctionSymbols, data: &[u8], target: u64) -> Option<u64> {
    let code = symbols.code(data, target, 64)?;
    let decoder = Decoder::with_ip(64, code, target, DecoderOptions::NONE);
    for instruction in decoder.into_iter().take(MAX_EPILOGUE + 1) {
        if instruction.flow_control() == FlowControl::UnconditionalBranch
            && instruction.op0_kind() == OpKind::NearBranch64
        {
            return Some(instruction.near_branch_target());
        }
        let register_only = instruction.flow_control() == FlowControl::Next
            && (0..instruction.op_count()).all(|k| {
                matches!(
                    instruction.op_kind(k),
                    OpKind::Register
                        | OpKind::Immediate8
                        | OpKind::Immediate8to64
                        | OpKind::Immediate32
                        | OpKind::Immediate32to64
                )
            });
        if !register_only {
            break;
        }
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
        TlsOffset::TlsIndex(index) => TlsOffset::TlsIndex(symbols.file_offset(index)?),
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

    /// The fast path of a jemalloc built for a library loaded with dlopen
    /// (polars' runtime, pyarrow's libarrow), written out: its TLS block
    /// from `__tls_get_addr`, the counters at +0x338 and +0x340 of it.
    #[test]
    fn a_general_dynamic_fast_path_reads_its_tls_index() {
        let address = 0x1000u64;
        let code: Vec<u8> = [
            &[0x48, 0x81, 0xff, 0x00, 0x10, 0x00, 0x00][..], // cmp rdi, 0x1000
            &[0x0f, 0x87, 0x40, 0x00, 0x00, 0x00],           // ja +0x40
            &[0x66, 0x48, 0x8d, 0x3d, 0x00, 0x20, 0x00, 0x00], // data16 lea rdi, [rip+0x2000]
            &[0x66, 0x66, 0x48, 0xe8, 0x00, 0x01, 0x00, 0x00], // call __tls_get_addr
            &[0x48, 0x8b, 0x88, 0x38, 0x03, 0x00, 0x00],     // mov rcx, [rax+0x338]
            &[0x48, 0x3b, 0x88, 0x40, 0x03, 0x00, 0x00],     // cmp rcx, [rax+0x340]
            &[0x0f, 0x83, 0x10, 0x00, 0x00, 0x00],           // jae +0x10
        ]
        .concat();
        let instructions: Vec<Instruction> =
            Decoder::with_ip(64, &code, address, DecoderOptions::NONE)
                .into_iter()
                .collect();
        // rip-relative from the lea's end, the branch from the jae's.
        let index = address + 21 + 0x2000;
        assert_eq!(
            general_dynamic(&code, address, &instructions),
            Some((Register::RAX, 0x338, TlsOffset::TlsIndex(index)))
        );
        assert_eq!(counter_load(&instructions), None);
        let slow = threshold_check(&instructions, Register::None, Register::RAX, 0x338);
        assert_eq!(slow, Some(address + 49 + 0x10));
        // Without the padding that marks the sequence, no TLS access.
        let mut plain = code.clone();
        plain[13] = 0x90;
        let instructions: Vec<Instruction> =
            Decoder::with_ip(64, &plain, address, DecoderOptions::NONE)
                .into_iter()
                .collect();
        assert_eq!(general_dynamic(&plain, address, &instructions), None);
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
