//! Reading a code object out of the target's memory (never writing it): its
//! qualified name, file and line table; and the line an instruction is on.
use profiler_common::python::PythonCodeLayout;

use crate::proc::ProcessMemory;

/// What a code object says of itself.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Code {
    pub qualname: String,
    pub filename: String,
    pub first_line: u32,
    /// `co_linetable`: CPython 3.11's location table.
    linetable: Vec<u8>,
}

/// Longest string or line table read: a name past this is cut, a table past
/// it names lines up to there.
const MOST_BYTES: usize = 64 * 1024;

impl Code {
    /// Reads the code object at `address`; `None` where its memory cannot
    /// be read.
    pub fn read(
        memory: &ProcessMemory,
        layout: &PythonCodeLayout,
        address: u64,
        first_line: u32,
    ) -> Option<Self> {
        let pointer = |offset: u32| memory.read_word(address + u64::from(offset));
        Some(Self {
            qualname: read_string(memory, layout, pointer(layout.qualname)?)?,
            filename: read_string(memory, layout, pointer(layout.filename)?)?,
            first_line,
            linetable: read_bytes(memory, layout, pointer(layout.linetable)?)?,
        })
    }

    /// A code object whose memory could not be read (freed as it was
    /// looked at): named as unknown, kept so that it is not read again.
    pub fn unreadable(first_line: u32) -> Self {
        Self {
            qualname: "<unknown>".into(),
            filename: "<unknown>".into(),
            first_line,
            linetable: Vec::new(),
        }
    }

    /// The line of the instruction `index` code units (2 bytes each) into
    /// the code; the first line where the table says none.
    pub fn line(&self, index: u64) -> u32 {
        line_of(&self.linetable, self.first_line, index)
    }
}

/// A `bytes` object's contents.
fn read_bytes(memory: &ProcessMemory, layout: &PythonCodeLayout, object: u64) -> Option<Vec<u8>> {
    let len = memory.read_word(object + u64::from(layout.bytes_size))?;
    let mut bytes = vec![0; (len as usize).min(MOST_BYTES)];
    memory.read(object + u64::from(layout.bytes_data), &mut bytes)?;
    Some(bytes)
}

/// A compact `str` object's text (code objects' names and files are
/// compact: made whole at creation).
fn read_string(memory: &ProcessMemory, layout: &PythonCodeLayout, object: u64) -> Option<String> {
    let len = memory.read_word(object + u64::from(layout.string_length))? as usize;
    let mut state = [0; 4];
    memory.read(object + u64::from(layout.string_state), &mut state)?;
    let state = u32::from_le_bytes(state);
    // interned:2, kind:3, compact:1, ascii:1.
    let (kind, compact, ascii) = (
        (state >> 2) & 7,
        state & (1 << 5) != 0,
        state & (1 << 6) != 0,
    );
    if !compact || !matches!(kind, 1 | 2 | 4) {
        return None;
    }
    let data = if ascii {
        layout.ascii_data
    } else {
        layout.compact_data
    };
    let len = len.min(MOST_BYTES / kind as usize);
    let mut bytes = vec![0; len * kind as usize];
    memory.read(object + u64::from(data), &mut bytes)?;
    let text = match kind {
        1 => bytes.iter().map(|&b| char::from(b)).collect(),
        2 => {
            let units: Vec<u16> = bytes
                .chunks_exact(2)
                .map(|c| u16::from_le_bytes([c[0], c[1]]))
                .collect();
            String::from_utf16_lossy(&units)
        }
        _ => bytes
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .map(|c| char::from_u32(c).unwrap_or(char::REPLACEMENT_CHARACTER))
            .collect(),
    };
    Some(text)
}

/// The line of code unit `index` by a 3.11 location table
/// (`Objects/locations.md` in CPython): entries of a first byte
/// `1CCCCLLL` (code, length - 1 in code units) and then, by code, varints
/// of 6 bits a byte (0x40: more follow) or column bytes.
fn line_of(table: &[u8], first_line: u32, index: u64) -> u32 {
    let mut bytes = table.iter().copied();
    let (mut line, mut at) = (i64::from(first_line), 0u64);
    while let Some(head) = bytes.next() {
        let (code, length) = ((head >> 3) & 15, u64::from(head & 7) + 1);
        line += match code {
            // No location.
            15 => 0,
            // Short forms: the same line, one byte of columns.
            0..=9 => skip(&mut bytes, 1, 0),
            // One-line forms: 0 to 2 lines on, two column bytes.
            10..=12 => skip(&mut bytes, 2, i64::from(code) - 10),
            // No columns (13), or the long form (14): a signed line delta,
            // then the end line and both columns.
            _ => {
                let delta = signed(varint(&mut bytes));
                skip_varints(&mut bytes, if code == 14 { 3 } else { 0 });
                delta
            }
        };
        if index < at + length {
            break;
        }
        at += length;
    }
    u32::try_from(line).unwrap_or(first_line)
}

fn varint(bytes: &mut impl Iterator<Item = u8>) -> u64 {
    let (mut value, mut shift) = (0u64, 0);
    for b in bytes {
        value |= u64::from(b & 63) << shift.min(63);
        shift += 6;
        if b & 64 == 0 {
            break;
        }
    }
    value
}

/// A signed varint: the low bit is the sign.
fn signed(raw: u64) -> i64 {
    let magnitude = (raw >> 1) as i64;
    if raw & 1 == 1 { -magnitude } else { magnitude }
}

fn skip_varints(bytes: &mut impl Iterator<Item = u8>, n: usize) {
    for _ in 0..n {
        varint(bytes);
    }
}

/// Skips `n` raw bytes; `delta` is the entry's line delta.
fn skip(bytes: &mut impl Iterator<Item = u8>, n: usize, delta: i64) -> i64 {
    for _ in 0..n {
        bytes.next();
    }
    delta
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_follow_the_location_table() {
        // Code units 0-1: no column, +2 lines; 2-4: one-line form, +1;
        // 5: short form, same line; 6-7: long form, -1 line.
        let table = [
            0x80 | (13 << 3) | 1,
            4,
            0x80 | (11 << 3) | 2,
            0,
            5,
            0x80,
            3,
            0x80 | (14 << 3) | 1,
            3,
            0,
            1,
            1,
        ];
        let lines: Vec<u32> = (0..9).map(|i| line_of(&table, 10, i)).collect();
        assert_eq!(lines, [12, 12, 13, 13, 13, 13, 12, 12, 12]);
    }

    #[test]
    fn a_varint_of_several_bytes_is_read_whole() {
        // +100 lines: 200 as a varint is 8 | 64 (more), then 3.
        let table = [0x80 | (13 << 3), 8 | 64, 3];
        assert_eq!(line_of(&table, 1, 0), 101);
    }
}
