//! A snapshot's mappings as profiles: every anonymous mapping the process
//! was seen to make, by the stack that made it, labelled with its owner
//! (an allocator, a thread stack, a JVM, or direct). pprof with the sample
//! types `mapped_space` and `resident_space` and an `owner` label; folded
//! stacks and a flame graph of resident bytes, the owner at the root.
use std::io::{self, Write};

use crate::{
    account,
    output::{Format, flamegraph, folded, pprof},
    profile::HeapProfile,
    symbolize::Namer,
};

/// The file name's ending of the mappings profile in `format`, where
/// there is one.
pub fn extension(format: Format) -> Option<&'static str> {
    match format {
        Format::Pprof => Some("mappings.pb.gz"),
        Format::Folded => Some("mappings.folded"),
        Format::Svg => Some("mappings.svg"),
        Format::Heap | Format::SymbolizedHeap => None,
    }
}

/// Writes the mappings of `profile` (read at its snapshot) in `format`.
pub fn write(
    format: Format,
    profile: &HeapProfile,
    namer: &mut Namer,
    out: &mut dyn Write,
) -> io::Result<()> {
    let Some(reading) = &profile.memory else {
        return Ok(());
    };
    let owned = account::owned(profile, reading, namer);
    if format == Format::Pprof {
        let types = [("mapped_space", "bytes"), ("resident_space", "bytes")];
        let samples = owned.iter().map(|(owner, range)| {
            let values = vec![range.len as i64, range.resident as i64];
            (
                range.frames.as_slice(),
                values,
                Some(("owner", owner.label())),
            )
        });
        let contents = pprof::Contents {
            types: &types,
            period: 1,
            comments: profile.notes.lines(),
        };
        return pprof::encode(&contents, samples, &profile.mapped_libraries, namer, out);
    }
    let stacks: Vec<folded::NamedStack> = owned
        .iter()
        .map(|(owner, range)| {
            let mut names = namer.stack(&range.frames);
            names.push(format!("[{}]", owner.label()));
            (names, range.resident)
        })
        .collect();
    if format == Format::Folded {
        folded::write(&stacks, out)
    } else {
        let title = format!("Resident bytes of mappings, pid {}", profile.pid);
        flamegraph::write(&folded::lines(&stacks), &title, out)
    }
}
