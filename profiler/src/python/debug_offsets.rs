//! CPython's `_Py_DebugOffsets` (3.13 and later): the table at the start
//! of `_PyRuntime` that gives the offset of every field an outside reader
//! needs (`Include/internal/pycore_debug_offsets.h`). It is static data,
//! so it is read from the file, not from the process.
//!
//! The table's own layout changes between versions (3.14 and 3.15 added
//! fields to several of its groups, moving the rest): the positions of the groups
//! memprobe reads are given per version below, and nothing is taken that
//! fails a check of its cookie, version and sizes.
use profiler_common::python::{NO_CFRAME, PythonCodeLayout, PythonOffsets};

/// Where each needed field of one version's table is, in bytes from its
/// start.
struct Positions {
    /// `PY_VERSION_HEX >> 16` of the version laid out so: 0x030d for 3.13.
    version: u32,
    interpreters_head: usize,
    interpreter_size: usize,
    threads_head: usize,
    thread_size: usize,
    thread_next: usize,
    current_frame: usize,
    native_thread_id: usize,
    frame_size: usize,
    frame_previous: usize,
    frame_executable: usize,
    frame_instr: usize,
    frame_owner: usize,
    code_size: usize,
    code_filename: usize,
    code_qualname: usize,
    code_linetable: usize,
    code_first_line: usize,
    code_first_instr: usize,
    bytes_size: usize,
    bytes_data: usize,
    string_state: usize,
    string_length: usize,
    ascii_size: usize,
    /// The table's length.
    end: usize,
}

/// Fields every version keeps in place.
mod at {
    pub const COOKIE: usize = 0;
    pub const VERSION: usize = 8;
    pub const FREE_THREADED: usize = 16;
}

const PYTHON_3_13: Positions = Positions {
    version: 0x030d,
    interpreters_head: 40,
    interpreter_size: 48,
    threads_head: 72,
    thread_size: 152,
    thread_next: 168,
    current_frame: 184,
    native_thread_id: 200,
    frame_size: 224,
    frame_previous: 232,
    frame_executable: 240,
    frame_instr: 248,
    frame_owner: 264,
    code_size: 272,
    code_filename: 280,
    code_qualname: 296,
    code_linetable: 304,
    code_first_line: 312,
    code_first_instr: 344,
    bytes_size: 520,
    bytes_data: 528,
    string_state: 544,
    string_length: 552,
    ascii_size: 560,
    end: 584,
};

/// 3.14's: its interpreter group grew by three fields, the frame group by
/// two (`stackpointer`, `tlbc_index`), the code group by one (`co_tlbc`),
/// and a set group came before the dict one.
const PYTHON_3_14: Positions = Positions {
    version: 0x030e,
    interpreters_head: 40,
    interpreter_size: 48,
    threads_head: 72,
    thread_size: 176,
    thread_next: 192,
    current_frame: 208,
    native_thread_id: 224,
    frame_size: 248,
    frame_previous: 256,
    frame_executable: 264,
    frame_instr: 272,
    frame_owner: 288,
    code_size: 312,
    code_filename: 320,
    code_qualname: 336,
    code_linetable: 344,
    code_first_line: 352,
    code_first_instr: 384,
    bytes_size: 600,
    bytes_data: 608,
    string_state: 624,
    string_length: 632,
    ascii_size: 640,
    end: 760,
};

/// 3.15's: its thread group grew by seven fields (three of them before
/// `native_thread_id`), an exception group came before the frame group,
/// and the type group grew and a heap type group came before the bytes
/// group.
const PYTHON_3_15: Positions = Positions {
    version: 0x030f,
    interpreters_head: 40,
    interpreter_size: 48,
    threads_head: 72,
    thread_size: 176,
    thread_next: 192,
    current_frame: 208,
    native_thread_id: 248,
    frame_size: 312,
    frame_previous: 320,
    frame_executable: 328,
    frame_instr: 336,
    frame_owner: 352,
    code_size: 376,
    code_filename: 384,
    code_qualname: 400,
    code_linetable: 408,
    code_first_line: 416,
    code_first_instr: 448,
    bytes_size: 696,
    bytes_data: 704,
    string_state: 720,
    string_length: 728,
    ascii_size: 736,
    end: 888,
};

const COOKIE: &[u8; 8] = b"xdebugpy";

