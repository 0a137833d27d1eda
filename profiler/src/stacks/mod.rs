//! Turning what the kernel sent about a sampled call into its stack:
//! DWARF unwinding of the copied stack, frame-pointer trust, and the
//! uretprobe trampoline of other tools.
pub(crate) mod trust;
pub(crate) mod unwind;

use crate::{
    collect::Drops,
    kernel::events::Event,
    proc::{AddressRange, Mapping},
    stacks::{
        trust::FramePointerTrust,
        unwind::{ProcessUnwinder, UnwindEnd},
    },
};

/// One process's stacks: its unwinder, frame-pointer trust and `[uprobes]`
/// area.
#[derive(Default)]
pub(crate) struct ProcessStacks {
    unwinder: ProcessUnwinder,
    trust: FramePointerTrust,
    /// Where the kernel's uretprobe trampoline lives in the process.
    trampoline: Option<AddressRange>,
}

impl ProcessStacks {
    /// Takes a fresh reading of the process's mappings.
    pub fn set_mappings(&mut self, pid: u32, mappings: &[Mapping]) {
        self.trampoline = mappings
            .iter()
            .find(|m| m.path.as_deref() == Some("[uprobes]"))
            .map(Mapping::range);
        self.unwinder.add_files(pid, mappings);
    }

    /// Completes a sampled event's stack: DWARF-unwound frames where the
    /// kernel copied the stack, the root of complete unwinds where it did
    /// not, and no trampoline frame. With `fast_path`, each copy also
    /// judges the frame-pointer walk; returns the process's new trust when
    /// it changes (the kernel is to be told).
    pub fn complete(
        &mut self,
        event: &mut Event,
        fast_path: bool,
        drops: &mut Drops,
    ) -> Option<bool> {
        let trust = self.unwind(event, fast_path, drops);
        if let Event::Sampled { frames, .. } = event
            && self.trampoline_caller(frames)
        {
            frames.remove(0);
            drops.trampoline_callers += 1;
        }
        trust
    }

    /// Forgets the trust of a process that exited: its pid may come back.
    pub fn reset_trust(&mut self) {
        self.trust = FramePointerTrust::default();
    }

    fn unwind(&mut self, event: &mut Event, fast_path: bool, drops: &mut Drops) -> Option<bool> {
        let Event::Sampled {
            frames, stack_copy, ..
        } = event
        else {
            return None;
        };
        let Some(copy) = stack_copy else {
            self.unwinder.complete_root(frames);
            if self.trust.trusted() {
                drops.trusted_frame_pointers += 1;
            }
            return None;
        };
        let mut unwound = Vec::new();
        let end = self.unwinder.unwind(&copy.regs, &copy.bytes, &mut unwound);
        let trust = if fast_path {
            let mut walked = frames.clone();
            self.unwinder.complete_root(&mut walked);
            self.trust.judge(end, walked == unwound)
        } else {
            None
        };
        // Another tool's uretprobe put the trampoline where the caller's
        // return address was: CFI cannot see past it; keep the walk, whose
        // trampoline frame is dropped and counted.
        if unwound.is_empty() || self.trampoline_caller(&unwound) {
            self.unwinder.complete_root(frames);
            return trust;
        }
        *frames = unwind::splice(&unwound, end, frames);
        drops.dwarf_unwound += 1;
        if end != UnwindEnd::Complete && frames.len() == unwound.len() {
            drops.truncated_stacks += 1;
        }
        trust
    }

    /// Another tool's return probe on the same function (a system-wide one
    /// at its entry, say) replaces the return address on the stack with the
    /// kernel's trampoline before our probe reads it: such a caller is
    /// dropped (the walk above it stays) and counted, not written as a frame.
    fn trampoline_caller(&self, frames: &[u64]) -> bool {
        let Some(trampoline) = self.trampoline else {
            return false;
        };
        frames
            .first()
            .is_some_and(|&caller| trampoline.contains(caller))
    }
}
