//! The shapes of jemalloc's entry points, each read from one function's
//! first instructions: what the code of `free`, `calloc`, `mallocx` and
//! `realloc` compiles to under gcc and clang, and 5.2's `malloc` and `free`
//! (5.3's `malloc` is
//! [`fast_path::recognise`](crate::discover::fast_path::recognise)).
use std::collections::BTreeSet;

use iced_x86::{Code, FlowControl, Instruction, Mnemonic, OpKind, Register};

use crate::binary::{code::straight_line_exit, elf::FunctionSymbols};
use crate::discover::{
    by_code::Head,
    fast_path::{self, FastPath},
};

/// jemalloc's fast paths serve sizes up to this (`SC_LOOKUP_MAXCLASS`).
const LOOKUP_MAX: u64 = 4096;
/// The same test as clang writes it: `cmp 4097; jae`.
const LOOKUP_CLANG: u64 = LOOKUP_MAX + 1;
/// Bytes read from a branch's target to follow it.
const TARGET_BYTES: u64 = 64;

/// A free's shape: the fs-relative counter at `counter`, compared with the
/// word after it, branching to a fallback that is a function start. Whether
/// a size test (`cmp rsi, 4096`) comes first, and the counters' base register.
pub(super) fn free_shape(
    symbols: &FunctionSymbols,
    data: &[u8],
    head: &Head,
    counter: i64,
) -> Option<(bool, Register)> {
    let instructions = &head.instructions;
    let read = instructions.iter().position(|i| {
        i.segment_prefix() == Register::FS
            && i.memory_base() != Register::None
            && i.memory_displacement64() as i64 == counter
            && matches!(i.mnemonic(), Mnemonic::Add | Mnemonic::Mov)
    })?;
    let base = instructions[read].memory_base();
    let compare = instructions[read..].iter().position(|i| {
        i.mnemonic() == Mnemonic::Cmp
            && i.segment_prefix() == Register::FS
            && i.memory_base() == base
            && i.memory_displacement64() as i64 == counter + 8
    })? + read;
    let jump = instructions.get(compare + 1)?;
    let target = fast_path::past_threshold(&instructions[compare], jump)?;
    fallback(symbols, data, head, target)?;
    let sized = instructions[..read]
        .iter()
        .any(|i| is_size_test(i, Register::RSI));
    Some((sized, base))
}

/// The function a fast path's branch to `target` falls back to: `target`
/// itself, or where its straight line leaves for; never the function
/// itself.
fn fallback(symbols: &FunctionSymbols, data: &[u8], head: &Head, target: u64) -> Option<u64> {
    let function = if symbols.is_function_start(target) {
        target
    } else {
        straight_line_exit(symbols.code(data, target, TARGET_BYTES)?, target)?
    };
    (symbols.is_function_start(function) && function != head.address).then_some(function)
}

/// jemalloc 5.2's fast paths: the thread's tcache event ticker counted
/// down in its block (`sub dword fs:[BASE + T], 1; js FALLBACK`): BASE and
/// the fallback function.
fn ticker_52(symbols: &FunctionSymbols, data: &[u8], head: &Head) -> Option<(Register, u64)> {
    let instructions = &head.instructions;
    let at = instructions.iter().position(|i| {
        i.mnemonic() == Mnemonic::Sub
            && i.segment_prefix() == Register::FS
            && i.memory_base() != Register::None
            && i.op0_kind() == OpKind::Memory
            && matches!(i.op1_kind(), OpKind::Immediate8to32 | OpKind::Immediate32)
            && i.immediate(1) == 1
    })?;
    let jump = instructions.get(at + 1)?;
    if !matches!(jump.code(), Code::Js_rel8_64 | Code::Js_rel32_64) {
        return None;
    }
    let fallback = fallback(symbols, data, head, jump.near_branch_target())?;
    Some((instructions[at].memory_base(), fallback))
}

/// Where a 5.2 fast path adds to a thread counter: `add fs:[BASE + C],
/// reg`, C.
fn counter_added_52(instructions: &[Instruction], base: Register) -> Option<i64> {
    instructions.iter().find_map(|i| {
        let adds = i.mnemonic() == Mnemonic::Add
            && i.segment_prefix() == Register::FS
            && i.op0_kind() == OpKind::Memory
            && i.memory_base() == base
            && i.op1_kind() == OpKind::Register;
        adds.then(|| i.memory_displacement64() as i64)
    })
}

/// jemalloc 5.2's malloc: the size test against 4096 and the ticker both
/// falling back to one function, and the thread's allocated-bytes counter
/// added to: as a [`FastPath`] whose `allocated` is that counter.
pub(super) fn malloc_52(symbols: &FunctionSymbols, data: &[u8], head: &Head) -> Option<FastPath> {
    let instructions = &head.instructions;
    let (base, slow_path) = ticker_52(symbols, data, head)?;
    let size_test = instructions
        .iter()
        .position(|i| is_size_test(i, Register::RDI))?;
    let large = instructions.get(size_test + 1)?.near_branch_target();
    if fallback(symbols, data, head, large)? != slow_path {
        return None;
    }
    Some(FastPath {
        large_above: LOOKUP_MAX,
        slow_path,
        tls: fast_path::tls_source(instructions, base)?,
        allocated: counter_added_52(instructions, base)?,
    })
}