/// The offsets in `table` (the bytes at `_PyRuntime`) for a 3.13, 3.14 or
/// 3.15 interpreter; `None` where it is none of them, or is built
/// free-threaded (its frames are laid out otherwise).
pub fn read(table: &[u8]) -> Option<(PythonOffsets, PythonCodeLayout)> {
    if table.get(at::COOKIE..at::COOKIE + 8)? != COOKIE || word_in(table, at::FREE_THREADED)? != 0 {
        return None;
    }
    let version = word_in(table, at::VERSION)? >> 16;
    let pos = [PYTHON_3_13, PYTHON_3_14, PYTHON_3_15]
        .into_iter()
        .find(|p| p.version == version)?;
    let table = table.get(..pos.end)?;
    let word = |at: usize| word_in(table, at);
    // Each field lies inside its struct, whose size the table gives too.
    let within = |size: usize, fields: &[usize]| {
        let size = word(size)?;
        fields
            .iter()
            .map(|&at| word(at).filter(|&offset| offset + 8 <= size))
            .collect::<Option<Vec<u32>>>()
    };
    let thread = within(
        pos.thread_size,
        &[pos.thread_next, pos.current_frame, pos.native_thread_id],
    )?;
    let frame = within(
        pos.frame_size,
        &[
            pos.frame_previous,
            pos.frame_executable,
            pos.frame_instr,
            pos.frame_owner,
        ],
    )?;
    let code = within(
        pos.code_size,
        &[
            pos.code_filename,
            pos.code_qualname,
            pos.code_linetable,
            pos.code_first_line,
        ],
    )?;
    let threads_head = within(pos.interpreter_size, &[pos.threads_head])?[0];
    let offsets = PythonOffsets {
        interpreters_head: word(pos.interpreters_head)?,
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
    let ascii_data = word(pos.ascii_size)?;
    let layout = PythonCodeLayout {
        filename: code[0],
        qualname: code[1],
        linetable: code[2],
        first_instr: word(pos.code_first_instr)?,
        bytes_size: word(pos.bytes_size)?,
        bytes_data: word(pos.bytes_data)?,
        string_length: word(pos.string_length)?,
        string_state: word(pos.string_state)?,
        ascii_data,
        // PyCompactUnicodeObject: the ASCII head, then utf8_length and utf8.
        compact_data: ascii_data + 16,
    };
    Some((offsets, layout))
}

/// The table's 64-bit field at `at`, where it fits 32 bits (every offset
/// and size memprobe reads does).
fn word_in(table: &[u8], at: usize) -> Option<u32> {
    let bytes: [u8; 8] = table.get(at..at + 8)?.try_into().ok()?;
    u32::try_from(u64::from_le_bytes(bytes)).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What one interpreter's table holds at each field memprobe reads.
    struct Filled {
        version: u64,
        interpreters_head: u64,
        interpreter_size: u64,
        threads_head: u64,
        thread_size: u64,
        thread_next: u64,
        current_frame: u64,
        native_thread_id: u64,
        frame_size: u64,
        frame_previous: u64,
        frame_executable: u64,
        frame_instr: u64,
        frame_owner: u64,
        code_size: u64,
        code_filename: u64,
        code_qualname: u64,
        code_linetable: u64,
        code_first_line: u64,
        code_first_instr: u64,
        bytes_size: u64,
        bytes_data: u64,
        string_state: u64,
        string_length: u64,
        ascii_size: u64,
    }

    /// As 3.13.5 fills it (the values its headers give; those it leaves
    /// at 0 are not checked).
    const FILLED_3_13: Filled = Filled {
        version: 0x030d_05f0,
        interpreters_head: 40,
        interpreter_size: 8000,
        threads_head: 7272,
        thread_size: 500,
        thread_next: 8,
        current_frame: 72,
        native_thread_id: 160,
        frame_size: 80,
        frame_previous: 8,
        frame_executable: 0,
        frame_instr: 56,
        frame_owner: 70,
        code_size: 200,
        code_filename: 112,
        code_qualname: 128,
        code_linetable: 136,
        code_first_line: 68,
        code_first_instr: 200,
        bytes_size: 0,
        bytes_data: 32,
        string_state: 0,
        string_length: 0,
        ascii_size: 40,
    };

    /// As Debian's 3.14.8 fills it (read from its `_PyRuntime`).
    const FILLED_3_14: Filled = Filled {
        version: 0x030e_08f0,
        interpreters_head: 808,
        interpreter_size: 225_864,
        threads_head: 7344,
        thread_size: 832,
        thread_next: 8,
        current_frame: 72,
        native_thread_id: 160,
        frame_size: 88,
        frame_previous: 8,
        frame_executable: 0,
        frame_instr: 56,
        frame_owner: 74,
        code_size: 216,
        code_filename: 112,
        code_qualname: 128,
        code_linetable: 136,
        code_first_line: 68,
        code_first_instr: 208,
        bytes_size: 16,
        bytes_data: 32,
        string_state: 32,
        string_length: 16,
        ascii_size: 40,
    };

    /// As sid's 3.15.2 fills it (read from its `_PyRuntime`): where it
    /// differs from 3.14.8.
    const FILLED_3_15: Filled = Filled {
        version: 0x030f_02f0,
        interpreters_head: 936,
        interpreter_size: 226_240,
        threads_head: 7336,
        thread_size: 888,
        native_thread_id: 184,
        ..FILLED_3_14
    };

    /// A table laid out at `pos`, holding `v`.
    fn table(pos: &Positions, v: &Filled) -> Vec<u8> {
        let mut table = vec![0u8; pos.end];
        let mut put =
            |at: usize, value: u64| table[at..at + 8].copy_from_slice(&value.to_le_bytes());
        put(at::VERSION, v.version);
        for (at, value) in [
            (pos.interpreters_head, v.interpreters_head),
            (pos.interpreter_size, v.interpreter_size),
            (pos.threads_head, v.threads_head),
            (pos.thread_size, v.thread_size),
            (pos.thread_next, v.thread_next),
            (pos.current_frame, v.current_frame),
            (pos.native_thread_id, v.native_thread_id),
            (pos.frame_size, v.frame_size),
            (pos.frame_previous, v.frame_previous),
            (pos.frame_executable, v.frame_executable),
            (pos.frame_instr, v.frame_instr),
            (pos.frame_owner, v.frame_owner),
            (pos.code_size, v.code_size),
            (pos.code_filename, v.code_filename),
            (pos.code_qualname, v.code_qualname),
            (pos.code_linetable, v.code_linetable),
            (pos.code_first_line, v.code_first_line),
            (pos.code_first_instr, v.code_first_instr),
            (pos.bytes_size, v.bytes_size),
            (pos.bytes_data, v.bytes_data),
            (pos.string_state, v.string_state),
            (pos.string_length, v.string_length),
            (pos.ascii_size, v.ascii_size),
        ] {
            put(at, value);
        }
        table[..8].copy_from_slice(COOKIE);
        table
    }

    fn table_3_13() -> Vec<u8> {
        table(&PYTHON_3_13, &FILLED_3_13)
    }

    fn table_3_14() -> Vec<u8> {
        table(&PYTHON_3_14, &FILLED_3_14)
    }

    fn table_3_15() -> Vec<u8> {
        table(&PYTHON_3_15, &FILLED_3_15)
    }

    #[test]
    fn a_3_13_table_gives_every_offset() {
        let (offsets, layout) = read(&table_3_13()).unwrap();
        assert_eq!(offsets.current_frame, 72);
        assert_eq!(offsets.cframe, NO_CFRAME);
        assert_eq!(offsets.frame_marker, 70);
        assert_eq!((layout.qualname, layout.compact_data), (128, 56));
    }

    #[test]
    fn a_3_14_table_is_read_where_its_groups_moved() {
        let (offsets, layout) = read(&table_3_14()).unwrap();
        assert_eq!(offsets.interpreters_head, 808);
        assert_eq!(offsets.threads_head, 7344);
        assert_eq!(offsets.native_thread_id, 160);
        assert_eq!(offsets.frame_marker, 74);
        assert_eq!(layout.first_instr, 208);
        assert_eq!((layout.string_state, layout.string_length), (32, 16));
    }

    #[test]
    fn a_3_15_table_is_read_where_its_groups_moved() {
        let (offsets, layout) = read(&table_3_15()).unwrap();
        assert_eq!(offsets.interpreters_head, 936);
        assert_eq!(offsets.native_thread_id, 184);
        assert_eq!(offsets.frame_marker, 74);
        assert_eq!((layout.qualname, layout.first_instr), (128, 208));
    }

    #[test]
    fn anything_else_is_refused() {
        let mut wrong_cookie = table_3_13();
        wrong_cookie[0] = b'y';
        let mut later = table_3_15();
        later[at::VERSION + 2] = 0x10;
        let mut free_threaded = table_3_14();
        free_threaded[at::FREE_THREADED] = 1;
        // A field past its struct's size: the layout is not the one read.
        let mut shifted = table_3_13();
        shifted[PYTHON_3_13.frame_size] = 40;
        for table in [
            wrong_cookie,
            later,
            free_threaded,
            shifted,
            table_3_13()[..100].to_vec(),
            table_3_14()[..PYTHON_3_13.end].to_vec(),
            table_3_15()[..PYTHON_3_14.end].to_vec(),
        ] {
            assert_eq!(read(&table), None);
        }
    }
}
