//! The Python frames of a sampled call's thread, for a process running
//! CPython ([`profiler_common::python`]): sent in a record of their own,
//! just before the call's, so that userspace meets them first.
use core::{ffi::c_void, ptr::addr_of_mut};

use aya_ebpf::helpers::generated::bpf_probe_read_user as bpf_probe_read_user_raw;
use profiler_common::{
    Counter, EventKind,
    python::{
        FRAME_CODE_TAG_BITS, MAX_PYTHON_FRAMES, MAX_PYTHON_THREADS, NO_CFRAME, PythonFrame,
        PythonProcess, PythonStackEvent,
    },
};

use crate::{
    maps::{EVENTS, PYTHON_PROCESSES, PYTHON_THREADS},
    ring,
    sampling::{count, header_at},
};

/// Sends the record of the sampled thread's Python frames, where its
/// process runs a CPython memprobe reads, stamped with its call's record's
/// time (sent next, if the ring has room): userspace pairs the two by
/// thread and stamp. A global function: the kernel verifies it once, on
/// its own, not again on every path of every program that samples, which
/// multiplied those programs' verification fivefold (and kernel 6.1's
/// verifier ran out of time).
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn send_python_stack(id: u64, stamp: u64, probe: u32) -> i32 {
    // SAFETY: a lookup in a map of plain values.
    let Some(process) = (unsafe { PYTHON_PROCESSES.get((id >> 32) as u32) }).copied() else {
        return 0;
    };
    let Some(frame) = current_frame(id, &process) else {
        return 0;
    };
    let Some(mut entry) = EVENTS.reserve::<PythonStackEvent>(0) else {
        count(Counter::PythonStacksLost);
        return 0;
    };
    let event = entry.as_mut_ptr();
    // SAFETY: `event` points at reserved ring-buffer memory for a
    // `PythonStackEvent`, written in place: too big for the BPF stack.
    unsafe {
        addr_of_mut!((*event).header).write(header_at(EventKind::PythonStack, id, probe, stamp));
        let frames = addr_of_mut!((*event).frames) as *mut PythonFrame;
        let walked = walk(frame, &process, frames);
        addr_of_mut!((*event).count).write(walked);
    }
    ring::submit(entry);
    1
}

/// Reads a word of the target, 0 where it cannot be read. No branch on
/// the helper's result: each would double the states the verifier walks
/// through every frame of the loop (kernel 6.1 gave up).
#[inline(always)]
fn read_or_zero(address: u64) -> u64 {
    let mut word = 0u64;
    // SAFETY: the helper faults safely on any address, and writes 8 bytes
    // (zeros on a fault) into `word`.
    unsafe {
        bpf_probe_read_user_raw(
            (&mut word as *mut u64).cast::<c_void>(),
            8,
            address as *const c_void,
        )
    };
    word
}

/// The thread's innermost Python frame.
#[inline(always)]
fn current_frame(id: u64, process: &PythonProcess) -> Option<u64> {
    let offsets = &process.offsets;
    let tstate = thread_state(id, process)?;
    let holder = if offsets.cframe == NO_CFRAME {
        tstate
    } else {
        read_or_zero(tstate + offsets.cframe as u64)
    };
    let frame = read_or_zero(holder + offsets.current_frame as u64);
    (frame != 0).then_some(frame)
}

/// The thread's `PyThreadState`: as found last time if it still names the
/// thread, else looked for in the interpreter's list.
#[inline(always)]
fn thread_state(id: u64, process: &PythonProcess) -> Option<u64> {
    let offsets = &process.offsets;
    let tid = id as u32;
    let names_thread =
        |tstate: u64| read_or_zero(tstate + offsets.native_thread_id as u64) as u32 == tid;
    // SAFETY: a lookup in a map of plain values.
    if let Some(&tstate) = unsafe { PYTHON_THREADS.get(id) }
        && names_thread(tstate)
    {
        return Some(tstate);
    }
    let interpreter = read_or_zero(process.runtime + offsets.interpreters_head as u64);
    let mut tstate = read_or_zero(interpreter + offsets.threads_head as u64);
    for _ in 0..MAX_PYTHON_THREADS {
        if tstate == 0 {
            return None;
        }
        if names_thread(tstate) {
            let _ = PYTHON_THREADS.insert(id, tstate, 0);
            return Some(tstate);
        }
        tstate = read_or_zero(tstate + offsets.thread_next as u64);
    }
    None
}

/// Writes the frames from `frame` outwards into `frames`; how many.
///
/// # Safety
/// `frames` must point at room for [`MAX_PYTHON_FRAMES`] frames.
#[inline(always)]
unsafe fn walk(mut frame: u64, process: &PythonProcess, frames: *mut PythonFrame) -> u64 {
    let offsets = &process.offsets;
    let mut walked = 0;
    for i in 0..MAX_PYTHON_FRAMES {
        if frame == 0 {
            break;
        }
        let code = read_or_zero(frame + offsets.frame_code as u64) & !FRAME_CODE_TAG_BITS;
        let frame_read = PythonFrame {
            code,
            instr: read_or_zero(frame + offsets.frame_instr as u64),
            first_line: read_or_zero(code + offsets.code_first_line as u64) as u32,
            // The marker's byte, as read: userspace reads it by version.
            marker: (read_or_zero(frame + offsets.frame_marker as u64) & 0xff) as u32,
        };
        // SAFETY: `i` is below the room the caller guarantees.
        unsafe { frames.add(i).write(frame_read) };
        walked = i as u64 + 1;
        frame = read_or_zero(frame + offsets.frame_previous as u64);
    }
    walked
}
