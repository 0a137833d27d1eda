//! DWARF unwinding of sampled calls in code built without frame pointers.
//!
//! For each sampled call the kernel sends the registers at the probe and
//! up to 16 KiB of the user stack above `rsp`; framehop walks that copy with
//! the call frame information (`.eh_frame`) of the mapped files, and falls
//! back to frame pointers where a file has none (JIT code). Files are
//! memory-mapped, not read: only the unwind tables' pages that unwinding
//! touches are ever resident, whatever the size of the binary.
use std::{collections::HashMap, fs::File, ops::Deref, ops::Range, sync::Arc};

use framehop::{
    ExplicitModuleSectionInfo, FrameAddress, Module, Unwinder,
    x86_64::{CacheX86_64, UnwindRegsX86_64, UnwinderX86_64},
};
use memmap2::Mmap;
use object::{Object, ObjectSection, ObjectSegment};
use profiler_common::UserRegs;

use crate::{
    discover::map_file,
    proc::{FileId, Mapping},
};

/// Most frames taken from one unwind; deeper stacks are cut here.
pub const MAX_UNWIND_FRAMES: usize = 256;

/// A section of a memory-mapped file.
#[derive(Clone)]
pub struct SectionBytes {
    file: Arc<Mmap>,
    range: Range<usize>,
}

impl Deref for SectionBytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.file[self.range.clone()]
    }
}

/// How an unwind ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UnwindEnd {
    /// At the stack's outermost frame.
    Complete,
    /// It needed stack memory beyond the copy the kernel sent.
    StackCopyExhausted,
    /// Unwind information led nowhere (a frame without CFI and without a
    /// frame pointer, or a corrupt stack).
    Lost,
    /// [`MAX_UNWIND_FRAMES`] reached.
    TooDeep,
}

/// Unwinds the samples of one process.
pub struct ProcessUnwinder {
    unwinder: UnwinderX86_64<SectionBytes>,
    cache: CacheX86_64,
    /// Files already added, by identity, with the start of their range.
    modules: HashMap<FileId, u64>,
    /// The outermost frames seen in complete DWARF unwinds, by the frame
    /// below them: where a frame-pointer walk ends (in the C runtime's
    /// start code) DWARF goes on, so samples sent without a stack copy get
    /// the same root as the others and stacks stay comparable.
    root_tails: HashMap<u64, Vec<u64>>,
}

/// Frames near the root remembered per complete unwind, and in all.
const ROOT_FRAMES: usize = 4;
const MAX_ROOT_TAILS: usize = 4096;

impl ProcessUnwinder {
    pub fn new() -> Self {
        Self {
            unwinder: UnwinderX86_64::new(),
            cache: CacheX86_64::new(),
            modules: HashMap::new(),
            root_tails: HashMap::new(),
        }
    }

    /// Adds the executable files of `mappings` not yet known, reading them
    /// through `/proc/PID/map_files` (inside the target's mount namespace).
    /// Files that cannot be read are skipped: their frames fall back to
    /// frame pointers.
    pub fn add_files(&mut self, pid: u32, mappings: &[Mapping]) {
        let mut by_file: HashMap<FileId, Vec<&Mapping>> = HashMap::new();
        for m in mappings.iter().filter(|m| m.is_file()) {
            by_file.entry(m.file).or_default().push(m);
        }
        // Files unmapped since (a dlclose'd library) go: another file may
        // take their addresses.
        let unmapped: Vec<FileId> = self
            .modules
            .keys()
            .filter(|file| !by_file.contains_key(file))
            .copied()
            .collect();
        for file in unmapped {
            if let Some(start) = self.modules.remove(&file) {
                self.unwinder.remove_module(start);
            }
        }
        for (file, maps) in by_file {
            let Some(code) = maps.iter().find(|m| m.is_executable()) else {
                continue;
            };
            let start = maps.iter().map(|m| m.start).min().unwrap_or(code.start);
            let end = maps.iter().map(|m| m.end).max().unwrap_or(code.end);
            if self.modules.get(&file) == Some(&start) {
                continue;
            }
            if let Some(&old_start) = self.modules.get(&file) {
                self.unwinder.remove_module(old_start);
            }
            let name = code.path.clone().unwrap_or_default();
            if let Some(module) = module(&name, pid, code, start..end) {
                self.unwinder.add_module(module);
                self.modules.insert(file, start);
            }
        }
    }

