//! Where jemalloc 5.3's slow path (`malloc_default`) goes for requests
//! above the fast path's largest, and only for those: past each of its own
//! `cmp SIZE, 4096; ja LARGE` checks. A probe there traps on big requests
//! alone, never on the small calls that reach the slow path to refill a
//! thread cache or cross the thread's byte threshold (some 100,000 a
//! second in a busy allocation loop).
//!
//! Found by following the function's control flow with a real decoder:
//! which registers still hold the size (the first argument, moved to a
//! callee-saved register that survives calls) and how far `rsp` is from
//! the return address on every path. A place is kept only when it is
//! reached exactly once per call: its check's jump is the only way in, and
//! no path from there comes back to a check.
use std::collections::VecDeque;

use iced_x86::{
    Code, Decoder, DecoderOptions, FlowControl, Instruction, InstructionInfoFactory, OpKind,
    Register,
};
use profiler_common::gpr;

use crate::binary::{
    elf::FunctionSymbols,
    placement::{Placement, branch_targets, is_emulated, registers_written},
};

/// Most bytes of the slow path decoded.
const MAX_FUNCTION_BYTES: u64 = 16 * 1024;

/// Most instructions visited while following its paths.
const MAX_STEPS: usize = 16_384;

/// Most instructions between a check's target and the probe's place.
const MAX_TO_PLACE: usize = 8;

/// The places in a slow path reached by large requests only.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LargeRequests {
    /// The register that holds the size at every place: one of
    /// [`profiler_common::gpr`].
    pub register: u64,
    /// Each place, relative to the slow path's start; `pushes` counts the
    /// words between `rsp` and the return address there.
    pub places: Vec<Placement>,
}

/// What is known at an instruction on every path that reaches it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct State {
    /// The registers that hold the size (bits by `gpr` number).
    sizes: u32,
    /// Bytes between `rsp` and the return address.
    frame: i64,
}

/// The places in the slow path at `slow_path` (an address in `symbols`)
/// reached only by requests above `large_above` bytes; `None` where its
/// code is not shaped so, or not surely.
pub fn find(
    symbols: &FunctionSymbols,
    data: &[u8],
    slow_path: u64,
    large_above: u64,
) -> Option<LargeRequests> {
    let end = symbols
        .next_function_start(slow_path)
        .unwrap_or(slow_path + MAX_FUNCTION_BYTES)
        .min(slow_path + MAX_FUNCTION_BYTES);
    let code = symbols.code(data, slow_path, end - slow_path)?;
    let instructions: Vec<Instruction> =
        Decoder::with_ip(64, code, slow_path, DecoderOptions::NONE)
            .into_iter()
            .take_while(|i| !i.is_invalid())
            .collect();
    let states = follow(&instructions)?;
    let checks: Vec<(usize, u64)> = (0..instructions.len())
        .filter_map(|i| {
            let state = states[i]?;
            let register = size_check(&instructions, i, state, large_above)?;
            Some((i, register))
        })
        .collect();
    let (_, register) = *checks.first()?;
    if checks.iter().any(|&(_, r)| r != register) {
        return None;
    }
    let check_indexes: Vec<usize> = checks.iter().map(|&(i, _)| i).collect();
    let landings = branch_targets(&instructions, slow_path);
    let mut places = Vec::new();
    for &(at, _) in &checks {
        let target = index_of(&instructions, instructions[at + 1].near_branch_target())?;
        if !entered_only_by(&instructions, target, &landings)
            || reaches_any(&instructions, target, &check_indexes)
        {
            return None;
        }
        let frame = states[at]?.frame;
        let at_target = (register, frame);
        places.push(place(
            &instructions,
            target,
            at_target,
            &landings,
            slow_path,
        )?);
    }
    Some(LargeRequests { register, places })
}

/// Follows every path from the entry to a fixed point: the state at each
/// instruction reached, or `None` where the paths disagree on the frame.
fn follow(instructions: &[Instruction]) -> Option<Vec<Option<State>>> {
    let mut states: Vec<Option<State>> = vec![None; instructions.len()];
    let mut queue = VecDeque::from([(
        0,
        State {
            sizes: bit(gpr::RDI),
            frame: 0,
        },
    )]);
    let mut info = InstructionInfoFactory::new();
    let mut steps = 0;
    while let Some((i, incoming)) = queue.pop_front() {
        steps += 1;
        if steps > MAX_STEPS {
            return None;
        }
        let state = match states[i] {
            Some(old) if old.frame != incoming.frame => return None,
            Some(old) if old.sizes & incoming.sizes == old.sizes => continue,
            Some(old) => State {
                sizes: old.sizes & incoming.sizes,
                ..old
            },
            None => incoming,
        };
        states[i] = Some(state);
        let instruction = &instructions[i];
        let Some(after) = step(&mut info, instruction, state) else {
            continue;
        };
        for next in successors(instructions, i) {
            queue.push_back((next, after));
        }
    }
    Some(states)
}