/// jemalloc 5.2's free and sdallocx: the ticker, the pointer's key in the
/// radix tree masked out, the deallocated-bytes counter at `counter` added
/// to. Whether flags (edx) are tested first (sdallocx), and the base
/// register.
pub(super) fn free_52(
    symbols: &FunctionSymbols,
    data: &[u8],
    head: &Head,
    counter: i64,
) -> Option<(bool, Register)> {
    let instructions = &head.instructions;
    let (base, _) = ticker_52(symbols, data, head)?;
    let masks_key = instructions.iter().any(masks_rtree_key);
    let sized = instructions
        .first()
        .is_some_and(|i| tests_itself(i, Register::EDX));
    (masks_key && counter_added_52(instructions, base)? == counter).then_some((sized, base))
}

/// `and REG, MASK`: a pointer's key in jemalloc's radix tree, its low bits
/// cleared. How many depends on the virtual address width jemalloc's
/// `configure` read off the CPU it was built on (`LG_VADDR`): 30 for 48-bit
/// addresses (`0xffffffffc0000000`), 27 for 57-bit ones (five-level paging:
/// `0xfffffffff8000000`); a page's bits and one level of the tree in any
/// case.
fn masks_rtree_key(i: &Instruction) -> bool {
    const CLEARED_BITS: std::ops::RangeInclusive<u32> = 20..=40;
    if i.mnemonic() != Mnemonic::And || i.op1_kind() != OpKind::Immediate32to64 {
        return false;
    }
    let mask = i.immediate(1);
    let cleared = mask.trailing_zeros();
    CLEARED_BITS.contains(&cleared) && mask == u64::MAX << cleared
}

/// calloc's shape: `num * size` multiplied, the high halves of both tested
/// (`or` then `shr 32` or a mask), the product compared with 4096; the register a thread
/// block read is based on.
pub(super) fn calloc_shape(head: &Head) -> Option<Register> {
    let instructions = &head.instructions;
    let multiply = instructions.iter().position(|i| {
        matches!(i.mnemonic(), Mnemonic::Mul | Mnemonic::Imul)
            && (0..i.op_count()).all(|n| i.op_kind(n) == OpKind::Register)
    })?;
    let rest = &instructions[multiply..];
    // `(num | size) >> 32`, or `(num | size) & 0xffffffff00000000`.
    let ors = rest.iter().any(|i| i.mnemonic() == Mnemonic::Or);
    let high_halves = rest.iter().any(|i| {
        let shift = i.mnemonic() == Mnemonic::Shr
            && i.op1_kind() == OpKind::Immediate8
            && i.immediate8() == 32;
        let mask = i.code() == Code::Mov_r64_imm64 && i.immediate64() == 0xffff_ffff_0000_0000;
        shift || mask
    });
    let high_halves = ors && high_halves;
    let size_test = rest
        .iter()
        .any(|i| i.op0_kind() == OpKind::Register && is_size_test(i, i.op0_register()));
    let base = thread_block_base(instructions)?;
    (high_halves && size_test).then_some(base)
}

/// mallocx's shape: its flags (esi) read as an int and tested, then the
/// size (rdi, or a copy of it) compared with 4096, with no multiply
/// (calloc's); the register a thread block read is based on.
pub(super) fn mallocx_shape(head: &Head) -> Option<Register> {
    let instructions = &head.instructions;
    let reads_flags = instructions.iter().any(|i| {
        matches!(i.mnemonic(), Mnemonic::Movsxd | Mnemonic::Test)
            && i.op_count() == 2
            && i.op1_kind() == OpKind::Register
            && i.op1_register() == Register::ESI
    });
    let size_test = size_test_of(instructions, Register::RDI).is_some();
    let multiplies = instructions
        .iter()
        .any(|i| matches!(i.mnemonic(), Mnemonic::Mul | Mnemonic::Imul));
    let base = thread_block_base(instructions)?;
    (reads_flags && size_test && !multiplies).then_some(base)
}

/// A realloc with its resizing inlined (as clang builds it, and 5.2): both
/// arguments tested for zero, the pointer's key in jemalloc's radix tree
/// masked out (`and REG, 0xffffffffc0000000`), then the new size compared
/// with 4096; the register a thread block read is based on.
pub(super) fn inlined_realloc_shape(head: &Head) -> Option<Register> {
    let instructions = &head.instructions;
    let tests = |register| instructions.iter().position(|i| tests_itself(i, register));
    let size_test = size_test_of(instructions, Register::RSI)?;
    let masks_key = instructions[..size_test].iter().any(masks_rtree_key);
    let tested = tests(Register::RDI)? < size_test && tests(Register::RSI)? < size_test;
    let base = thread_block_base(instructions)?;
    (tested && masks_key).then_some(base)
}