    /// Return addresses of the sampled call, innermost first (the probed
    /// instruction itself is not included).
    pub fn unwind(&mut self, regs: &UserRegs, stack: &[u8], frames: &mut Vec<u64>) -> UnwindEnd {
        frames.clear();
        let base = regs.sp;
        let mut read_stack = |address: u64| -> Result<u64, ()> {
            let offset = address.checked_sub(base).ok_or(())? as usize;
            let bytes = stack
                .get(offset..offset.checked_add(8).ok_or(())?)
                .ok_or(())?;
            Ok(u64::from_le_bytes(bytes.try_into().map_err(|_| ())?))
        };
        let mut iter = self.unwinder.iter_frames(
            regs.ip,
            UnwindRegsX86_64::new(regs.ip, regs.sp, regs.bp),
            &mut self.cache,
            &mut read_stack,
        );
        loop {
            match iter.next() {
                Ok(Some(FrameAddress::InstructionPointer(_))) => {}
                Ok(Some(FrameAddress::ReturnAddress(address))) => {
                    if frames.len() == MAX_UNWIND_FRAMES {
                        return UnwindEnd::TooDeep;
                    }
                    frames.push(address.get());
                }
                Ok(None) => {
                    self.learn_root(frames);
                    return UnwindEnd::Complete;
                }
                Err(framehop::Error::CouldNotReadStack(_)) => {
                    return UnwindEnd::StackCopyExhausted;
                }
                Err(_) => return UnwindEnd::Lost,
            }
        }
    }
}

impl ProcessUnwinder {
    fn learn_root(&mut self, frames: &[u64]) {
        let first = frames.len().saturating_sub(ROOT_FRAMES);
        for at in first..frames.len().saturating_sub(1) {
            if self.root_tails.len() >= MAX_ROOT_TAILS {
                return;
            }
            self.root_tails
                .entry(frames[at])
                .or_insert_with(|| frames[at + 1..].to_vec());
        }
    }

    /// Extends a frame-pointer walk that ended where complete unwinds went
    /// on, with their outer frames.
    pub fn complete_root(&self, frames: &mut Vec<u64>) {
        if let Some(tail) = frames.last().and_then(|last| self.root_tails.get(last)) {
            frames.extend_from_slice(tail);
        }
    }
}

impl Default for ProcessUnwinder {
    fn default() -> Self {
        Self::new()
    }
}

/// The framehop module of one mapped file: its unwind sections, and the
/// bias between the file's addresses and the process's.
fn module(
    name: &str,
    pid: u32,
    code: &Mapping,
    avma_range: Range<u64>,
) -> Option<Module<SectionBytes>> {
    let file = File::open(map_file(pid, code)).ok()?;
    // SAFETY: a read-only private mapping; a file truncated under us would
    // fault, which is why only shared objects and executables (which the
    // target itself maps) are mapped here.
    let data = Arc::new(unsafe { Mmap::map(&file) }.ok()?);
    let elf = object::File::parse(&data[..]).ok()?;
    let bias = load_bias(&elf, code)?;
    let section = |name: &str| {
        let section = elf.section_by_name(name)?;
        let (offset, size) = section.file_range()?;
        let range = offset as usize..(offset + size) as usize;
        (range.end <= data.len()).then(|| {
            let svma = section.address()..section.address() + section.size();
            (
                svma,
                SectionBytes {
                    file: data.clone(),
                    range,
                },
            )
        })
    };
    let (text_svma, text) = section(".text").unzip();
    let (eh_frame_svma, eh_frame) = section(".eh_frame").unzip();
    let (eh_frame_hdr_svma, eh_frame_hdr) = section(".eh_frame_hdr").unzip();
    let debug_frame = section(".debug_frame").map(|(_, bytes)| bytes);
    let got_svma = section(".got").map(|(svma, _)| svma);
    let info = ExplicitModuleSectionInfo {
        base_svma: 0,
        text_svma,
        text,
        got_svma,
        eh_frame_svma,
        eh_frame,
        eh_frame_hdr_svma,
        eh_frame_hdr,
        debug_frame,
        stubs_svma: None,
        stub_helper_svma: None,
        unwind_info: None,
        text_segment_svma: None,
        text_segment: None,
    };
    Some(Module::new(name.to_owned(), avma_range, bias, info))
}

/// What to add to the file's addresses to get the process's, from the
/// executable mapping `code`. The loader maps each segment from its offset
/// rounded down to a page, so a mapping may start before its segment's
/// offset and a page may hold the end of the segment before (lld packs
/// segments that way): the executable segment whose pages hold the
/// mapping's offset is the one.
fn load_bias(elf: &object::File<'_>, code: &Mapping) -> Option<u64> {
    const PAGE: u64 = 4096;
    let executable = |s: &object::Segment<'_, '_>| match s.flags() {
        object::SegmentFlags::Elf { p_flags } => p_flags & object::elf::PF_X != 0,
        _ => false,
    };
    let segment = elf
        .segments()
        .filter(|s| {
            let (offset, size) = s.file_range();
            offset & !(PAGE - 1) <= code.offset && code.offset < offset + size
        })
        .max_by_key(executable)?;
    let (offset, _) = segment.file_range();
    let page_offset = offset & !(PAGE - 1);
    let page_address = segment.address() - (offset - page_offset);
    Some(
        code.start
            .wrapping_sub(page_address + (code.offset - page_offset)),
    )
}

