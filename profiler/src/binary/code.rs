//! Reading machine code with a real x86-64 decoder (iced-x86): never by
//! matching bytes by hand.
use iced_x86::{Decoder, DecoderOptions, FlowControl, OpKind, Register};

use crate::binary::elf::FunctionSymbols;

/// Most instructions followed on a straight-line path.
const MAX_STRAIGHT_LINE: usize = 32;

/// Where the straight-line path from `address` leaves the function for
/// sure: the target of the first `call` or `jmp` reached before any
/// conditional branch, return or indirect jump. Such a function passes every
/// call through that target exactly once.
pub fn straight_line_exit(code: &[u8], address: u64) -> Option<u64> {
    let mut decoder = Decoder::with_ip(64, code, address, DecoderOptions::NONE);
    for instruction in decoder.iter().take(MAX_STRAIGHT_LINE) {
        if instruction.is_invalid() {
            return None;
        }
        match instruction.flow_control() {
            FlowControl::Next => continue,
            FlowControl::Call | FlowControl::UnconditionalBranch
                if matches!(
                    instruction.op0_kind(),
                    OpKind::NearBranch16 | OpKind::NearBranch32 | OpKind::NearBranch64
                ) =>
            {
                return Some(instruction.near_branch_target());
            }
            _ => return None,
        }
    }
    None
}

/// The targets of every direct call and jump (conditional or not) in `code`.
pub fn branch_targets(code: &[u8], address: u64) -> Vec<u64> {
    let decoder = Decoder::with_ip(64, code, address, DecoderOptions::NONE);
    decoder
        .into_iter()
        .filter(|i| !i.is_invalid())
        .filter(|i| {
            matches!(
                i.flow_control(),
                FlowControl::Call
                    | FlowControl::UnconditionalBranch
                    | FlowControl::ConditionalBranch
            ) && matches!(
                i.op0_kind(),
                OpKind::NearBranch16 | OpKind::NearBranch32 | OpKind::NearBranch64
            )
        })
        .map(|i| i.near_branch_target())
        .collect()
}

/// The symbol a PLT stub at `address` jumps to through the GOT.
pub fn plt_stub_symbol<'s>(
    symbols: &'s FunctionSymbols,
    data: &[u8],
    address: u64,
) -> Option<&'s str> {
    if !symbols.is_plt(address) {
        return None;
    }
    let code = symbols.code(data, address, 16)?;
    let mut decoder = Decoder::with_ip(64, code, address, DecoderOptions::NONE);
    // endbr64 and bnd prefixes may come first; the jump follows within a few.
    for instruction in decoder.iter().take(3) {
        if instruction.flow_control() == FlowControl::IndirectBranch
            && instruction.op0_kind() == OpKind::Memory
            && instruction.memory_base() == Register::RIP
        {
            return symbols.got_symbol(instruction.memory_displacement64());
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn follows_straight_line_to_a_jump_or_call() {
        // jmp rel32 to 0x1000 from 0x2000.
        let jmp = [0xe9, 0xfb, 0xef, 0xff, 0xff];
        assert_eq!(straight_line_exit(&jmp, 0x2000), Some(0x1000));
        // push rbx; mov rbx, rdi; call rel32 (+0x100 from the next instruction).
        let call = [0x53, 0x48, 0x89, 0xfb, 0xe8, 0x00, 0x01, 0x00, 0x00];
        assert_eq!(straight_line_exit(&call, 0x3000), Some(0x3000 + 9 + 0x100));
        // cmp rdi, 0x1000; ja ...: a conditional branch first, no exit.
        let cmp_ja = [0x48, 0x81, 0xff, 0x00, 0x10, 0x00, 0x00, 0x77, 0x10];
        assert_eq!(straight_line_exit(&cmp_ja, 0x4000), None);
        // ret.
        assert_eq!(straight_line_exit(&[0xc3], 0x5000), None);
    }
}
