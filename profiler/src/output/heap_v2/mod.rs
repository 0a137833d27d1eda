//! jemalloc's `heap_v2` format, as `jeprof` reads it.
//!
//! jeprof un-samples every (count, bytes) pair itself, with the stack's
//! average size; we keep unbiased per-sample estimates and write the values
//! that jeprof's formula turns back into them ([`numbers`]); read back by
//! [`read`].
mod numbers;
pub mod read;

pub use numbers::{jeprof_decode, jeprof_encode};
use std::io::{self, Write};

use crate::profile::{HeapProfile, MemoryAccount, StackEstimate};

/// The comment lines naming JIT code: `# jit_symbol 0xADDRESS name`.
pub const JIT_SYMBOL: &str = "jit_symbol";

/// The comment lines naming Python frames:
/// `# python_frame 0xADDRESS LINE FILE<tab>FUNCTION`.
pub const PYTHON_FRAME: &str = "python_frame";

/// Writes `profile` in `heap_v2` format.
pub fn write<W: Write>(profile: &HeapProfile, mut out: W) -> io::Result<()> {
    let interval = profile.sample_interval;
    let encoded: Vec<_> = profile
        .stacks
        .iter()
        .filter(|stack| !stack.frames.is_empty())
        .map(|stack| {
            let inuse = jeprof_encode(stack.inuse_objects, stack.inuse_bytes, interval);
            let alloc = jeprof_encode(stack.alloc_objects, stack.alloc_bytes, interval);
            (stack, inuse, alloc)
        })
        .filter(|(_, inuse, alloc)| *inuse != (0, 0) || *alloc != (0, 0))
        .collect();

    let total = encoded.iter().fold([0u64; 4], |t, (_, inuse, alloc)| {
        [
            t[0] + inuse.0,
            t[1] + inuse.1,
            t[2] + alloc.0,
            t[3] + alloc.1,
        ]
    });
    writeln!(out, "heap_v2/{interval}")?;
    writeln!(
        out,
        "  t*: {}: {} [{}: {}]",
        total[0], total[1], total[2], total[3]
    )?;
    // jeprof skips lines it does not know; these carry what it cannot.
    for (key, value) in profile.notes.lines() {
        writeln!(out, "# {key}: {value}")?;
    }
    for (address, name) in &profile.jit_symbols {
        writeln!(out, "# {JIT_SYMBOL} 0x{address:x} {name}")?;
    }
    for (address, frame) in &profile.python_frames {
        let file = frame.file.replace(['\t', '\n'], " ");
        let function = frame.function.replace('\n', " ");
        writeln!(
            out,
            "# {PYTHON_FRAME} 0x{address:x} {} {file}\t{function}",
            frame.line
        )?;
    }
    if let Some(account) = &profile.account {
        write_account(&mut out, account)?;
    }
    for (stack, inuse, alloc) in encoded {
        write_stack(&mut out, stack, inuse, alloc)?;
    }
    writeln!(out)?;
    writeln!(out, "MAPPED_LIBRARIES:")?;
    out.write_all(profile.mapped_libraries.as_bytes())?;
    if !profile.mapped_libraries.is_empty() && !profile.mapped_libraries.ends_with('\n') {
        writeln!(out)?;
    }
    Ok(())
}

/// The memory account as comments, in bytes: `# memory: resident: N`,
/// one `# memory: PART: N` per part (they add up to the resident total),
/// and one `# memory_site:` per direct-mapping site.
fn write_account<W: Write>(out: &mut W, account: &MemoryAccount) -> io::Result<()> {
    writeln!(out, "# {MEMORY}: resident: {}", account.resident)?;
    for (name, bytes, detail) in account.parts() {
        let detail = if detail.is_empty() {
            String::new()
        } else {
            format!(" ({detail})")
        };
        writeln!(out, "# {MEMORY}: {name}: {bytes}{detail}")?;
    }
    for site in &account.sites {
        let frames: Vec<String> = site.frames.iter().map(|f| format!("0x{f:x}")).collect();
        writeln!(
            out,
            "# {MEMORY_SITE}: {}: {} resident of {} mapped in {} mappings @ {}",
            site.name,
            site.resident,
            site.mapped,
            site.mappings,
            frames.join(" ")
        )?;
    }
    Ok(())
}

