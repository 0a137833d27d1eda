//! What the eBPF program reads of a CPython interpreter to walk the Python
//! frames of a sampled thread, and what it sends of them.
//!
//! The walk finds the thread's `PyThreadState` in the interpreter's list of
//! them by its `native_thread_id` (it stays in the list, and its frames stay
//! valid, while the thread runs native code with the GIL released, as
//! numpy and pyarrow do around big allocations), then follows each
//! `_PyInterpreterFrame` to the one that called it.

/// Deepest Python stack sent with a sample, in frames.
pub const MAX_PYTHON_FRAMES: usize = 48;

/// Most thread states looked at for a sampled thread's own.
pub const MAX_PYTHON_THREADS: usize = 64;

/// Byte offsets (x86-64) of what the walk reads, for one CPython version.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PythonOffsets {
    /// `_PyRuntimeState.interpreters.head`: the main interpreter.
    pub interpreters_head: u32,
    /// `PyInterpreterState.threads.head`.
    pub threads_head: u32,
    /// `PyThreadState.next`.
    pub thread_next: u32,
    /// `PyThreadState.native_thread_id`: the thread's tid.
    pub native_thread_id: u32,
    /// `PyThreadState.cframe` (3.11, 3.12): the frame is read through it;
    /// [`NO_CFRAME`] where the thread state holds it (3.13).
    pub cframe: u32,
    /// `_PyCFrame.current_frame`, or `PyThreadState.current_frame`.
    pub current_frame: u32,
    /// `_PyInterpreterFrame.f_code` (`f_executable` in 3.13, tagged in
    /// 3.14: see [`FRAME_CODE_TAG_BITS`]).
    pub frame_code: u32,
    /// `_PyInterpreterFrame.previous`: the caller's frame.
    pub frame_previous: u32,
    /// `_PyInterpreterFrame.prev_instr` (`instr_ptr` in 3.13): the
    /// instruction running.
    pub frame_instr: u32,
    /// The byte that tells where a native `_PyEval_EvalFrameDefault` call
    /// started: `is_entry` (3.11), or `owner` (3.13), which is
    /// `FRAME_OWNED_BY_CSTACK` for the call's own entry frame.
    pub frame_marker: u32,
    /// `PyCodeObject.co_firstlineno`: sent with each frame, so that a code
    /// object freed and another made at its address is noticed.
    pub code_first_line: u32,
    pub _pad: u32,
}

/// [`PythonOffsets::cframe`] where the thread state holds its frame.
pub const NO_CFRAME: u32 = u32::MAX;

/// The low bits of a frame's code reference that are tags, not address:
/// 3.14 holds it as a `_PyStackRef`, whose `Py_TAG_BITS` mark how it is
/// counted. Earlier versions hold a plain pointer, aligned, whose low bits
/// are clear anyway.
pub const FRAME_CODE_TAG_BITS: u64 = 0b11;

/// A process whose samples carry their Python frames.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PythonProcess {
    /// Where `_PyRuntime` is in the process.
    pub runtime: u64,
    pub offsets: PythonOffsets,
}

/// One Python frame of a sampled thread.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PythonFrame {
    /// The `PyCodeObject` it runs.
    pub code: u64,
    /// The instruction it runs (an address inside the code object).
    pub instr: u64,
    /// The code object's `co_firstlineno` as read with the frame.
    pub first_line: u32,
    /// Its [`PythonOffsets::frame_marker`] byte.
    pub marker: u32,
}

/// The Python frames of a sampled call's thread, innermost first, sent
/// just before the call's own record (kind `PythonStack`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct PythonStackEvent {
    pub header: crate::EventHeader,
    /// How many of `frames` were read.
    pub count: u64,
    pub frames: [PythonFrame; MAX_PYTHON_FRAMES],
}

/// CPython 3.11's offsets, as its headers give them (the test suite checks
/// them against the installed `Include/internal` headers).
pub const PYTHON_3_11: PythonOffsets = PythonOffsets {
    interpreters_head: 40,
    threads_head: 16,
    thread_next: 8,
    native_thread_id: 160,
    cframe: 56,
    current_frame: 8,
    frame_code: 32,
    frame_previous: 48,
    frame_instr: 56,
    frame_marker: 68,
    code_first_line: 72,
    _pad: 0,
};

/// Byte offsets of what userspace reads of a code object and the strings
/// and bytes it points at, for one CPython version.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PythonCodeLayout {
    /// `PyCodeObject.co_filename`, `co_qualname`, `co_linetable`.
    pub filename: u32,
    pub qualname: u32,
    pub linetable: u32,
    /// `PyCodeObject.co_code_adaptive`: the first instruction.
    pub first_instr: u32,
    /// `PyVarObject.ob_size` and `PyBytesObject.ob_sval`.
    pub bytes_size: u32,
    pub bytes_data: u32,
    /// `PyASCIIObject.length` and `.state`.
    pub string_length: u32,
    pub string_state: u32,
    /// Where a compact string's characters start: `sizeof(PyASCIIObject)`
    /// for ASCII, `sizeof(PyCompactUnicodeObject)` otherwise.
    pub ascii_data: u32,
    pub compact_data: u32,
}

/// CPython 3.11's code object layout.
pub const PYTHON_3_11_CODE: PythonCodeLayout = PythonCodeLayout {
    filename: 112,
    qualname: 128,
    linetable: 136,
    first_instr: 184,
    bytes_size: 16,
    bytes_data: 32,
    string_length: 16,
    string_state: 32,
    ascii_data: 48,
    compact_data: 72,
};
