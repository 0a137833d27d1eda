//! Writers, one module per format. Each takes a `W: Write` and never opens
//! files itself; [`files`] places the results on disk.
pub mod files;
pub mod flamegraph;
pub mod folded;
pub mod heap_v2;
pub mod pprof;
pub mod symbolized;

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
