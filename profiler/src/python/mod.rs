//! Python lines above the native frames of a CPython process's sampled
//! allocations: the kernel walks the thread's Python frames with each
//! sample ([`profiler_common::python`]); here each is named from its code
//! object (read from the target's memory, never written), given an
//! address of its own, and spliced in above the native eval-loop call that
//! ran it.
pub mod code;
mod debug_offsets;
pub mod runtime;
mod splice;

use std::collections::HashMap;

use profiler_common::python::PythonFrame;
pub use runtime::PythonRuntime;

use crate::{
    proc::ProcessMemory,
    profile::{Drops, PythonFrameName},
    python::{code::Code, runtime::Markers, splice::splice},
};

/// The CPython versions whose frames memprobe reads, as messages name them.
pub const VERSIONS_READ: &str = "3.11, 3.13, 3.14 and 3.15";

/// Where the addresses that stand for Python frames start: in the kernel's
/// half of the address space, where no user frame can be.
const FRAME_ADDRESSES: u64 = 0xffff_f000_0000_0000;

/// Code objects kept read per process; past this the cache starts over.
const MOST_CODES: usize = 65_536;

/// Threads with frames held for their next sample; past this the table
/// starts over (a held entry is one sample's frames at most).
const MOST_HELD: usize = 4096;

/// Distinct Python frames (function, file, line) named per process; past
/// this, samples keep their native frames alone, counted.
const MOST_FRAMES: usize = 200_000;

/// One CPython process's Python frames.
pub struct ProcessPython {
    pub runtime: PythonRuntime,
    memory: Option<ProcessMemory>,
    /// Code objects read, by address.
    codes: HashMap<u64, Code>,
    /// Each frame named, by its index: its address is derived from it.
    names: Vec<PythonFrameName>,
    ids: HashMap<PythonFrameName, u64>,
    /// Per thread, the Python frames the kernel sent for its next sample,
    /// and that sample's stamp (its record may have been lost).
    pending: HashMap<u32, (u64, Vec<PythonFrame>)>,
}

impl ProcessPython {
    pub fn new(pid: u32, runtime: PythonRuntime) -> Self {
        Self {
            runtime,
            memory: ProcessMemory::open(pid),
            codes: HashMap::new(),
            names: Vec::new(),
            ids: HashMap::new(),
            pending: HashMap::new(),
        }
    }

    /// Keeps the frames the kernel sent for `tid`'s sample stamped `stamp`.
    pub fn hold(&mut self, tid: u32, stamp: u64, frames: Vec<PythonFrame>) {
        // Held frames whose sample was lost stay until their thread's next
        // sample; threads that exited since would leave theirs for good.
        if self.pending.len() >= MOST_HELD {
            self.pending.clear();
        }
        self.pending.insert(tid, (stamp, frames));
    }

    /// Adds the Python frames held for `tid`'s sample stamped `stamp` to
    /// its native `frames` (return addresses, leaf first); counts in
    /// `drops` a sample left native.
    pub fn complete(&mut self, (tid, stamp): (u32, u64), frames: &mut Vec<u64>, drops: &mut Drops) {
        let Some((held, python)) = self.pending.remove(&tid) else {
            return;
        };
        if held != stamp {
            return;
        }
        let markers = self.runtime.markers;
        let mut named: Vec<(u64, bool)> = Vec::with_capacity(python.len());
        for frame in &python {
            if markers == Markers::CStackOwner && frame.marker == Markers::OWNED_BY_CSTACK {
                // A call's own entry frame: the run above it ends there.
                if let Some(last) = named.last_mut() {
                    last.1 = true;
                }
                continue;
            }
            let Some(address) = self.address_of(frame) else {
                drops.python_frames_dropped += 1;
                return;
            };
            let ends_run = markers == Markers::EntryFlag && frame.marker != 0;
            named.push((address, ends_run));
        }
        *frames = splice(frames, &named, |f| {
            self.runtime.eval.contains(f.wrapping_sub(1))
        });
    }

    /// What a profile says of the interpreter: its version and file, and
    /// whether its frames were read.
    pub fn note(&self) -> String {
        let runtime = &self.runtime;
        let read = if runtime.layout.is_some() {
            "frames read".to_owned()
        } else {
            format!("frames not read (memprobe reads {VERSIONS_READ})")
        };
        format!("{} ({}), {read}", runtime.version, runtime.path)
    }

    /// The names of the Python frames among `frames` (return addresses),
    /// keyed as looked up: return address - 1.
    pub fn names_in<'a>(
        &self,
        frames: impl Iterator<Item = &'a u64>,
    ) -> Vec<(u64, PythonFrameName)> {
        let mut names: Vec<(u64, PythonFrameName)> = frames
            .filter_map(|&f| {
                let index = f.checked_sub(FRAME_ADDRESSES + 1)? / 16;
                Some((f - 1, self.names.get(usize::try_from(index).ok()?)?.clone()))
            })
            .collect();
        names.sort();
        names.dedup();
        names
    }

    /// The address that stands for `frame`'s function and line, as a
    /// return address.
    fn address_of(&mut self, frame: &PythonFrame) -> Option<u64> {
        let layout = self.runtime.layout?.code;
        let cached = self.codes.get(&frame.code);
        if cached.is_none_or(|c| c.first_line != frame.first_line) {
            if self.codes.len() >= MOST_CODES {
                self.codes.clear();
            }
            let code = self
                .memory
                .as_ref()
                .and_then(|memory| Code::read(memory, &layout, frame.code, frame.first_line))
                .unwrap_or_else(|| Code::unreadable(frame.first_line));
            self.codes.insert(frame.code, code);
        }
        let code = self.codes.get(&frame.code)?;
        let first_instr = frame.code + u64::from(layout.first_instr);
        let line = code.line(frame.instr.saturating_sub(first_instr) / 2);
        let name = PythonFrameName {
            function: code.qualname.clone(),
            file: code.filename.clone(),
            line,
        };
        let index = match self.ids.get(&name) {
            Some(&index) => index,
            None if self.names.len() >= MOST_FRAMES => return None,
            None => {
                let index = self.names.len() as u64;
                self.names.push(name.clone());
                self.ids.insert(name, index);
                index
            }
        };
        Some(FRAME_ADDRESSES + index * 16 + 1)
    }
}
