//! Reading jemalloc `heap_v2` profiles: memprobe's own and jemalloc's
//! `jeprof.*.heap` dumps. Malformed input is an error with a line number,
//! never a panic.
use std::collections::HashMap;

use crate::{
    output::heap_v2::{MEMORY, MEMORY_SITE, jeprof_decode},
    profile::{MemoryAccount, ProfileNotes, PythonFrameName, SiteMemory},
};

/// A stack as read from a `.heap`, its frames raw return addresses like a
/// live one's: the reader adds back the 1 that the file's first frame was
/// written without (jeprof looks that frame up as written, and the others
/// less 1; a namer looks every frame up less 1, so it agrees with jeprof).
pub type ParsedStack = crate::profile::StackEstimate;

/// A parsed `.heap` file.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ParsedHeap {
    pub sample_interval: u64,
    /// memprobe's `# key: value` lines before the first stack.
    pub notes: ProfileNotes,
    pub stacks: Vec<ParsedStack>,
    /// The text after `MAPPED_LIBRARIES:`.
    pub mapped_libraries: String,
    /// Names from a self-symbolized profile's `--- symbol` section, keyed by
    /// the address as jeprof looks it up.
    pub symbols: HashMap<u64, String>,
    /// The Python frames its stacks hold (`# python_frame` lines).
    pub python_frames: Vec<(u64, PythonFrameName)>,
    /// The process's memory account, where the snapshot had one.
    pub account: Option<MemoryAccount>,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ParseError {
    #[error("not a heap_v2 profile: the first line must be heap_v2/<interval>")]
    NotHeapV2,
    #[error("line {line}: {what}")]
    Line { line: usize, what: String },
}

fn line_error(line: usize, what: impl Into<String>) -> ParseError {
    ParseError::Line {
        line,
        what: what.into(),
    }
}

/// `N: N [N: N]` after `t*:` or `t<id>:`.
fn parse_counts(text: &str, line: usize) -> Result<[u64; 4], ParseError> {
    let numbers: Vec<&str> = text
        .split(|c: char| c == ':' || c == '[' || c == ']' || c.is_whitespace())
        .filter(|s| !s.is_empty())
        .collect();
    if numbers.len() != 4 || !text.trim_end().ends_with(']') {
        return Err(line_error(line, format!("bad counts {text:?}")));
    }
    let mut counts = [0u64; 4];
    for (slot, number) in counts.iter_mut().zip(&numbers) {
        *slot = number
            .parse()
            .map_err(|_| line_error(line, format!("bad number {number:?}")))?;
    }
    Ok(counts)
}

/// A self-symbolized profile: `--- symbol`, `binary=...`, `0xADDR name`
/// lines, `---`, `--- heap`, then the `heap_v2` profile.
fn split_symbols(text: &str) -> Result<(HashMap<u64, String>, &str, usize), ParseError> {
    let mut symbols = HashMap::new();
    if !text.starts_with("--- symbol") {
        return Ok((symbols, text, 0));
    }
    let heap_start = text
        .find("\n--- heap\n")
        .ok_or_else(|| line_error(1, "a --- symbol section without --- heap"))?;
    for (number, line) in text[..heap_start].lines().enumerate().skip(1) {
        let line = line.trim();
        if line.is_empty() || line.starts_with("---") || line.starts_with("binary=") {
            continue;
        }
        let (address, name) = line
            .split_once(char::is_whitespace)
            .ok_or_else(|| line_error(number + 1, format!("bad symbol line {line:?}")))?;
        let address = u64::from_str_radix(address.trim_start_matches("0x"), 16)
            .map_err(|_| line_error(number + 1, format!("bad address {address:?}")))?;
        symbols.insert(address, name.trim().to_owned());
    }
    let body = &text[heap_start + "\n--- heap\n".len()..];
    let skipped = text[..heap_start].lines().count() + 1;
    Ok((symbols, body, skipped))
}

