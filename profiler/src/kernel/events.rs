//! Decoding ring-buffer records into events.
use std::mem::size_of;

use profiler_common::{
    AllocEvent, AllocReturnEvent, AllocStackEvent, EventHeader, EventKind, FreeEvent,
    MAX_STACK_DEPTH, MappingEvent, RemapEvent, ResizeEvent, SMALL_STACK_COPY_BYTES,
    STACK_COPY_BYTES, UserRegs,
    python::{MAX_PYTHON_FRAMES, PythonFrame, PythonStackEvent},
};

/// One ring-buffer record, decoded.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// A sampled allocation call (its pointer follows in `Returned`).
    Sampled(KernelSample),
    Returned {
        header: EventHeader,
        ptr: u64,
        untracked: bool,
    },
    /// A sampled pointer was freed; by a `realloc` or `rallocx` where
    /// `in_resize` (then `Restored` follows on the same thread if the call
    /// fails).
    Freed {
        header: EventHeader,
        ptr: u64,
        in_resize: bool,
    },
    /// The resize that freed the thread's sampled `ptr` failed.
    Restored { header: EventHeader, ptr: u64 },
    Resized {
        header: EventHeader,
        ptr: u64,
        new_size: u64,
    },
    /// The process mapped a file's code (a `dlopen`ed library).
    MappedCode { header: EventHeader },
    /// The process mapped anonymous memory.
    Mapped(KernelMapping),
    /// The process unmapped `len` bytes at `addr`.
    Unmapped {
        header: EventHeader,
        addr: u64,
        len: u64,
    },
    /// The Python frames of the thread's next sampled call, innermost first.
    PythonStack {
        header: EventHeader,
        frames: Vec<PythonFrame>,
    },
    /// The process moved or resized a mapping with `mremap`.
    Remapped {
        header: EventHeader,
        addr: u64,
        len: u64,
        new_addr: u64,
        new_len: u64,
    },
}

/// Anonymous memory a process mapped, with the stack that mapped it (as a
/// sample's, still to be unwound: its `size` is the length).
#[derive(Clone, Debug, PartialEq)]
pub struct KernelMapping {
    pub addr: u64,
    /// `MAP_SHARED`: shared memory, not the process's own.
    pub shared: bool,
    pub stack: KernelSample,
}

/// A sampled allocation call as the kernel told it: its stack is still to
/// be unwound (`stacks`), its probe's allocator and sampling to be looked
/// up (`run`).
#[derive(Clone, Debug, PartialEq)]
pub struct KernelSample {
    pub header: EventHeader,
    pub size: u64,
    pub align: u64,
    /// Return addresses, innermost first, allocator frames removed.
    pub frames: Vec<u64>,
    pub stack_error: bool,
    /// Registers and stack bytes for DWARF unwinding, when the kernel
    /// could copy any.
    pub stack_copy: Option<StackCopy>,
    /// The bytes it was counted as: in a sampling window, its size made
    /// denser; on jemalloc's slow path, the window of bytes it closed (0:
    /// sampled by its own size).
    pub window: u64,
    /// Where the thread's last probed `realloc` kept its return address,
    /// which a return half replaces with the kernel's trampoline.
    pub hijacked: Option<HijackedReturn>,
    /// What the program spent on the sample, timed in the kernel: its
    /// price beyond an unsampled hit (0 where not timed, as a mapping).
    pub send_nanos: u64,
}

impl Event {
    pub fn header(&self) -> &EventHeader {
        match self {
            Event::Sampled(KernelSample { header, .. })
            | Event::Returned { header, .. }
            | Event::Freed { header, .. }
            | Event::Restored { header, .. }
            | Event::Resized { header, .. }
            | Event::MappedCode { header }
            | Event::PythonStack { header, .. }
            | Event::Unmapped { header, .. }
            | Event::Remapped { header, .. } => header,
            Event::Mapped(mapping) => &mapping.stack.header,
        }
    }
}

/// Where the kernel's uretprobe trampoline stands for a return address on
/// the sampled thread's stack, and that address.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HijackedReturn {
    pub slot: u64,
    pub return_address: u64,
}

/// What the kernel copied for unwinding a sampled call in userspace.
#[derive(Clone, Debug, PartialEq)]
pub struct StackCopy {
    pub regs: UserRegs,
    /// The stack from `regs.sp` up.
    pub bytes: Vec<u8>,
}

