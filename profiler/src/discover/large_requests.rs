//! Where jemalloc 5.3's slow path (`malloc_default`) sends the requests
//! no thread cache holds: past a `cmp SIZE, [tcache_maxclass]` check, a
//! call to `arena_malloc_hard(tsdn, arena, size, ind, zero)`. Probed at
//! that function's entry, memprobe traps on those requests alone (above
//! 32 KiB unless `tcache_max` says otherwise), never on the small and
//! middle-sized ones a thread cache serves, nor on the slow path's refills
//! and threshold crossings: a server that allocates a 4 KiB buffer per
//! request leaves them all to the windows.
//!
//! The function has other callers (`calloc`, `realloc`, ... probed at their
//! own entries; a thread without a cache, whose small requests come here
//! too): the kernel counts a call only when it comes from the slow path
//! and asks for more than the copy's limit, read from `tcache_maxclass` in
//! the running process.
//!
//! Found by following the slow path's control flow with a real decoder:
//! which registers hold the size (the first argument, moved to a
//! callee-saved register that calls keep) at each instruction on every
//! path. Every check of the size against the global must lead, in a
//! straight line, to a call of the same function with the size as its
//! third argument.
use std::collections::VecDeque;
use std::ops::Range;

use iced_x86::{
    Code, Decoder, DecoderOptions, FlowControl, Instruction, InstructionInfoFactory, OpKind,
    Register,
};

use crate::binary::{
    elf::FunctionSymbols,
    placement::{self, Placement, registers_written},
};
use crate::discover::entry_points;

/// Most bytes of the slow path decoded.
const MAX_FUNCTION_BYTES: u64 = 16 * 1024;

/// Most instructions visited while following its paths.
const MAX_STEPS: usize = 16_384;

/// Most instructions between a check and its call.
const MAX_TO_CALL: usize = 12;

/// Most instructions between the `lea` of the global's address and the
/// check that reads through it.
const MAX_TO_CHECK: usize = 4;

/// jemalloc 5.3's largest small size class with 4 KiB pages: a request up
/// to it takes a thread cache's small bins whatever `tcache_max` is.
pub const SMALL_MAX_CLASS: u64 = 14 * 1024;

/// Where a slow path's large requests go, as addresses in the file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LargeRequests {
    /// `arena_malloc_hard`, called with the size as its third argument.
    pub function: u64,
    /// The slow path's extent: a call from elsewhere is not malloc's.
    pub callers: Range<u64>,
    /// `tcache_maxclass`: requests above it (and above
    /// [`SMALL_MAX_CLASS`]) reach the function.
    pub limit: u64,
}

/// The same, as a run attaches and reads it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LargeRequestsProbe {
    /// The function's file offset, and where its probe goes.
    pub file_offset: u64,
    pub placement: Placement,
    /// The function's extent and the slow path's, as file offsets.
    pub function: Range<u64>,
    pub callers: Range<u64>,
    /// `tcache_maxclass`'s address (in `.bss`: placed by address), and the
    /// first loadable segment's file offset and address.
    pub limit: u64,
    pub anchor: (u64, u64),
}

impl LargeRequests {
    /// In file offsets, with the function's probe placed.
    pub fn in_file(&self, symbols: &FunctionSymbols, data: &[u8]) -> Option<LargeRequestsProbe> {
        let length = symbols.next_function_start(self.function)? - self.function;
        let code = symbols.code(data, self.function, length)?;
        let shape = profiler_common::CallShape::LargeRequest;
        let placement = placement::place(
            code,
            self.function,
            entry_points::registers_read(shape),
            shape.needs_return(),
        );
        let file_offset = symbols.file_offset(self.function)?;
        let callers = symbols.file_offset(self.callers.start)?;
        Some(LargeRequestsProbe {
            file_offset,
            placement,
            function: file_offset..file_offset + length,
            callers: callers..callers + (self.callers.end - self.callers.start),
            limit: self.limit,
            anchor: symbols.anchor()?,
        })
    }
}