pub fn parse(text: &str) -> Result<ParsedHeap, ParseError> {
    let (symbols, text, skipped) = split_symbols(text)?;
    let mut lines = text.lines().enumerate().map(|(i, l)| (i + 1 + skipped, l));
    let (_, header) = lines.next().ok_or(ParseError::NotHeapV2)?;
    let sample_interval = header
        .trim()
        .strip_prefix("heap_v2/")
        .and_then(|r| r.parse::<u64>().ok())
        .ok_or(ParseError::NotHeapV2)?;
    let mut heap = ParsedHeap {
        sample_interval,
        symbols,
        ..ParsedHeap::default()
    };
    let mut current: Option<ParsedStack> = None;
    for (number, raw) in lines.by_ref() {
        let line = raw.trim();
        if line.starts_with("MAPPED_LIBRARIES:") {
            break;
        }
        if let Some(frames) = line.strip_prefix('@') {
            heap.stacks.extend(current.take());
            current = Some(stack_of(frames, number)?);
        } else if let Some(counts) = line.strip_prefix("t*:") {
            let [n1, s1, n2, s2] = parse_counts(counts, number)?;
            // The header's totals come before any stack: not needed.
            if let Some(stack) = current.as_mut() {
                (stack.inuse_objects, stack.inuse_bytes) = jeprof_decode(n1, s1, sample_interval);
                (stack.alloc_objects, stack.alloc_bytes) = jeprof_decode(n2, s2, sample_interval);
            }
        } else if let Some(note) = line.strip_prefix("# ") {
            read_note(&mut heap, current.as_mut(), note);
        }
        // Per-thread `t<id>:` lines and anything else are skipped, as jeprof does.
    }
    heap.stacks.extend(current);
    heap.mapped_libraries = lines.map(|(_, l)| l).collect::<Vec<_>>().join("\n");
    Ok(heap)
}

/// A stack's `@ 0xADDR ...` line (its first frame a return address one
/// past the call, as jeprof writes it).
fn stack_of(frames: &str, number: usize) -> Result<ParsedStack, ParseError> {
    let mut frames = frames
        .split_whitespace()
        .map(|f| {
            u64::from_str_radix(f.trim_start_matches("0x"), 16)
                .map_err(|_| line_error(number, format!("bad address {f:?}")))
        })
        .collect::<Result<Vec<u64>, _>>()?;
    let Some(first) = frames.first_mut() else {
        return Err(line_error(number, "a stack with no address"));
    };
    *first = first.wrapping_add(1);
    Ok(ParsedStack {
        frames,
        inuse_objects: 0.0,
        inuse_bytes: 0.0,
        alloc_objects: 0.0,
        alloc_bytes: 0.0,
        oldest_live_s: None,
    })
}

/// " 0xADDRESS LINE FILE<tab>FUNCTION" of a `# python_frame` line.
fn read_python_frame(text: &str) -> Option<(u64, PythonFrameName)> {
    let mut parts = text.trim_start().splitn(3, ' ');
    let address = u64::from_str_radix(parts.next()?.trim_start_matches("0x"), 16).ok()?;
    let line = parts.next()?.parse().ok()?;
    let (file, function) = parts.next()?.split_once('\t')?;
    let frame = PythonFrameName {
        function: function.to_owned(),
        file: file.to_owned(),
        line,
    };
    Some((address, frame))
}

/// A `# ` line: a name memprobe had for JIT code (`# jit_symbol 0xADDRESS
/// name`), a stack's note (`oldest_live_s`), or, before any stack, the
/// profile's.
fn read_note(heap: &mut ParsedHeap, stack: Option<&mut ParsedStack>, note: &str) {
    if let Some(frame) = note.strip_prefix(crate::output::heap_v2::PYTHON_FRAME) {
        heap.python_frames.extend(read_python_frame(frame));
        return;
    }
    if let Some(jit) = note.strip_prefix(crate::output::heap_v2::JIT_SYMBOL) {
        let mut parts = jit.trim().splitn(2, ' ');
        if let (Some(address), Some(name)) = (parts.next(), parts.next())
            && let Ok(address) = u64::from_str_radix(address.trim_start_matches("0x"), 16)
        {
            heap.symbols.insert(address, name.to_owned());
        }
        return;
    }
    let Some((key, value)) = note.split_once(": ") else {
        return;
    };
    match stack {
        Some(stack) if key == "oldest_live_s" => stack.oldest_live_s = value.parse().ok(),
        Some(_) => {}
        None if key == MEMORY => read_part(heap.account.get_or_insert_default(), value),
        None if key == MEMORY_SITE => {
            let account = heap.account.get_or_insert_default();
            account.sites.extend(read_site(value));
        }
        None => {
            heap.notes.read(key, value);
        }
    }
}