/// The state after `instruction`; `None` where `rsp` moves in a way not
/// followed (an epilogue's `lea rsp, [rbp - N]`, a stack realignment).
fn step(
    info: &mut InstructionInfoFactory,
    instruction: &Instruction,
    state: State,
) -> Option<State> {
    let mut sizes = state.sizes;
    let mut frame = state.frame;
    let written = registers_written(info, instruction);
    match instruction.code() {
        Code::Push_r64 | Code::Pushq_imm32 | Code::Pushq_imm8 => frame += 8,
        Code::Pop_r64 => frame -= 8,
        Code::Sub_rm64_imm32 | Code::Sub_rm64_imm8 if is_rsp(instruction) => {
            frame += instruction.immediate(1) as i64;
        }
        Code::Add_rm64_imm32 | Code::Add_rm64_imm8 if is_rsp(instruction) => {
            frame -= instruction.immediate(1) as i64;
        }
        _ if matches!(
            instruction.flow_control(),
            FlowControl::Call | FlowControl::IndirectCall
        ) => {}
        _ if written.contains(&Register::RSP) => return None,
        _ => {}
    }
    let copied = register_copy(instruction).filter(|&(_, from)| sizes & bit(from) != 0);
    for register in written.iter().filter_map(|&r| gpr_number(r)) {
        sizes &= !bit(register);
    }
    if let Some((to, _)) = copied {
        sizes |= bit(to);
    }
    if matches!(
        instruction.flow_control(),
        FlowControl::Call | FlowControl::IndirectCall
    ) {
        // What a called function may change: the System V caller-saved
        // registers.
        for register in [
            gpr::RAX,
            gpr::RCX,
            gpr::RDX,
            gpr::RSI,
            gpr::RDI,
            gpr::R8,
            gpr::R9,
            gpr::R10,
            gpr::R11,
        ] {
            sizes &= !bit(register);
        }
    }
    Some(State { sizes, frame })
}

/// `mov TO, FROM` between 64-bit registers: (TO, FROM).
fn register_copy(instruction: &Instruction) -> Option<(u64, u64)> {
    let is_move = matches!(instruction.code(), Code::Mov_r64_rm64 | Code::Mov_rm64_r64)
        && instruction.op0_kind() == OpKind::Register
        && instruction.op1_kind() == OpKind::Register;
    if !is_move {
        return None;
    }
    Some((
        gpr_number(instruction.op0_register())?,
        gpr_number(instruction.op1_register())?,
    ))
}

