//! Decoding ring-buffer records into events.
use std::mem::size_of;

use crate::discover::AllocatorKind;

use profiler_common::{
    AllocEvent, AllocReturnEvent, AllocStackEvent, EventHeader, FreeEvent, MAX_STACK_DEPTH,
    ResizeEvent, SMALL_STACK_COPY_BYTES, STACK_COPY_BYTES, UserRegs, event_kind,
};

#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// A sampled allocation call (its pointer follows in `Returned`).
    Sampled {
        header: EventHeader,
        size: u64,
        align: u64,
        /// Return addresses, innermost first, allocator frames removed.
        frames: Vec<u64>,
        stack_error: bool,
        /// Registers and stack bytes for DWARF unwinding, when the kernel
        /// could copy any.
        stack_copy: Option<StackCopy>,
        /// For a call sampled on jemalloc's slow path, the bytes of the
        /// window it stands for (0: sampled by its own size).
        window: u64,
        /// The allocator of the probe that fired, which sizes the bytes
        /// (set by the run from the probe index; jemalloc until then).
        allocator: AllocatorKind,
        /// The mean sampling interval it was drawn with, for a sample
        /// jemalloc's own profiler took (set by the run); 0: memprobe's.
        interval: u64,
        /// The allocator copy of the probe (its instance; set by the run).
        copy: u16,
        /// For a call sampled in a sampling window (`--sampling windows`),
        /// how many times its window's bytes its thread allocated over the
        /// cycle the window stands for (set by the run); `None` elsewhere.
        scale: Option<f64>,
        /// Where the thread's last probed `realloc` kept its return address,
        /// which a return half replaces with the kernel's trampoline.
        hijacked: Option<HijackedReturn>,
    },
    Returned {
        header: EventHeader,
        ptr: u64,
        untracked: bool,
    },
    /// A sampled pointer was freed; by a `realloc` or `rallocx` when the
    /// header's kind is `FREE_IN_RESIZE` (then `Restored` follows on the
    /// same thread if the call fails).
    Freed { header: EventHeader, ptr: u64 },
    /// The resize that freed the thread's sampled `ptr` failed.
    Restored { header: EventHeader, ptr: u64 },
    Resized {
        header: EventHeader,
        ptr: u64,
        new_size: u64,
    },
    /// The process mapped a file's code (a `dlopen`ed library).
    MappedCode { header: EventHeader },
}

impl Event {
    pub fn header(&self) -> &EventHeader {
        match self {
            Event::Sampled { header, .. }
            | Event::Returned { header, .. }
            | Event::Freed { header, .. }
            | Event::Restored { header, .. }
            | Event::Resized { header, .. }
            | Event::MappedCode { header } => header,
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
    Some(match header.kind {
        event_kind::ALLOC => sampled(header, &read(bytes)?, None),
        event_kind::ALLOC_WITH_STACK => with_stack::<STACK_COPY_BYTES>(header, bytes)?,
        event_kind::ALLOC_WITH_SMALL_STACK => with_stack::<SMALL_STACK_COPY_BYTES>(header, bytes)?,
        event_kind::ALLOC_RETURN => {
            let event: AllocReturnEvent = read(bytes)?;
            Event::Returned {
                header,
                ptr: event.ptr,
                untracked: event.untracked != 0,
            }
        }
        event_kind::FREE | event_kind::FREE_IN_RESIZE => {
            let event: FreeEvent = read(bytes)?;
            Event::Freed {
                header,
                ptr: event.ptr,
            }
        }
        event_kind::RESTORED => {
            let event: FreeEvent = read(bytes)?;
            Event::Restored {
                header,
                ptr: event.ptr,
            }
        }
        event_kind::MAPPED_CODE => Event::MappedCode { header },
        event_kind::RESIZE => {
            let event: ResizeEvent = read(bytes)?;
            Event::Resized {
                header,
                ptr: event.ptr,
                new_size: event.new_size,
            }
        }
        _ => return None,
    })
}

fn sampled(header: EventHeader, event: &AllocEvent, stack_copy: Option<StackCopy>) -> Event {
    let (frames, stack_error) = user_frames(event);
    Event::Sampled {
        header,
        size: event.size,
        window: event.window,
        align: event.align,
        frames,
        stack_error,
        stack_copy,
        allocator: AllocatorKind::Jemalloc,
        interval: 0,
        copy: 0,
        scale: None,
        hijacked: (event.hijacked_slot != 0).then_some(HijackedReturn {
            slot: event.hijacked_slot,
            return_address: event.hijacked_return,
        }),
    }
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
                kind: event_kind::ALLOC,
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
            Some(Event::Sampled { size, frames, .. }) => {
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
        alloc.header.kind = event_kind::ALLOC_WITH_SMALL_STACK;
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
            Some(Event::Sampled {
                stack_copy: Some(copy),
                ..
            }) => {
                assert_eq!(copy.bytes, [7; 100]);
                assert_eq!(copy.regs.sp, 0x7ff0_0000);
            }
            other => panic!("{other:?}"),
        }
        // A whole copy's kind needs a whole copy's length.
        let mut whole = bytes.to_vec();
        whole[..4].copy_from_slice(&event_kind::ALLOC_WITH_STACK.to_ne_bytes());
        assert_eq!(decode(&whole), None);
    }
}