/// Where the size in `register`, or a copy made of it before, is compared
/// with 4096.
fn size_test_of(instructions: &[Instruction], register: Register) -> Option<usize> {
    let mut copies = vec![register];
    instructions.iter().position(|i| {
        if i.mnemonic() == Mnemonic::Mov
            && i.op0_kind() == OpKind::Register
            && i.op1_kind() == OpKind::Register
            && i.op1_register() == register
        {
            copies.push(i.op0_register());
        }
        copies.iter().any(|&r| is_size_test(i, r))
    })
}

/// `test REGISTER, REGISTER`: whether it is zero.
fn tests_itself(i: &Instruction, register: Register) -> bool {
    i.mnemonic() == Mnemonic::Test
        && i.op0_kind() == OpKind::Register
        && i.op0_register() == register
        && i.op1_kind() == OpKind::Register
        && i.op1_register() == register
}

/// `xor ecx, ecx; jmp D`: D.
pub(super) fn is_pass_on(instructions: &[Instruction]) -> Option<u64> {
    let [clear, jump, ..] = instructions else {
        return None;
    };
    let clears_ecx = clear.mnemonic() == Mnemonic::Xor
        && clear.op0_kind() == OpKind::Register
        && clear.op0_register() == Register::ECX
        && clear.op1_kind() == OpKind::Register
        && clear.op1_register() == Register::ECX;
    let jumps = jump.flow_control() == FlowControl::UnconditionalBranch
        && jump.op0_kind() == OpKind::NearBranch64;
    (clears_ecx && jumps).then(|| jump.near_branch_target())
}

/// Tests rdi and rsi, sets ecx to 1, then jumps on: where to.
pub(super) fn passes_realloc_on(instructions: &[Instruction]) -> Option<u64> {
    let tests = |register| instructions.iter().any(|i| tests_itself(i, register));
    let jump = instructions.iter().position(|i| {
        i.flow_control() == FlowControl::UnconditionalBranch && i.op0_kind() == OpKind::NearBranch64
    })?;
    let sets_ecx = instructions[..jump].iter().any(|i| {
        i.code() == Code::Mov_r32_imm32 && i.op0_register() == Register::ECX && i.immediate32() == 1
    });
    (tests(Register::RDI) && tests(Register::RSI) && sets_ecx)
        .then(|| instructions[jump].near_branch_target())
}

/// `cmp REGISTER, 4096` (before `ja`, as gcc writes it) or `cmp REGISTER,
/// 4097` (before `jae`, as clang does): jemalloc's size test.
fn is_size_test(i: &Instruction, register: Register) -> bool {
    i.mnemonic() == Mnemonic::Cmp
        && i.op0_kind() == OpKind::Register
        && i.op0_register() == register
        && matches!(i.op1_kind(), OpKind::Immediate32to64 | OpKind::Immediate32)
        && matches!(i.immediate(1), LOOKUP_MAX | LOOKUP_CLANG)
}

/// The addresses `lea reg, [rip + X]` takes: the tables a fast path reads.
pub(super) fn rip_relative_leas(instructions: &[Instruction]) -> BTreeSet<u64> {
    instructions
        .iter()
        .filter(|i| i.mnemonic() == Mnemonic::Lea && i.is_ip_rel_memory_operand())
        .map(|i| i.ip_rel_memory_address())
        .collect()
}

/// The base register of the first fs-relative read through a register:
/// the thread's block, whose source must be malloc's.
fn thread_block_base(instructions: &[Instruction]) -> Option<Register> {
    instructions
        .iter()
        .find(|i| i.segment_prefix() == Register::FS && i.memory_base() != Register::None)
        .map(|i| i.memory_base())
}

#[cfg(test)]
mod tests {
    use iced_x86::{Decoder, DecoderOptions};

    use super::*;

    /// `and rcx, IMM`, its 32-bit immediate sign-extended.
    fn and_rcx(immediate: u32) -> Instruction {
        let [a, b, c, d] = immediate.to_le_bytes();
        Decoder::new(64, &[0x48, 0x81, 0xe1, a, b, c, d], DecoderOptions::NONE).decode()
    }

    #[test]
    fn the_radix_tree_key_mask_of_any_address_width_is_recognised() {
        // 0xffffffffc0000000: 48-bit addresses; 0xfffffffff8000000: 57-bit.
        assert!(masks_rtree_key(&and_rcx(0xc000_0000)));
        assert!(masks_rtree_key(&and_rcx(0xf800_0000)));
        // A page's mask, and a mask that is not one run of ones.
        assert!(!masks_rtree_key(&and_rcx(0xffff_f000)));
        assert!(!masks_rtree_key(&and_rcx(0xf8f0_0000)));
    }
}