/// Comment keys of the memory account.
pub const MEMORY: &str = "memory";
pub const MEMORY_SITE: &str = "memory_site";

/// One stack: its frames, its encoded in-use and allocated (count,
/// bytes), and the age of its oldest live sample.
fn write_stack<W: Write>(
    out: &mut W,
    stack: &StackEstimate,
    inuse: (u64, u64),
    alloc: (u64, u64),
) -> io::Result<()> {
    write!(out, "@")?;
    for (i, frame) in stack.frames.iter().enumerate() {
        // jeprof subtracts 1 from every frame but the first: give it the
        // first one as (return address - 1) so all resolve to the call.
        let address = if i == 0 {
            frame.saturating_sub(1)
        } else {
            *frame
        };
        write!(out, " 0x{address:x}")?;
    }
    writeln!(out)?;
    writeln!(
        out,
        "  t*: {}: {} [{}: {}]",
        inuse.0, inuse.1, alloc.0, alloc.1
    )?;
    if let Some(age) = stack.oldest_live_s {
        writeln!(out, "# oldest_live_s: {age:.3}")?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;
    use crate::profile::ProfileNotes;

    fn golden(name: &str, actual: &str) {
        let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("tests/golden")
            .join(name);
        if std::env::var_os("MEMPROBE_BLESS").is_some() {
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(&path, actual).unwrap();
        }
        let expected = std::fs::read_to_string(&path)
            .unwrap_or_else(|_| panic!("{} missing: run with MEMPROBE_BLESS=1", path.display()));
        assert_eq!(
            actual, expected,
            "{} differs (MEMPROBE_BLESS=1 rewrites it)",
            name
        );
    }

    /// JIT names travel in comment lines jeprof skips, and come back as
    /// the profile's symbols.
    #[test]
    fn jit_names_are_written_and_read_back() {
        let mut profile = example();
        profile.jit_symbols = vec![(0x7f00deadbeef, "void HotAlloc.run(int)".into())];
        let mut text = Vec::new();
        write(&profile, &mut text).unwrap();
        let text = String::from_utf8(text).unwrap();
        assert!(text.contains("# jit_symbol 0x7f00deadbeef void HotAlloc.run(int)\n"));
        let parsed = read::parse(&text).unwrap();
        assert_eq!(parsed.symbols[&0x7f00deadbeef], "void HotAlloc.run(int)");
        assert!(!parsed.notes.other.iter().any(|(k, _)| k.contains("jit")));
    }

    /// Python frames travel in comment lines jeprof skips, a file with a
    /// space in its path too, and name the frames when read back.
    #[test]
    fn python_frames_are_written_and_read_back() {
        let mut profile = example();
        let frame = crate::profile::PythonFrameName {
            function: "Loader.build_index".into(),
            file: "/srv/my jobs/etl.py".into(),
            line: 42,
        };
        profile.python_frames = vec![(0xffff_f000_0000_0010, frame.clone())];
        let mut text = Vec::new();
        write(&profile, &mut text).unwrap();
        let text = String::from_utf8(text).unwrap();
        let line = "# python_frame 0xfffff00000000010 42 /srv/my jobs/etl.py\tLoader.build_index\n";
        assert!(text.contains(line), "{text}");
        let parsed = read::parse(&text).unwrap();
        assert_eq!(parsed.python_frames, [(0xffff_f000_0000_0010, frame)]);
        let mut namer = crate::symbolize::Namer::new("", None).with_python(&parsed.python_frames);
        assert_eq!(
            namer.stack(&[0x401001, 0xffff_f000_0000_0011]),
            ["0x401000", "etl.py:42 Loader.build_index"]
        );
    }

    /// The memory account travels in comment lines jeprof skips too, and
    /// comes back whole.
    #[test]
    fn the_memory_account_is_written_and_read_back() {
        let mut profile = example();
        let account = MemoryAccount {
            resident: 100 << 20,
            heap_in_use: 20 << 20,
            allocator_footprint: 5 << 20,
            allocators: Vec::new(),
            sites: vec![crate::profile::SiteMemory {
                name: "pool_reserve".into(),
                frames: vec![0x401234, 0x401000],
                mappings: 1,
                mapped: 1 << 30,
                resident: 64 << 20,
            }],
            thread_stacks: 1 << 20,
            file_backed: 10 << 20,
            ..MemoryAccount::default()
        };
        profile.account = Some(account.clone());
        let mut text = Vec::new();
        write(&profile, &mut text).unwrap();
        let text = String::from_utf8(text).unwrap();
        let parsed = read::parse(&text).unwrap();
        assert_eq!(parsed.account, Some(account));
        assert!(
            !parsed
                .notes
                .other
                .iter()
                .any(|(k, _)| k.starts_with("memory"))
        );
    }

    fn example() -> HeapProfile {
        HeapProfile {
            jit_symbols: Vec::new(),
            python_frames: Vec::new(),
            memory: None,
            account: None,
            pid: 42,
            sample_interval: 524_288,
            stacks: vec![
                StackEstimate {
                    frames: vec![0x55d0c0a01163, 0x55d0c0a0119a, 0x7f3a1c029d90],
                    inuse_objects: 128.5,
                    inuse_bytes: 526_338.0,
                    alloc_objects: 257.0,
                    alloc_bytes: 1_052_676.0,
                    oldest_live_s: Some(12.5),
                },
                StackEstimate {
                    frames: vec![0x55d0c0a0116e, 0x55d0c0a011bf, 0x7f3a1c029d90],
                    inuse_objects: 21.0,
                    inuse_bytes: 22_020_096.0,
                    alloc_objects: 21.0,
                    alloc_bytes: 22_020_096.0,
                    oldest_live_s: None,
                },
                // Freed entirely: only the allocated side remains.
                StackEstimate {
                    frames: vec![0x55d0c0a01200, 0x7f3a1c029d90],
                    inuse_objects: 0.0,
                    inuse_bytes: 0.0,
                    alloc_objects: 1024.0,
                    alloc_bytes: 524_288.0,
                    oldest_live_s: None,
                },
                // Nothing at all: not written.
                StackEstimate {
                    frames: vec![0x55d0c0a01300],
                    ..Default::default()
                },
            ],
            mapped_libraries: "55d0c0a00000-55d0c0a02000 r-xp 00001000 08:01 12 /usr/bin/demo\n"
                .into(),
            notes: ProfileNotes {
                other: vec![("dropped_samples".into(), "3".into())],
                ..ProfileNotes::default()
            },
        }
    }

    #[test]
    fn writes_heap_v2_golden() {
        let mut out = Vec::new();
        write(&example(), &mut out).unwrap();
        golden("example.heap", &String::from_utf8(out).unwrap());
    }

    #[test]
    fn count_lines_match_jeprof_regex_and_no_empty_stacks() {
        let mut out = Vec::new();
        write(&example(), &mut out).unwrap();
        let text = String::from_utf8(out).unwrap();
        for line in text.lines().take_while(|l| !l.starts_with("MAPPED")) {
            let line = line.trim();
            if line.starts_with("t*:") {
                // t*: N: N [N: N]
                let parts: Vec<&str> = line.split(|c: char| " :[]".contains(c)).collect();
                let numbers: Vec<u64> = parts.iter().filter_map(|p| p.parse().ok()).collect();
                assert_eq!(numbers.len(), 4, "{line}");
                assert!(line.ends_with(']'));
            }
            if line.starts_with('@') {
                assert!(line.len() > 2, "empty stack line");
            }
        }
        assert!(!text.contains("0x55d0c0a01300"));
    }
}