fn is_rsp(instruction: &Instruction) -> bool {
    instruction.op0_kind() == OpKind::Register && instruction.op0_register() == Register::RSP
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

/// `cmp SIZE, large_above; ja LARGE` at `i`, SIZE a register that holds
/// the size there: SIZE's number.
fn size_check(
    instructions: &[Instruction],
    i: usize,
    state: State,
    large_above: u64,
) -> Option<u64> {
    let compare = &instructions[i];
    let jump = instructions.get(i + 1)?;
    let shaped = matches!(compare.code(), Code::Cmp_rm64_imm32 | Code::Cmp_rm64_imm8)
        && compare.op0_kind() == OpKind::Register
        && compare.immediate(1) == large_above
        && matches!(jump.code(), Code::Ja_rel32_64 | Code::Ja_rel8_64);
    let register = gpr_number(compare.op0_register())?;
    (shaped && state.sizes & bit(register) != 0).then_some(register)
}

/// Whether the instruction at `target` is entered only by its check's
/// jump: no other branch lands there (`landings`: every branch's target,
/// that jump's among them), and the code before it does not run on into
/// it.
fn entered_only_by(instructions: &[Instruction], target: usize, landings: &[u64]) -> bool {
    let address = instructions[target].ip();
    let other_branch = landings.iter().filter(|&&t| t == address).count() > 1;
    // Padding between the code before and the target is skipped over.
    let before = instructions[..target].iter().rev().find(|i| {
        !matches!(
            i.code(),
            Code::Nopd
                | Code::Nopq
                | Code::Nopw
                | Code::Nop_rm16
                | Code::Nop_rm32
                | Code::Nop_rm64
                | Code::Int3
        )
    });
    let runs_on = before.is_none_or(|i| {
        matches!(
            i.flow_control(),
            FlowControl::Next
                | FlowControl::ConditionalBranch
                | FlowControl::Call
                | FlowControl::IndirectCall
        )
    });
    !other_branch && !runs_on
}

/// Whether any path from `start` comes to one of the instructions `to`.
fn reaches_any(instructions: &[Instruction], start: usize, to: &[usize]) -> bool {
    let mut seen = vec![false; instructions.len()];
    let mut queue = VecDeque::from([start]);
    while let Some(i) = queue.pop_front() {
        if std::mem::replace(&mut seen[i], true) {
            continue;
        }
        if to.contains(&i) {
            return true;
        }
        queue.extend(successors(instructions, i));
    }
    false
}

/// The probe's place on the straight line from `target`: the first
/// instruction the kernel emulates, with the size's register and the frame
/// as at the check, and none of `landings` between.
fn place(
    instructions: &[Instruction],
    target: usize,
    (register, frame): (u64, i64),
    landings: &[u64],
    function: u64,
) -> Option<Placement> {
    let mut info = InstructionInfoFactory::new();
    let mut state = State {
        sizes: bit(register),
        frame,
    };
    for (k, instruction) in instructions[target..].iter().take(MAX_TO_PLACE).enumerate() {
        let landed_on = k > 0 && landings.contains(&instruction.ip());
        if landed_on || state.sizes & bit(register) == 0 || state.frame != frame {
            return None;
        }
        if is_emulated(instruction) {
            return Some(Placement {
                offset: instruction.ip() - function,
                pushes: u16::try_from(frame / 8).ok().filter(|_| frame % 8 == 0)?,
                instruction: instruction.to_string(),
                fallback: None,
            });
        }
        if instruction.flow_control() != FlowControl::Next {
            return None;
        }
        state = step(&mut info, instruction, state)?;
    }
    None
}

fn index_of(instructions: &[Instruction], address: u64) -> Option<usize> {
    instructions
        .binary_search_by_key(&address, Instruction::ip)
        .ok()
}

fn bit(register: u64) -> u32 {
    1 << register
}

/// A 64-bit general-purpose register's number in [`gpr`].
pub fn gpr_number(register: Register) -> Option<u64> {
    Some(match register {
        Register::RAX => gpr::RAX,
        Register::RBX => gpr::RBX,
        Register::RCX => gpr::RCX,
        Register::RDX => gpr::RDX,
        Register::RSI => gpr::RSI,
        Register::RDI => gpr::RDI,
        Register::RBP => gpr::RBP,
        Register::R8 => gpr::R8,
        Register::R9 => gpr::R9,
        Register::R10 => gpr::R10,
        Register::R11 => gpr::R11,
        Register::R12 => gpr::R12,
        Register::R13 => gpr::R13,
        Register::R14 => gpr::R14,
        Register::R15 => gpr::R15,
        _ => return None,
    })
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
        Some(find(&symbols, &data, fast.slow_path, fast.large_above).expect("found"))
    }

    /// Debian's libjemalloc2 5.3.0: `malloc_default` moves the size to
    /// `rbp` and checks it twice, on the thread's usual state and after
    /// its slow fetch; each large branch starts `movabs; cmp; jb`, the
    /// `jb` emulated, 6 pushes and 0x88 bytes below the return address.
    #[test]
    fn debians_shared_libjemalloc_has_two_large_branches() {
        let path = Path::new("/usr/lib/x86_64-linux-gnu/libjemalloc.so.2");
        let Some(found) = large_requests_in(path, "malloc") else {
            return;
        };
        assert_eq!(found.register, gpr::RBP);
        assert_eq!(found.places.len(), 2, "{found:?}");
        for place in &found.places {
            assert_eq!(place.pushes, (6 * 8 + 0x88) / 8, "{place:?}");
            assert!(place.instruction.starts_with("jb "), "{place:?}");
        }
    }

    /// `code` decoded at 0x1000, and its paths followed.
    fn decoded(code: &[u8]) -> (Vec<Instruction>, Vec<Option<State>>) {
        let instructions: Vec<Instruction> =
            Decoder::with_ip(64, code, 0x1000, DecoderOptions::NONE)
                .into_iter()
                .collect();
        let states = follow(&instructions).unwrap();
        (instructions, states)
    }

    /// A size that is copied, then overwritten before the check, is not
    /// taken for the size: `mov rbx, rdi; mov rbx, rsi; cmp rbx, 4096; ja`.
    #[test]
    fn a_register_overwritten_before_the_check_is_not_the_size() {
        let code = [
            0x48, 0x89, 0xfb, // mov rbx, rdi
            0x48, 0x89, 0xf3, // mov rbx, rsi
            0x48, 0x81, 0xfb, 0x00, 0x10, 0x00, 0x00, // cmp rbx, 0x1000
            0x77, 0x01, // ja +1
            0xc3, // ret
            0x72, 0x00, // jb +0
            0xc3, // ret
        ];
        let (instructions, states) = decoded(&code);
        assert_eq!(size_check(&instructions, 2, states[2].unwrap(), 4096), None);
        // Through a callee-saved copy that a call keeps, it is.
        let kept = [
            0x48, 0x89, 0xfb, // mov rbx, rdi
            0xe8, 0x00, 0x00, 0x00, 0x00, // call +0
            0x48, 0x81, 0xfb, 0x00, 0x10, 0x00, 0x00, // cmp rbx, 0x1000
            0x77, 0x01, // ja +1
            0xc3, // ret
            0x72, 0x00, // jb +0
            0xc3, // ret
        ];
        let (instructions, states) = decoded(&kept);
        assert_eq!(
            size_check(&instructions, 2, states[2].unwrap(), 4096),
            Some(gpr::RBX)
        );
        let landings = branch_targets(&instructions, 0x1000);
        let place = place(&instructions, 5, (gpr::RBX, 0), &landings, 0x1000).unwrap();
        assert_eq!(place.offset, 18);
    }
}