/// The frames to keep: DWARF's where it unwound, continued by the frame
/// pointer walk when the stack copy ran out before the stack's end and the
/// two walks meet (deep stacks in code that keeps frame pointers).
pub fn splice(dwarf: &[u64], end: UnwindEnd, frame_pointers: &[u64]) -> Vec<u64> {
    let mut frames = dwarf.to_vec();
    if end == UnwindEnd::StackCopyExhausted
        && let Some(&last) = dwarf.last()
        && let Some(at) = frame_pointers.iter().rposition(|&f| f == last)
    {
        frames.extend_from_slice(&frame_pointers[at + 1..]);
    }
    frames
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proc::parse_maps;

    /// Registers and stack of the calling thread, as the kernel would send
    /// them: at most 16 KiB from `rsp`, not beyond the stack's mapping.
    #[inline(never)]
    fn capture(maps: &[Mapping]) -> (UserRegs, Vec<u8>) {
        let (ip, sp, bp): (u64, u64, u64);
        // SAFETY: reads three registers, touches no memory.
        unsafe {
            std::arch::asm!(
                "lea {ip}, [rip]",
                "mov {sp}, rsp",
                "mov {bp}, rbp",
                ip = out(reg) ip,
                sp = out(reg) sp,
                bp = out(reg) bp,
            );
        }
        let end = maps
            .iter()
            .find(|m| sp >= m.start && sp < m.end)
            .map(|m| m.end)
            .unwrap();
        let len = ((end - sp) as usize).min(16384);
        // SAFETY: [sp, sp + len) lies within this thread's stack mapping.
        let stack = unsafe { std::slice::from_raw_parts(sp as *const u8, len) }.to_vec();
        (UserRegs { ip, sp, bp }, stack)
    }

    #[inline(never)]
    fn middle(maps: &[Mapping]) -> (UserRegs, Vec<u8>) {
        let captured = capture(maps);
        std::hint::black_box(captured)
    }

    #[inline(never)]
    fn outer(maps: &[Mapping]) -> (UserRegs, Vec<u8>) {
        let captured = middle(maps);
        std::hint::black_box(captured)
    }

    /// Unwinds this very thread from a copy of its stack, with the test
    /// binary's own .eh_frame: the return addresses land in `middle` and
    /// `outer`, in that order.
    #[test]
    fn unwinds_its_own_stack_with_dwarf() {
        let pid = std::process::id();
        let maps = parse_maps(&std::fs::read_to_string("/proc/self/maps").unwrap());
        let (regs, stack) = outer(&maps);
        let mut unwinder = ProcessUnwinder::new();
        unwinder.add_files(pid, &maps);
        let mut frames = Vec::new();
        unwinder.unwind(&regs, &stack, &mut frames);
        let text = std::fs::read_to_string("/proc/self/maps").unwrap();
        let mut namer = crate::symbolize::Namer::for_process(pid, &text);
        let names: Vec<String> = frames
            .iter()
            .map(|&f| namer.frames(f - 1)[0].name())
            .collect();
        let at = |function: &str| names.iter().position(|n| n.ends_with(function));
        let (m, o) = (at("tests::middle"), at("tests::outer"));
        assert!(matches!((m, o), (Some(0), Some(1))), "{names:?}");
    }

    #[test]
    fn frame_pointer_walks_get_the_root_complete_unwinds_saw() {
        let mut unwinder = ProcessUnwinder::new();
        unwinder.learn_root(&[1, 2, 3, 10, 11, 12]);
        let mut walked = vec![5, 6, 11];
        unwinder.complete_root(&mut walked);
        assert_eq!(walked, [5, 6, 11, 12]);
        let mut unknown = vec![5, 6, 7];
        unwinder.complete_root(&mut unknown);
        assert_eq!(unknown, [5, 6, 7]);
        // Only the frames near the root are remembered.
        let mut inner = vec![1];
        unwinder.complete_root(&mut inner);
        assert_eq!(inner, [1]);
    }

    #[test]
    fn splice_continues_where_the_walks_meet() {
        let dwarf = [1, 2, 3];
        let fp = [1, 9, 3, 4, 5];
        assert_eq!(
            splice(&dwarf, UnwindEnd::StackCopyExhausted, &fp),
            [1, 2, 3, 4, 5]
        );
        assert_eq!(splice(&dwarf, UnwindEnd::Complete, &fp), [1, 2, 3]);
        assert_eq!(
            splice(&dwarf, UnwindEnd::StackCopyExhausted, &[7, 8]),
            [1, 2, 3]
        );
    }
}