/// The function the slow path at `slow_path` (an address in `symbols`)
/// calls for requests above its thread cache's largest; `None` where its
/// code is not shaped so, or not surely.
pub fn find(symbols: &FunctionSymbols, data: &[u8], slow_path: u64) -> Option<LargeRequests> {
    // Its whole extent, known: a call from past it would not be counted.
    let end = symbols
        .next_function_start(slow_path)
        .filter(|&end| end - slow_path <= MAX_FUNCTION_BYTES)?;
    let code = symbols.code(data, slow_path, end - slow_path)?;
    let instructions: Vec<Instruction> =
        Decoder::with_ip(64, code, slow_path, DecoderOptions::NONE)
            .into_iter()
            .take_while(|i| !i.is_invalid())
            .collect();
    let sizes = follow(&instructions)?;
    let (function, limit) = match by_global_limit(&instructions, &sizes) {
        Some(found) => Some(found).filter(|&(function, _)| symbols.is_function_start(function))?,
        None => by_thread_limit(symbols, data, &instructions, &sizes)?,
    };
    Some(LargeRequests {
        function,
        callers: slow_path..end,
        limit,
    })
}

/// jemalloc 5.3.0's slow path: every check of the size against a global
/// (`tcache_maxclass`) leads to a call of the same function with the size
/// as its third argument: (that function, the global).
fn by_global_limit(instructions: &[Instruction], sizes: &[Option<u32>]) -> Option<(u64, u64)> {
    let mut found: Option<(u64, u64)> = None;
    for i in 0..instructions.len() {
        let Some(held) = sizes[i] else { continue };
        let Some((limit, target)) = limit_check(instructions, i, held) else {
            continue;
        };
        // A large side outside the function (a cold part) calls from
        // elsewhere than the slow path: not counted there, so not taken.
        let target = index_of(instructions, target)?;
        let function = called_with_size(instructions, target, sizes[target]?)?;
        if found.is_some_and(|f| f != (function, limit)) {
            return None;
        }
        found = Some((function, limit));
    }
    found
}

/// jemalloc 5.3.1's slow path checks a request against its thread's own
/// cache limit (a size-class index in the thread's cache, set from a
/// global as the cache is made), not against a global, and calls
/// `arena_malloc_hard` above it. Found by their symbols (the global's
/// address is in no code of the slow path), where every call of the
/// function from the slow path passes the size as its third argument:
/// (that function, the global). Tried where the code names no global
/// limit, so that a 5.3.0 file's symbol table is not read for it.
fn by_thread_limit(
    symbols: &FunctionSymbols,
    data: &[u8],
    instructions: &[Instruction],
    sizes: &[Option<u32>],
) -> Option<(u64, u64)> {
    let function = symbols.function_ending("je_arena_malloc_hard")?.address;
    let limit =
        crate::binary::elf::data_symbol_ending(data, "je_global_do_not_change_tcache_maxclass")?;
    let mut calls = instructions
        .iter()
        .enumerate()
        .filter(|(_, i)| i.code() == Code::Call_rel32_64 && i.near_branch_target() == function)
        .peekable();
    calls.peek()?;
    calls
        .all(|(at, _)| sizes[at].is_some_and(|held| held & bit(Register::RDX) != 0))
        .then_some((function, limit))
}

/// Follows every path from the entry to a fixed point: at each instruction
/// reached, the registers that hold the size on every path to it (bits by
/// register number).
fn follow(instructions: &[Instruction]) -> Option<Vec<Option<u32>>> {
    let mut sizes: Vec<Option<u32>> = vec![None; instructions.len()];
    let mut queue = VecDeque::from([(0, bit(Register::RDI))]);
    let mut info = InstructionInfoFactory::new();
    let mut steps = 0;
    while let Some((i, incoming)) = queue.pop_front() {
        steps += 1;
        if steps > MAX_STEPS {
            return None;
        }
        let held = match sizes[i] {
            Some(old) if old & incoming == old => continue,
            Some(old) => old & incoming,
            None => incoming,
        };
        sizes[i] = Some(held);
        let after = step(&mut info, &instructions[i], held);
        for next in successors(instructions, i) {
            queue.push_back((next, after));
        }
    }
    Some(sizes)
}

/// The registers that hold the size after `instruction`.
fn step(info: &mut InstructionInfoFactory, instruction: &Instruction, held: u32) -> u32 {
    let copied = register_copy(instruction).filter(|&(_, from)| held & bit(from) != 0);
    let mut held = held;
    for register in registers_written(info, instruction) {
        held &= !bit(register);
    }
    if matches!(
        instruction.flow_control(),
        FlowControl::Call | FlowControl::IndirectCall
    ) {
        // What a called function may change: the System V caller-saved
        // registers.
        use Register::*;
        for register in [RAX, RCX, RDX, RSI, RDI, R8, R9, R10, R11] {
            held &= !bit(register);
        }
    }
    if let Some((to, _)) = copied {
        held |= bit(to);
    }
    held
}