fn read<T: Copy>(bytes: &[u8]) -> Option<T> {
    // SAFETY: length checked; the types are plain old data; unaligned read.
    (bytes.len() >= size_of::<T>()).then(|| unsafe { bytes.as_ptr().cast::<T>().read_unaligned() })
}

/// A sampled call with `N` bytes of its stack copied.
fn with_stack<const N: usize>(header: EventHeader, bytes: &[u8]) -> Option<Event> {
    let event: AllocStackEvent<N> = read(bytes)?;
    let copied = (event.stack_copy_bytes as usize).min(N);
    let stack_copy = (copied > 0).then(|| StackCopy {
        regs: event.alloc.regs,
        bytes: event.stack_copy[..copied].to_vec(),
    });
    Some(sampled(header, &event.alloc, stack_copy))
}

/// Decodes one record; `None` for a record of unknown kind or short length.
pub fn decode(bytes: &[u8]) -> Option<Event> {
    let header: EventHeader = read(bytes)?;
    Some(match EventKind::from_raw(header.kind)? {
        EventKind::Alloc => sampled(header, &read(bytes)?, None),
        EventKind::AllocWithStack => with_stack::<STACK_COPY_BYTES>(header, bytes)?,
        EventKind::AllocWithSmallStack => with_stack::<SMALL_STACK_COPY_BYTES>(header, bytes)?,
        EventKind::AllocReturn => {
            let event: AllocReturnEvent = read(bytes)?;
            Event::Returned {
                header,
                ptr: event.ptr,
                untracked: event.untracked != 0,
            }
        }
        kind @ (EventKind::Free | EventKind::FreeInResize) => {
            let event: FreeEvent = read(bytes)?;
            Event::Freed {
                header,
                ptr: event.ptr,
                in_resize: kind == EventKind::FreeInResize,
            }
        }
        EventKind::Restored => {
            let event: FreeEvent = read(bytes)?;
            Event::Restored {
                header,
                ptr: event.ptr,
            }
        }
        EventKind::MappedCode => Event::MappedCode { header },
        EventKind::Mapped => mapped(header, bytes)?,
        EventKind::Unmapped => {
            let event: RemapEvent = read(bytes)?;
            Event::Unmapped {
                header,
                addr: event.addr,
                len: event.len,
            }
        }
        EventKind::Remapped => {
            let event: RemapEvent = read(bytes)?;
            Event::Remapped {
                header,
                addr: event.addr,
                len: event.len,
                new_addr: event.new_addr,
                new_len: event.new_len,
            }
        }
        EventKind::PythonStack => {
            // Boxed: a record is some 1 KiB.
            let event: Box<PythonStackEvent> = Box::new(read(bytes)?);
            let count = (event.count as usize).min(MAX_PYTHON_FRAMES);
            Event::PythonStack {
                header,
                frames: event.frames[..count].to_vec(),
            }
        }
        EventKind::Resize => {
            let event: ResizeEvent = read(bytes)?;
            Event::Resized {
                header,
                ptr: event.ptr,
                new_size: event.new_size,
            }
        }
    })
}

/// `MAP_SHARED` in `mmap`'s flags.
const MAP_SHARED: u64 = 1;

/// A mapping: its stack as a sampled call's, told at `mmap`'s return: the
/// instruction it returns to is the first frame.
fn mapped(header: EventHeader, bytes: &[u8]) -> Option<Event> {
    // Boxed: a record is some 17 KiB.
    let event: Box<MappingEvent> = Box::new(read(bytes)?);
    let as_call = AllocEvent {
        header,
        size: event.len,
        align: 0,
        caller: event.regs.ip,
        stack_bytes: event.stack_bytes,
        stack: event.stack,
        regs: event.regs,
        window: 0,
        hijacked_slot: 0,
        hijacked_return: 0,
        send_nanos: 0,
    };
    let copied = (event.stack_copy_bytes as usize).min(STACK_COPY_BYTES);
    let stack_copy = (copied > 0).then(|| StackCopy {
        regs: event.regs,
        bytes: event.stack_copy[..copied].to_vec(),
    });
    let Event::Sampled(stack) = sampled(header, &as_call, stack_copy) else {
        return None;
    };
    Some(Event::Mapped(KernelMapping {
        addr: event.addr,
        shared: event.flags & MAP_SHARED != 0,
        stack,
    }))
}

fn sampled(header: EventHeader, event: &AllocEvent, stack_copy: Option<StackCopy>) -> Event {
    let (frames, stack_error) = user_frames(event);
    Event::Sampled(KernelSample {
        header,
        size: event.size,
        window: event.window,
        align: event.align,
        frames,
        stack_error,
        stack_copy,
        hijacked: (event.hijacked_slot != 0).then_some(HijackedReturn {
            slot: event.hijacked_slot,
            return_address: event.hijacked_return,
        }),
        send_nanos: event.send_nanos,
    })
}

