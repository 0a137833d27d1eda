//! Writers, one module per format. Each takes a `W: Write` and never opens
//! files itself; [`files`] places the results on disk.
mod error;
pub(crate) mod files;
pub mod flamegraph;
pub mod folded;
pub mod heap_v2;
pub mod mappings;
pub mod pprof;
pub mod symbolized;

use std::io::Write;

pub use error::WriteError;

use crate::{profile::HeapProfile, symbolize::Namer};

/// The files a snapshot can be written as.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Format {
    /// jemalloc's `heap_v2`, for jeprof.
    Heap,
    /// pprof protobuf, symbolized, for `go tool pprof`.
    Pprof,
    /// Folded stacks of bytes in use.
    Folded,
    /// A flame graph of bytes in use.
    Svg,
    /// `heap_v2` with its symbols inside: jeprof needs no binary.
    SymbolizedHeap,
}

impl Format {
    pub const ALL: [Format; 5] = [
        Format::Heap,
        Format::Pprof,
        Format::Folded,
        Format::Svg,
        Format::SymbolizedHeap,
    ];

    /// The file name's ending: `memprobe.<pid>.<seq>.<ext>`.
    pub fn extension(self) -> &'static str {
        match self {
            Format::Heap => "heap",
            Format::Pprof => "pb.gz",
            Format::Folded => "folded",
            Format::Svg => "svg",
            Format::SymbolizedHeap => "sym.heap",
        }
    }

    pub fn from_extension(text: &str) -> Option<Format> {
        Format::ALL.into_iter().find(|f| f.extension() == text)
    }
}

/// Writes one snapshot in one format; formats with names use `namer`, or
/// one made from the profile's own mapped libraries.
pub fn write_format(
    format: Format,
    profile: &HeapProfile,
    namer: Option<&mut Namer>,
    out: &mut dyn Write,
) -> std::io::Result<()> {
    let mut fallback;
    let namer = match namer {
        Some(namer) => namer,
        None => {
            fallback = Namer::new(&profile.mapped_libraries, None);
            &mut fallback
        }
    };
    match format {
        Format::Heap => heap_v2::write(profile, out),
        Format::Pprof => pprof::write(profile, namer, out),
        Format::SymbolizedHeap => symbolized::write(profile, namer, out),
        Format::Folded | Format::Svg => {
            let stacks: Vec<folded::NamedStack> = profile
                .stacks
                .iter()
                .map(|s| {
                    let names = namer.stack(&s.frames);
                    (names, s.inuse_bytes.round().max(0.0) as u64)
                })
                .collect();
            if format == Format::Folded {
                folded::write(&stacks, out)
            } else {
                let title = format!("Bytes in use, pid {}", profile.pid);
                flamegraph::write(&folded::lines(&stacks), &title, out)
            }
        }
    }
}