/// `mov TO, FROM` between 64-bit registers: (TO, FROM).
fn register_copy(instruction: &Instruction) -> Option<(Register, Register)> {
    let is_move = matches!(instruction.code(), Code::Mov_r64_rm64 | Code::Mov_rm64_r64)
        && instruction.op0_kind() == OpKind::Register
        && instruction.op1_kind() == OpKind::Register;
    is_move.then(|| (instruction.op0_register(), instruction.op1_register()))
}

/// The indexes control may go to after instruction `i`, inside the
/// function.
fn successors(instructions: &[Instruction], i: usize) -> Vec<usize> {
    let instruction = &instructions[i];
    let next = (i + 1 < instructions.len()).then_some(i + 1);
    let target = || index_of(instructions, instruction.near_branch_target());
    match instruction.flow_control() {
        FlowControl::Next | FlowControl::Call | FlowControl::IndirectCall => {
            next.into_iter().collect()
        }
        FlowControl::ConditionalBranch => next.into_iter().chain(target()).collect(),
        FlowControl::UnconditionalBranch => target().into_iter().collect(),
        _ => Vec::new(),
    }
}

/// A check of the size against a global at `i`: `cmp [G], SIZE; jb T` or
/// `cmp SIZE, [G]; ja T`, G read rip-relative or through a register just
/// loaded with `lea REG, [rip + G]`. Returns G and T, where the size is
/// above it.
fn limit_check(instructions: &[Instruction], i: usize, held: u32) -> Option<(u64, u64)> {
    let compare = &instructions[i];
    let jump = instructions.get(i + 1)?;
    let (memory_first, size) = match compare.code() {
        Code::Cmp_rm64_r64 if compare.op0_kind() == OpKind::Memory => {
            (true, compare.op1_register())
        }
        Code::Cmp_r64_rm64 if compare.op1_kind() == OpKind::Memory => {
            (false, compare.op0_register())
        }
        _ => return None,
    };
    let above = match jump.code() {
        Code::Jb_rel8_64 | Code::Jb_rel32_64 => memory_first,
        Code::Ja_rel8_64 | Code::Ja_rel32_64 => !memory_first,
        _ => false,
    };
    if !above || held & bit(size) == 0 {
        return None;
    }
    let global = global_address(instructions, i)?;
    Some((global, jump.near_branch_target()))
}

/// The address the memory operand of instruction `i` reads: rip-relative,
/// or `[REG]` with REG loaded by a `lea REG, [rip + G]` a few instructions
/// before and not written since.
fn global_address(instructions: &[Instruction], i: usize) -> Option<u64> {
    let compare = &instructions[i];
    if compare.is_ip_rel_memory_operand() {
        return Some(compare.ip_rel_memory_address());
    }
    let base = compare.memory_base();
    let plain = compare.memory_index() == Register::None && compare.memory_displacement64() == 0;
    if !plain || !base.is_gpr64() {
        return None;
    }
    let mut info = InstructionInfoFactory::new();
    for before in instructions[..i].iter().rev().take(MAX_TO_CHECK) {
        if !registers_written(&mut info, before).contains(&base) {
            continue;
        }
        let loads_address = before.code() == Code::Lea_r64_m
            && before.op0_register() == base
            && before.is_ip_rel_memory_operand();
        return loads_address.then(|| before.ip_rel_memory_address());
    }
    None
}

/// On the straight line from `target` (through direct jumps), the first
/// call's target, where it is a direct call with the size in `rdx` (its
/// third argument).
fn called_with_size(instructions: &[Instruction], target: usize, held: u32) -> Option<u64> {
    let (mut i, mut held) = (target, held);
    let mut info = InstructionInfoFactory::new();
    for _ in 0..MAX_TO_CALL {
        let instruction = instructions.get(i)?;
        match instruction.flow_control() {
            FlowControl::Call if instruction.code() == Code::Call_rel32_64 => {
                return (held & bit(Register::RDX) != 0).then(|| instruction.near_branch_target());
            }
            FlowControl::Next => {
                held = step(&mut info, instruction, held);
                i += 1;
            }
            FlowControl::UnconditionalBranch => {
                i = index_of(instructions, instruction.near_branch_target())?;
            }
            _ => return None,
        }
    }
    None
}

fn index_of(instructions: &[Instruction], address: u64) -> Option<usize> {
    instructions
        .binary_search_by_key(&address, Instruction::ip)
        .ok()
}

