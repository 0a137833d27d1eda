//! Where in a function to put its probe: on the first instruction the kernel
//! emulates (instead of single-stepping, ~15x dearer here), following the
//! rules of `shared/docs/probes.md`:
//!
//! 1. an exact instruction boundary (decoded with iced-x86);
//! 2. reached exactly once per call: on the straight-line path from the
//!    entry, before any branch, and no branch in the function lands between
//!    the entry and the probe;
//! 3. the argument registers the probe reads are not written before it;
//! 4. with a return probe, `rsp` unchanged (the kernel takes `[rsp]` as the
//!    return address); entry-only probes may sit after pushes, and the return
//!    address is then at `rsp + 8 * pushes`;
//! 5. otherwise the entry, with the reason said in `--verbose`.
use iced_x86::{
    Code, Decoder, DecoderOptions, FlowControl, Instruction, InstructionInfoFactory, OpAccess,
    OpKind, Register,
};

/// Longest straight-line path followed from the entry.
const MAX_PREFIX: usize = 24;

/// Where a probe goes in a function.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Placement {
    /// Bytes from the function's start.
    pub offset: u64,
    /// Pushes between the entry and the probe: the return address is at
    /// `rsp + 8 * pushes`.
    pub pushes: u16,
    /// The instruction probed, for `--verbose`.
    pub instruction: String,
    /// Why the entry was kept, when no better instruction qualified.
    pub fallback: Option<String>,
}

impl Placement {
    /// The function's first instruction.
    pub fn entry(reason: &str) -> Self {
        Self {
            offset: 0,
            pushes: 0,
            instruction: String::new(),
            fallback: Some(reason.to_owned()),
        }
    }
}

/// Whether the x86-64 uprobe code emulates `instruction` (Linux 6.18
/// `arch/x86/kernel/uprobes.c`): NOPs, `jmp`/`jcc` rel8/rel32, `call rel32`
/// and `push reg`; never with a LOCK or segment prefix.
pub fn is_emulated(instruction: &Instruction) -> bool {
    if instruction.has_lock_prefix() || instruction.segment_prefix() != Register::None {
        return false;
    }
    match instruction.code() {
        Code::Nopd | Code::Nopq | Code::Nopw | Code::Nop_rm16 | Code::Nop_rm32 | Code::Nop_rm64 => {
            true
        }
        Code::Call_rel32_64 => true,
        Code::Jmp_rel8_64 | Code::Jmp_rel32_64 => true,
        // push r64: one byte, or REX.B with r8-r15.
        Code::Push_r64 => {
            instruction.len() == 1
                || (instruction.len() == 2
                    && (Register::R8..=Register::R15).contains(&instruction.op0_register()))
        }
        _ => instruction.is_jcc_short_or_near(),
    }
}

/// Chooses the probe's place in `code` (the function, starting at
/// `address`), given the argument registers the probe reads and whether a
/// return probe shares the place.
pub fn place(code: &[u8], address: u64, reads: &[Register], with_return: bool) -> Placement {
    let entry = |reason: &str| Placement {
        offset: 0,
        pushes: 0,
        instruction: first_instruction(code, address),
        fallback: Some(reason.to_owned()),
    };
    let instructions: Vec<Instruction> = Decoder::with_ip(64, code, address, DecoderOptions::NONE)
        .iter()
        .take_while(|i| !i.is_invalid())
        .collect();
    if instructions.is_empty() {
        return entry("the code could not be decoded");
    }
    let landing = branch_targets(&instructions, address);
    let mut info = InstructionInfoFactory::new();
    let mut written: Vec<Register> = Vec::new();
    let mut pushes: u16 = 0;
    for instruction in instructions.iter().take(MAX_PREFIX) {
        let ip = instruction.ip();
        if landing.iter().any(|&t| t <= ip) {
            return entry("a branch lands before the first emulated instruction");
        }
        let args_intact = !reads.iter().any(|r| written.contains(&r.full_register()));
        let rsp_intact = pushes == 0;
        // The kernel takes [rsp] as a return address at `push %rbp`: only
        // right where the stack still holds it.
        let push_rbp_late = instruction.code() == Code::Push_r64
            && instruction.op0_register() == Register::RBP
            && pushes > 0;
        if is_emulated(instruction) && args_intact && (rsp_intact || !with_return) && !push_rbp_late
        {
            return Placement {
                offset: ip - address,
                pushes,
                instruction: instruction.to_string(),
                fallback: None,
            };
        }
        if instruction.flow_control() != FlowControl::Next {
            return entry("a branch, call or return comes before any emulated instruction");
        }
        if instruction.code() == Code::Push_r64 {
            pushes += 1;
        }
        let writes = registers_written(&mut info, instruction);
        if writes.contains(&Register::RSP) && instruction.code() != Code::Push_r64 {
            return entry("the stack pointer moves before any emulated instruction");
        }
        written.extend(writes);
    }
    entry("no emulated instruction early enough")
}

