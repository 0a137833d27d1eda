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

    /// A table laid out at `pos`, with `values` at their fields.
    fn table(pos: &Positions, version: u64, values: &[(usize, u64)]) -> Vec<u8> {
        let mut table = vec![0u8; pos.end];
        let mut put =
            |at: usize, value: u64| table[at..at + 8].copy_from_slice(&value.to_le_bytes());
        put(at::VERSION, version);
        for &(at, value) in values {
            put(at, value);
        }
        table[..8].copy_from_slice(COOKIE);
        table
    }

    /// A table as 3.13.5 fills it (the values its headers give).
    fn table_3_13() -> Vec<u8> {
        let p = &PYTHON_3_13;
        let values = [
            (p.interpreters_head, 40),
            (p.interpreter_size, 8000),
            (p.threads_head, 7272),
            (p.thread_size, 500),
            (p.thread_next, 8),
            (p.current_frame, 72),
            (p.native_thread_id, 160),
            (p.frame_size, 80),
            (p.frame_previous, 8),
            (p.frame_executable, 0),
            (p.frame_instr, 56),
            (p.frame_owner, 70),
            (p.code_size, 200),
            (p.code_filename, 112),
            (p.code_qualname, 128),
            (p.code_linetable, 136),
            (p.code_first_line, 68),
            (p.code_first_instr, 200),
            (p.bytes_data, 32),
            (p.ascii_size, 40),
        ];
        table(p, 0x030d_05f0, &values)
    }

    /// A table as Debian's 3.14.8 fills it (read from its `_PyRuntime`).
    fn table_3_14() -> Vec<u8> {
        let p = &PYTHON_3_14;
        let values = [
            (p.interpreters_head, 808),
            (p.interpreter_size, 225_864),
            (p.threads_head, 7344),
            (p.thread_size, 832),
            (p.thread_next, 8),
            (p.current_frame, 72),
            (p.native_thread_id, 160),
            (p.frame_size, 88),
            (p.frame_previous, 8),
            (p.frame_executable, 0),
            (p.frame_instr, 56),
            (p.frame_owner, 74),
            (p.code_size, 216),
            (p.code_filename, 112),
            (p.code_qualname, 128),
            (p.code_linetable, 136),
            (p.code_first_line, 68),
            (p.code_first_instr, 208),
            (p.bytes_size, 16),
            (p.bytes_data, 32),
            (p.string_state, 32),
            (p.string_length, 16),
            (p.ascii_size, 40),
        ];
        table(p, 0x030e_08f0, &values)
    }

    /// A table as sid's 3.15.2 fills it (read from its `_PyRuntime`).
    fn table_3_15() -> Vec<u8> {
        let p = &PYTHON_3_15;
        let values = [
            (p.interpreters_head, 936),
            (p.interpreter_size, 226_240),
            (p.threads_head, 7336),
            (p.thread_size, 888),
            (p.thread_next, 8),
            (p.current_frame, 72),
            (p.native_thread_id, 184),
            (p.frame_size, 88),
            (p.frame_previous, 8),
            (p.frame_executable, 0),
            (p.frame_instr, 56),
            (p.frame_owner, 74),
            (p.code_size, 216),
            (p.code_filename, 112),
            (p.code_qualname, 128),
            (p.code_linetable, 136),
            (p.code_first_line, 68),
            (p.code_first_instr, 208),
            (p.bytes_size, 16),
            (p.bytes_data, 32),
            (p.string_state, 32),
            (p.string_length, 16),
            (p.ascii_size, 40),
        ];
        table(p, 0x030f_02f0, &values)
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