/// The caller's return address, then the frame-pointer walk above it.
///
/// `stack[0]` is the probed instruction inside the allocator: dropped. At a
/// function's first instructions the walk misses the immediate caller (its
/// return address is at `[rsp]`, not in a frame yet), so the probe reads it
/// separately; the kernel adds it itself when the probe sits on `push %rbp`
/// or `endbr64`, in which case it is not added twice.
pub fn user_frames(event: &AllocEvent) -> (Vec<u64>, bool) {
    let stack_error = event.stack_bytes < 0;
    let depth = if stack_error {
        0
    } else {
        (event.stack_bytes as usize / size_of::<u64>()).min(MAX_STACK_DEPTH)
    };
    let walked = event.stack[..depth].iter().skip(1).copied();
    let mut frames = Vec::with_capacity(depth + 1);
    if event.caller != 0 {
        frames.push(event.caller);
    }
    for (i, frame) in walked.enumerate() {
        if frame == 0 || (i == 0 && frame == event.caller) {
            continue;
        }
        frames.push(frame);
    }
    (frames, stack_error)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn alloc_event(caller: u64, walked: &[u64]) -> AllocEvent {
        let mut stack = [0; MAX_STACK_DEPTH];
        stack[..walked.len()].copy_from_slice(walked);
        AllocEvent {
            header: EventHeader {
                kind: EventKind::Alloc as u32,
                ..Default::default()
            },
            size: 4096,
            align: 0,
            caller,
            stack_bytes: (walked.len() * 8) as i64,
            stack,
            regs: UserRegs::default(),
            window: 0,
            hijacked_slot: 0,
            hijacked_return: 0,
            send_nanos: 0,
        }
    }

    #[test]
    fn caller_comes_first_and_probe_address_is_dropped() {
        let event = alloc_event(0x1111, &[0xa000, 0x2222, 0x3333]);
        assert_eq!(user_frames(&event).0, [0x1111, 0x2222, 0x3333]);
    }

    #[test]
    fn caller_added_by_the_kernel_is_not_repeated() {
        let event = alloc_event(0x1111, &[0xa000, 0x1111, 0x2222]);
        assert_eq!(user_frames(&event).0, [0x1111, 0x2222]);
    }

    #[test]
    fn decodes_each_kind_and_rejects_garbage() {
        let event = alloc_event(0x1111, &[0xa000]);
        // SAFETY: viewing a POD struct as bytes.
        let bytes = unsafe {
            std::slice::from_raw_parts(
                (&event as *const AllocEvent).cast::<u8>(),
                size_of::<AllocEvent>(),
            )
        };
        match decode(bytes) {
            Some(Event::Sampled(KernelSample { size, frames, .. })) => {
                assert_eq!(size, 4096);
                assert_eq!(frames, [0x1111]);
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(decode(&bytes[..20]), None);
        assert_eq!(decode(&[0xff; 64]), None);
    }

    #[test]
    fn a_small_stack_copy_decodes_with_the_bytes_it_holds() {
        let mut alloc = alloc_event(0x1111, &[0xa000]);
        alloc.header.kind = EventKind::AllocWithSmallStack as u32;
        alloc.regs.sp = 0x7ff0_0000;
        let event = AllocStackEvent::<SMALL_STACK_COPY_BYTES> {
            alloc,
            stack_copy_bytes: 100,
            stack_copy: [7; SMALL_STACK_COPY_BYTES],
        };
        // SAFETY: viewing a POD struct as bytes.
        let bytes = unsafe {
            std::slice::from_raw_parts(
                (&event as *const AllocStackEvent<SMALL_STACK_COPY_BYTES>).cast::<u8>(),
                size_of_val(&event),
            )
        };
        match decode(bytes) {
            Some(Event::Sampled(KernelSample {
                stack_copy: Some(copy),
                ..
            })) => {
                assert_eq!(copy.bytes, [7; 100]);
                assert_eq!(copy.regs.sp, 0x7ff0_0000);
            }
            other => panic!("{other:?}"),
        }
        // A whole copy's kind needs a whole copy's length.
        let mut whole = bytes.to_vec();
        whole[..4].copy_from_slice(&(EventKind::AllocWithStack as u32).to_ne_bytes());
        assert_eq!(decode(&whole), None);
    }
}
