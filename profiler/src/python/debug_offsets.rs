//! CPython 3.13's `_Py_DebugOffsets`: the table at the start of
//! `_PyRuntime` that gives the offset of every field an outside reader
//! needs (`Include/internal/pycore_runtime.h`). It is static data, so it
//! is read from the file, not from the process.
//!
//! Where its groups start moved in 3.14; this reads 3.13's, and takes
//! nothing that fails a check of its cookie, version and sizes.
use profiler_common::python::{NO_CFRAME, PythonCodeLayout, PythonOffsets};

/// Where each needed field of the table is, in bytes from its start.
mod at {
    pub const COOKIE: usize = 0;
    pub const VERSION: usize = 8;
    pub const FREE_THREADED: usize = 16;
    pub const INTERPRETERS_HEAD: usize = 40;
    pub const INTERPRETER_SIZE: usize = 48;
    pub const THREADS_HEAD: usize = 72;
    pub const THREAD_SIZE: usize = 152;
    pub const THREAD_NEXT: usize = 168;
    pub const CURRENT_FRAME: usize = 184;
    pub const NATIVE_THREAD_ID: usize = 200;
    pub const FRAME_SIZE: usize = 224;
    pub const FRAME_PREVIOUS: usize = 232;
    pub const FRAME_EXECUTABLE: usize = 240;
    pub const FRAME_INSTR: usize = 248;
    pub const FRAME_OWNER: usize = 264;
    pub const CODE_SIZE: usize = 272;
    pub const CODE_FILENAME: usize = 280;
    pub const CODE_QUALNAME: usize = 296;
    pub const CODE_LINETABLE: usize = 304;
    pub const CODE_FIRST_LINE: usize = 312;
    pub const CODE_FIRST_INSTR: usize = 344;
    pub const BYTES_SIZE: usize = 520;
    pub const BYTES_DATA: usize = 528;
    pub const STRING_STATE: usize = 544;
    pub const STRING_LENGTH: usize = 552;
    pub const ASCII_SIZE: usize = 560;
    /// The table's length.
    pub const END: usize = 584;
}

const COOKIE: &[u8; 8] = b"xdebugpy";

/// The offsets in `table` (the bytes at `_PyRuntime`) for a 3.13
/// interpreter; `None` where it is not one, or is built free-threaded
/// (its frames are laid out otherwise).
pub fn read(table: &[u8]) -> Option<(PythonOffsets, PythonCodeLayout)> {
    let table = table.get(..at::END)?;
    let word = |at: usize| {
        let bytes: [u8; 8] = table[at..at + 8].try_into().ok()?;
        u32::try_from(u64::from_le_bytes(bytes)).ok()
    };
    let version = word(at::VERSION)?;
    if &table[at::COOKIE..at::COOKIE + 8] != COOKIE
        || version >> 16 != 0x030d
        || word(at::FREE_THREADED)? != 0
    {
        return None;
    }
    // Each field lies inside its struct, whose size the table gives too.
    let within = |size: usize, fields: &[usize]| {
        let size = word(size)?;
        fields
            .iter()
            .map(|&at| word(at).filter(|&offset| offset + 8 <= size))
            .collect::<Option<Vec<u32>>>()
    };
    let thread = within(
        at::THREAD_SIZE,
        &[at::THREAD_NEXT, at::CURRENT_FRAME, at::NATIVE_THREAD_ID],
    )?;
    let frame = within(
        at::FRAME_SIZE,
        &[
            at::FRAME_PREVIOUS,
            at::FRAME_EXECUTABLE,
            at::FRAME_INSTR,
            at::FRAME_OWNER,
        ],
    )?;
    let code = within(
        at::CODE_SIZE,
        &[
            at::CODE_FILENAME,
            at::CODE_QUALNAME,
            at::CODE_LINETABLE,
            at::CODE_FIRST_LINE,
        ],
    )?;
    let threads_head = within(at::INTERPRETER_SIZE, &[at::THREADS_HEAD])?[0];
    let offsets = PythonOffsets {
        interpreters_head: word(at::INTERPRETERS_HEAD)?,
        threads_head,
        thread_next: thread[0],
        native_thread_id: thread[2],
        cframe: NO_CFRAME,
        current_frame: thread[1],
        frame_code: frame[1],
        frame_previous: frame[0],
        frame_instr: frame[2],
        frame_marker: frame[3],
        code_first_line: code[3],
        _pad: 0,
    };
    let ascii_data = word(at::ASCII_SIZE)?;
    let layout = PythonCodeLayout {
        filename: code[0],
        qualname: code[1],
        linetable: code[2],
        first_instr: word(at::CODE_FIRST_INSTR)?,
        bytes_size: word(at::BYTES_SIZE)?,
        bytes_data: word(at::BYTES_DATA)?,
        string_length: word(at::STRING_LENGTH)?,
        string_state: word(at::STRING_STATE)?,
        ascii_data,
        // PyCompactUnicodeObject: the ASCII head, then utf8_length and utf8.
        compact_data: ascii_data + 16,
    };
    Some((offsets, layout))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A table as 3.13.5 fills it (the values its headers give).
    fn table() -> Vec<u8> {
        let mut table = vec![0u8; at::END];
        let mut put =
            |at: usize, value: u64| table[at..at + 8].copy_from_slice(&value.to_le_bytes());
        put(at::VERSION, 0x030d_05f0);
        for (at, value) in [
            (at::INTERPRETERS_HEAD, 40),
            (at::INTERPRETER_SIZE, 8000),
            (at::THREADS_HEAD, 7272),
            (at::THREAD_SIZE, 500),
            (at::THREAD_NEXT, 8),
            (at::CURRENT_FRAME, 72),
            (at::NATIVE_THREAD_ID, 160),
            (at::FRAME_SIZE, 80),
            (at::FRAME_PREVIOUS, 8),
            (at::FRAME_EXECUTABLE, 0),
            (at::FRAME_INSTR, 56),
            (at::FRAME_OWNER, 70),
            (at::CODE_SIZE, 200),
            (at::CODE_FILENAME, 112),
            (at::CODE_QUALNAME, 128),
            (at::CODE_LINETABLE, 136),
            (at::CODE_FIRST_LINE, 68),
            (at::CODE_FIRST_INSTR, 200),
            (at::BYTES_DATA, 32),
            (at::ASCII_SIZE, 40),
        ] {
            put(at, value);
        }
        table[..8].copy_from_slice(COOKIE);
        table
    }

    #[test]
    fn a_3_13_table_gives_every_offset() {
        let (offsets, layout) = read(&table()).unwrap();
        assert_eq!(offsets.current_frame, 72);
        assert_eq!(offsets.cframe, NO_CFRAME);
        assert_eq!(offsets.frame_marker, 70);
        assert_eq!((layout.qualname, layout.compact_data), (128, 56));
    }

    #[test]
    fn anything_else_is_refused() {
        let mut wrong_cookie = table();
        wrong_cookie[0] = b'y';
        let mut later = table();
        later[at::VERSION + 2] = 0x0e;
        let mut free_threaded = table();
        free_threaded[at::FREE_THREADED] = 1;
        // A field past its struct's size: the layout is not the one read.
        let mut shifted = table();
        shifted[at::FRAME_SIZE] = 40;
        for table in [
            wrong_cookie,
            later,
            free_threaded,
            shifted,
            table()[..100].to_vec(),
        ] {
            assert_eq!(read(&table), None);
        }
    }
}