/// Branch targets anywhere in the function past its first byte: a probe
/// must not sit where a branch lands, or after such a place, or it would
/// run twice.
pub(crate) fn branch_targets(instructions: &[Instruction], address: u64) -> Vec<u64> {
    instructions
        .iter()
        .filter(|i| {
            matches!(
                i.op0_kind(),
                OpKind::NearBranch16 | OpKind::NearBranch32 | OpKind::NearBranch64
            )
        })
        .map(Instruction::near_branch_target)
        .filter(|&t| t > address)
        .collect()
}

/// The full registers `instruction` writes.
pub(crate) fn registers_written(
    info: &mut InstructionInfoFactory,
    instruction: &Instruction,
) -> Vec<Register> {
    info.info(instruction)
        .used_registers()
        .iter()
        .filter(|used| {
            matches!(
                used.access(),
                OpAccess::Write
                    | OpAccess::CondWrite
                    | OpAccess::ReadWrite
                    | OpAccess::ReadCondWrite
            )
        })
        .map(|used| used.register().full_register())
        .collect()
}

fn first_instruction(code: &[u8], address: u64) -> String {
    let mut decoder = Decoder::with_ip(64, code, address, DecoderOptions::NONE);
    decoder.decode().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn skips_a_compare_to_the_conditional_jump() {
        // cmp rdi, 0x1000; ja +0x93 (jemalloc 5.3's malloc).
        let code = [
            0x48, 0x81, 0xff, 0x00, 0x10, 0x00, 0x00, 0x0f, 0x87, 0x93, 0x00, 0x00, 0x00,
        ];
        let p = place(&code, 0x1000, &[Register::RDI], true);
        assert_eq!(p.offset, 7);
        assert_eq!(p.pushes, 0);
        assert_eq!(p.fallback, None);
    }

    #[test]
    fn never_after_the_argument_is_overwritten() {
        // mov rdi, rsi; ja ...: rdi is gone by the jump.
        let code = [0x48, 0x89, 0xf7, 0x77, 0x10, 0xc3];
        let p = place(&code, 0x1000, &[Register::RDI], true);
        assert_eq!(p.offset, 0);
        assert!(p.fallback.is_some());
        // The same, reading rsi only: the jump qualifies.
        assert_eq!(place(&code, 0x1000, &[Register::RSI], true).offset, 3);
    }

    #[test]
    fn cet_builds_are_probed_past_endbr64() {
        // endbr64; push r12; push rbp: glibc's malloc as CET builds start it.
        // endbr64 is single-stepped (~14x an emulated trap, `--verbose`
        // says on this host); the push after it is emulated and leaves rsp
        // as the entry had it, so even a return probe may go there.
        let code = [0xf3, 0x0f, 0x1e, 0xfa, 0x41, 0x54, 0x55, 0xeb, 0x00];
        let with_return = place(&code, 0x1000, &[Register::RDI], true);
        assert_eq!((with_return.offset, with_return.pushes), (4, 0));
        assert!(with_return.fallback.is_none());
        let entry_only = place(&code, 0x1000, &[Register::RDI], false);
        assert_eq!(entry_only.offset, 4);
    }

    #[test]
    fn pushes_count_for_entry_probes_and_block_return_probes() {
        // mov eax, 1; push rbx; jmp +0
        let code = [0xb8, 0x01, 0x00, 0x00, 0x00, 0x53, 0xeb, 0x00];
        // The push itself is emulated, with rsp still unchanged.
        let with_return = place(&code, 0x1000, &[Register::RDI], true);
        assert_eq!((with_return.offset, with_return.pushes), (5, 0));
        // A function that starts with a push: the entry itself is emulated.
        let push_first = [0x53, 0x48, 0x89, 0xfb, 0xeb, 0x00];
        assert_eq!(
            place(&push_first, 0x1000, &[Register::RDI], false).offset,
            0
        );
    }

    #[test]
    fn a_branch_landing_inside_the_prefix_keeps_the_entry() {
        // 0x1000: cmp rdi, 1; 0x1004: jne 0x1000+4 (lands on itself: a loop).
        let code = [0x48, 0x83, 0xff, 0x01, 0x75, 0xfe];
        let p = place(&code, 0x1000, &[Register::RDI], true);
        assert_eq!(p.offset, 0);
        assert!(p.fallback.unwrap().contains("lands"));
    }

    #[test]
    fn segment_prefixed_nops_are_not_probeable() {
        // cs nopw 0x0(%rax,%rax,1)
        let code = [0x2e, 0x66, 0x0f, 0x1f, 0x84, 0x00, 0x00, 0x00, 0x00, 0x00];
        let mut decoder = Decoder::with_ip(64, &code, 0, DecoderOptions::NONE);
        assert!(!is_emulated(&decoder.decode()));
        let plain = [0x66, 0x0f, 0x1f, 0x44, 0x00, 0x00];
        let mut decoder = Decoder::with_ip(64, &plain, 0, DecoderOptions::NONE);
        assert!(is_emulated(&decoder.decode()));
    }
}