/// A 64-bit general-purpose register's bit; none for other registers.
fn bit(register: Register) -> u32 {
    if register.is_gpr64() {
        1 << register.number()
    } else {
        0
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::discover::fast_path;

    fn large_requests_in(path: &Path, malloc: &str) -> Option<LargeRequests> {
        let Ok(data) = std::fs::read(path) else {
            eprintln!("skipped: {} is not there", path.display());
            return None;
        };
        let symbols = FunctionSymbols::parse(&data).unwrap();
        let address = symbols.function(malloc).unwrap().address;
        let fast = fast_path::recognise(&symbols, &data, address).expect("recognised");
        Some(find(&symbols, &data, fast.slow_path).expect("found"))
    }

    /// Debian's libjemalloc2 5.3.0 (stripped): `malloc_default` at
    /// 0x21e80 compares the size (moved to `rbp`) with `tcache_maxclass`
    /// (0x2ec888, in `.bss`) and calls `arena_malloc_hard` (0x37a10).
    #[test]
    fn debians_shared_libjemalloc_calls_arena_malloc_hard() {
        let path = Path::new("/usr/lib/x86_64-linux-gnu/libjemalloc.so.2");
        let Some(found) = large_requests_in(path, "malloc") else {
            return;
        };
        assert_eq!(found.function, 0x37a10, "{found:x?}");
        assert_eq!(found.limit, 0x2ec888, "{found:x?}");
        assert_eq!(found.callers.start, 0x21e80, "{found:x?}");
        assert!(found.callers.end > 0x22486, "{found:x?}");
    }

    /// `code` decoded at 0x1000, and the size's registers followed.
    fn decoded(code: &[u8]) -> (Vec<Instruction>, Vec<Option<u32>>) {
        let instructions: Vec<Instruction> =
            Decoder::with_ip(64, code, 0x1000, DecoderOptions::NONE)
                .into_iter()
                .collect();
        let sizes = follow(&instructions).unwrap();
        (instructions, sizes)
    }

    /// `mov rbp, rdi; lea rcx, [rip + 0x100]; cmp [rcx], rbp; jb +2;
    /// ret; ret; mov rdx, rbp; call +0`, then `ret`.
    const CHECK_AND_CALL: [u8; 25] = [
        0x48, 0x89, 0xfd, // mov rbp, rdi
        0x48, 0x8d, 0x0d, 0x00, 0x01, 0x00, 0x00, // lea rcx, [rip + 0x100]
        0x48, 0x39, 0x29, // cmp [rcx], rbp
        0x72, 0x02, // jb +2
        0xc3, 0xc3, // ret; ret
        0x48, 0x89, 0xea, // mov rdx, rbp
        0xe8, 0x00, 0x00, 0x00, 0x00, // call +0
    ];

    #[test]
    fn a_check_through_a_lea_leads_to_the_call_with_the_size() {
        let (instructions, sizes) = decoded(&CHECK_AND_CALL);
        let (limit, target) = limit_check(&instructions, 2, sizes[2].unwrap()).unwrap();
        assert_eq!(limit, 0x100a + 0x100);
        let target = index_of(&instructions, target).unwrap();
        let call = called_with_size(&instructions, target, sizes[target].unwrap());
        assert_eq!(call, Some(0x1019));
    }

    /// The same check on a register that no longer holds the size (`mov
    /// rbp, rsi` first) is not a check of the size.
    #[test]
    fn a_register_overwritten_is_not_the_size() {
        let mut code = CHECK_AND_CALL.to_vec();
        code.splice(0..0, [0x48, 0x89, 0xfd, 0x48, 0x89, 0xf5]); // mov rbp, rdi; mov rbp, rsi
        code.drain(6..9);
        let (instructions, sizes) = decoded(&code);
        assert_eq!(instructions[3].code(), Code::Cmp_rm64_r64);
        assert_eq!(limit_check(&instructions, 3, sizes[3].unwrap()), None);
    }

    /// A call whose third argument is not the size (`mov rdx, rsi`) is not
    /// the one large requests go to.
    #[test]
    fn a_call_without_the_size_in_rdx_is_not_taken() {
        let mut code = CHECK_AND_CALL.to_vec();
        code[19] = 0xf2; // mov rdx, rsi
        let (instructions, sizes) = decoded(&code);
        let (_, target) = limit_check(&instructions, 2, sizes[2].unwrap()).unwrap();
        let target = index_of(&instructions, target).unwrap();
        assert_eq!(
            called_with_size(&instructions, target, sizes[target].unwrap()),
            None
        );
    }
}