/// `part: BYTES (detail)`; one memprobe does not know is left out.
fn read_part(account: &mut MemoryAccount, value: &str) {
    let Some((name, rest)) = value.split_once(": ") else {
        return;
    };
    let bytes = rest.split(' ').next().and_then(|b| b.parse().ok());
    if let (Some(part), Some(bytes)) = (account.part_mut(name), bytes) {
        *part = bytes;
    }
}

/// `NAME: R resident of M mapped in N mappings @ 0xFRAME ...`.
fn read_site(value: &str) -> Option<SiteMemory> {
    let (head, frames) = value.rsplit_once(" @")?;
    let (name, numbers) = head.rsplit_once(": ")?;
    let words: Vec<&str> = numbers.split(' ').collect();
    let [
        resident,
        "resident",
        "of",
        mapped,
        "mapped",
        "in",
        mappings,
        "mappings",
    ] = words[..]
    else {
        return None;
    };
    let frames = frames
        .split_whitespace()
        .filter_map(|f| u64::from_str_radix(f.trim_start_matches("0x"), 16).ok())
        .collect();
    Some(SiteMemory {
        name: name.to_owned(),
        frames,
        mappings: mappings.parse().ok()?,
        mapped: mapped.parse().ok()?,
        resident: resident.parse().ok()?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_back_what_the_writer_wrote() {
        let text = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/golden/example.heap"
        ))
        .unwrap();
        let heap = parse(&text).unwrap();
        assert_eq!(heap.sample_interval, 524_288);
        assert_eq!(heap.notes.other, [("dropped_samples".into(), "3".into())]);
        assert_eq!(heap.stacks.len(), 3);
        // Written as return address - 1, read back as the return address.
        assert_eq!(heap.stacks[0].frames[0], 0x55d0c0a01163);
        assert_eq!(heap.stacks[0].oldest_live_s, Some(12.5));
        // Within the writer's rounding of half a sample.
        assert!((heap.stacks[1].inuse_bytes - 22_020_096.0).abs() < 262_144.0);
        assert!(heap.mapped_libraries.contains("/usr/bin/demo"));
    }

    #[test]
    fn reads_jemallocs_own_format_with_thread_lines() {
        let text = "heap_v2/524288\n  t*: 2: 8192 [0: 0]\n  t0: 2: 8192 [0: 0]\n\
                    @ 0x1 0x2\n  t*: 2: 8192 [0: 0]\n  t0: 2: 8192 [0: 0]\n\nMAPPED_LIBRARIES:\nx\n";
        let heap = parse(text).unwrap();
        assert_eq!(heap.stacks.len(), 1);
        assert!(heap.stacks[0].inuse_bytes > 8192.0);
        assert_eq!(heap.mapped_libraries, "x");
    }

    #[test]
    fn reads_a_self_symbolized_profile() {
        let text = "--- symbol\nbinary=/bin/app\n0x0000000000001000 keep_1m\n---\n--- heap\n\
                    heap_v2/4096\n@ 0x1000\n  t*: 1: 1048576 [1: 1048576]\n\nMAPPED_LIBRARIES:\n";
        let heap = parse(text).unwrap();
        assert_eq!(heap.symbols[&0x1000], "keep_1m");
        assert_eq!(heap.stacks.len(), 1);
        assert!(parse("--- symbol\n0x1 a\n").is_err());
    }

    #[test]
    fn malformed_input_is_an_error_not_a_panic() {
        for bad in [
            "",
            "heap profile: 1: 2 [3: 4] @ heapprofile",
            "heap_v2/x",
            "heap_v2/1\n@ 0xzz\n",
            "heap_v2/1\n@\n",
            "heap_v2/1\n@ 0x1\n  t*: 1: 2 [3\n",
            "heap_v2/1\n@ 0x1\n  t*: 99999999999999999999999: 2 [3: 4]\n",
        ] {
            assert!(parse(bad).is_err(), "{bad:?} parsed");
        }
    }
}
