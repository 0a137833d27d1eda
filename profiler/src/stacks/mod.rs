//! Turning what the kernel sent about a sampled call into its stack:
//! DWARF unwinding of the copied stack, frame-pointer trust, and the
//! uretprobe trampoline of other tools.
pub(crate) mod trust;
pub(crate) mod unwind;

use crate::{
    kernel::events::KernelSample,
    proc::{AddressRange, Mapping},
    profile::Drops,
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
        sample: &mut KernelSample,
        fast_path: bool,
        drops: &mut Drops,
    ) -> Option<bool> {
        self.put_back_hijacked_return(sample);
        let trust = self.unwind(sample, fast_path, drops);
        if self.trampoline_caller(&sample.frames) {
            sample.frames.remove(0);
            drops.trampoline_callers += 1;
        }
        trust
    }

    /// Whether `event` needs the trampoline's place, not known yet (the
    /// kernel maps it at the first return probe that runs): the maps are
    /// to be read again.
    pub fn needs_trampoline(&self, sample: &KernelSample) -> bool {
        sample.hijacked.is_some() && self.trampoline.is_none()
    }

    /// A return half (memprobe's, or another uprobe session's on the same
    /// file) replaced a return address on the sampled stack with the
    /// kernel's trampoline (a `realloc` around one of jemalloc's samples):
    /// puts it back in the stack copy and in the frame-pointer walk, so
    /// that both go on past it. Only where the trampoline stands: the
    /// kernel's note is of the thread's last `realloc`, which may have
    /// returned.
    fn put_back_hijacked_return(&self, sample: &mut KernelSample) {
        let KernelSample {
            frames,
            stack_copy,
            hijacked: Some(hijacked),
            ..
        } = sample
        else {
            return;
        };
        let Some(trampoline) = self.trampoline else {
            return;
        };
        let original = hijacked.return_address.to_le_bytes();
        if let Some(copy) = stack_copy
            && let Some(offset) = hijacked.slot.checked_sub(copy.regs.sp)
            && let Ok(offset) = usize::try_from(offset)
            && let Some(word) = copy.bytes.get_mut(offset..offset.saturating_add(8))
            && trampoline.contains(u64::from_le_bytes((&*word).try_into().unwrap_or_default()))
        {
            word.copy_from_slice(&original);
        }
        if let Some(frame) = frames.iter_mut().find(|f| trampoline.contains(**f)) {
            *frame = hijacked.return_address;
        }
    }

    /// Forgets the trust of a process that exited: its pid may come back.
    pub fn reset_trust(&mut self) {
        self.trust = FramePointerTrust::default();
    }

    fn unwind(
        &mut self,
        sample: &mut KernelSample,
        fast_path: bool,
        drops: &mut Drops,
    ) -> Option<bool> {
        let KernelSample {
            frames, stack_copy, ..
        } = sample;
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
    /// Drops the frames where a return probe's trampoline stands for a
    /// return address on the stack (an allocation call in flight with its
    /// return half, around a mapping it made): what it hid is not known,
    /// and the trampoline names nothing. Returns how many were dropped.
    pub fn drop_trampoline_frames(&self, frames: &mut Vec<u64>) -> usize {
        let Some(trampoline) = self.trampoline else {
            return 0;
        };
        let before = frames.len();
        frames.retain(|&f| !trampoline.contains(f));
        before - frames.len()
    }

    /// Whether the trampoline's place is to be read again: a frame lies
    /// in no mapping known.
    pub fn has_unplaced(&self, frames: &[u64], mappings: &[Mapping]) -> bool {
        frames
            .iter()
            .any(|&f| !mappings.iter().any(|m| m.range().contains(f)))
    }

    fn trampoline_caller(&self, frames: &[u64]) -> bool {
        let Some(trampoline) = self.trampoline else {
            return false;
        };
        frames
            .first()
            .is_some_and(|&caller| trampoline.contains(caller))
    }
}

#[cfg(test)]
mod tests {
    use profiler_common::{EventHeader, UserRegs};

    use super::*;
    use crate::{
        kernel::events::{HijackedReturn, StackCopy},
        proc::parse_maps,
    };

    const TRAMPOLINE: u64 = 0x7fff_ffff_e000;
    const SP: u64 = 0x7ffd_0000_0000;

    fn with_trampoline() -> ProcessStacks {
        let mut stacks = ProcessStacks::default();
        let maps = "7fffffffe000-7ffffffff000 r-xp 00000000 00:00 0 [uprobes]";
        stacks.set_mappings(std::process::id(), &parse_maps(maps));
        stacks
    }

    /// A sample with `words` of stack from `SP` and a frame-pointer walk.
    fn sample(words: &[u64], frames: &[u64], slot: u64) -> KernelSample {
        KernelSample {
            header: EventHeader::default(),
            size: 64,
            align: 0,
            frames: frames.to_vec(),
            stack_error: false,
            stack_copy: Some(StackCopy {
                regs: UserRegs {
                    ip: 0x1000,
                    sp: SP,
                    bp: 0,
                },
                bytes: words.iter().flat_map(|w| w.to_le_bytes()).collect(),
            }),
            window: 0,
            hijacked: Some(HijackedReturn {
                slot,
                return_address: 0x4242,
            }),
            send_nanos: 0,
        }
    }

    fn stack_and_frames(sample: &KernelSample) -> (Vec<u64>, Vec<u64>) {
        let words = sample.stack_copy.as_ref().unwrap().bytes.chunks(8);
        let words = words.map(|w| u64::from_le_bytes(w.try_into().unwrap()));
        (words.collect(), sample.frames.clone())
    }

    #[test]
    fn the_trampoline_gives_back_the_return_address_it_stands_for() {
        let stacks = with_trampoline();
        let mut event = sample(&[1, TRAMPOLINE, 3], &[0x10, TRAMPOLINE, 0x30], SP + 8);
        assert!(!stacks.needs_trampoline(&event));
        stacks.put_back_hijacked_return(&mut event);
        let (words, frames) = stack_and_frames(&event);
        assert_eq!(words, [1, 0x4242, 3]);
        assert_eq!(frames, [0x10, 0x4242, 0x30]);
    }

    #[test]
    fn a_slot_that_holds_no_trampoline_is_left_alone() {
        // The kernel's note was of a call that returned: nothing changes.
        let stacks = with_trampoline();
        let mut event = sample(&[1, 2, 3], &[0x10, 0x20], SP + 8);
        stacks.put_back_hijacked_return(&mut event);
        assert_eq!(stack_and_frames(&event), (vec![1, 2, 3], vec![0x10, 0x20]));
        // Past the copy's end, or below its start.
        for slot in [SP + 24, SP - 8] {
            let mut event = sample(&[1, TRAMPOLINE, 3], &[], slot);
            stacks.put_back_hijacked_return(&mut event);
            assert_eq!(stack_and_frames(&event).0, [1, TRAMPOLINE, 3]);
        }
        // Where the trampoline is not known yet, the maps are read again.
        let event = sample(&[1, TRAMPOLINE, 3], &[], SP + 8);
        assert!(ProcessStacks::default().needs_trampoline(&event));
    }
}
