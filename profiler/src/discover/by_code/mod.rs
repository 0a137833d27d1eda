//! jemalloc 5.3's entry points in a file whose symbols do not name them
//! (stripped, hidden visibility, no debug file), found by their code.
//!
//! Every function start the call frame information lists is decoded, and a
//! function is taken only when its first instructions have the shape one of
//! jemalloc's entry points compiles to, and the shapes agree with each other:
//! - `malloc` and `operator new`: the size test against 4 KiB and the
//!   thread's allocated-bytes counter against its threshold, both leading to
//!   one slow path (`operator new`'s through a fallback that calls it);
//! - `free`, `sdallocx` and sized `operator delete`: the thread's
//!   deallocated-bytes counter, the word after the allocated pair, against
//!   its threshold, leading to a fallback;
//! - `calloc`: the overflow test of `num * size`, then the size test;
//! - `realloc` and `rallocx`: both pass on to one function, `rallocx` in
//!   two instructions;
//!
//! each reading the same TLS block and, but for `realloc`, the same size
//! class tables as `malloc`. A file where `malloc` or a free is not found
//! exactly once in that shape is refused: memprobe never probes a guess.
mod malloc;
mod shapes;
#[cfg(test)]
mod tests;

use std::collections::BTreeSet;

use iced_x86::{Decoder, DecoderOptions, Instruction, Register};
use profiler_common::CallShape;

use crate::binary::{elf::FunctionSymbols, placement::Placement};
use crate::discover::{
    AllocatorKind,
    entry_points::{EntryPoint, FoundEntryPoints},
    fast_path::{self, FastPath},
};
use malloc::{Malloc, find_malloc};
use shapes::{
    calloc_shape, free_shape, inlined_realloc_shape, is_pass_on, mallocx_shape, passes_realloc_on,
    rip_relative_leas,
};

/// Instructions read from each function start.
const MAX_INSTRUCTIONS: usize = 64;
/// Bytes decoded from each function start at most.
const HEAD_BYTES: u64 = 512;
/// The jemalloc releases whose code is known.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Release {
    /// 5.2: a tcache event ticker; the thread's deallocated-bytes counter
    /// follows its allocated one.
    V52,
    /// 5.3: thread event thresholds; the deallocated counter follows the
    /// allocated one and its threshold.
    V53,
}

impl Release {
    fn of(version: &str) -> Option<Release> {
        match version.get(..4)? {
            "5.2." => Some(Release::V52),
            "5.3." => Some(Release::V53),
            _ => None,
        }
    }

    /// The fast path of a malloc-shaped function.
    fn malloc(self, symbols: &FunctionSymbols, data: &[u8], head: &Head) -> Option<FastPath> {
        match self {
            Release::V52 => shapes::malloc_52(symbols, data, head),
            Release::V53 => fast_path::recognise(symbols, data, head.address),
        }
    }

    /// Whether a free-shaped function tests a size, and the register its
    /// thread block is read through, for malloc's allocated counter at
    /// `allocated`.
    fn free(
        self,
        symbols: &FunctionSymbols,
        data: &[u8],
        head: &Head,
        allocated: i64,
    ) -> Option<(bool, Register)> {
        match self {
            Release::V52 => shapes::free_52(symbols, data, head, allocated + 8),
            Release::V53 => free_shape(symbols, data, head, allocated + 16),
        }
    }
}

/// The name given to the functions found with malloc's fast path and
/// another fallback: `operator new` and its nothrow form, told apart by
/// nothing a probe needs.
pub const OPERATOR_NEW: &str = "operator new";

/// Why a file's jemalloc could not be told by its code.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    #[error("no jemalloc version string")]
    NoVersion,
    #[error("jemalloc {0}: only 5.2's and 5.3's code is known")]
    UnknownVersion(String),
    #[error("no function has the shape of jemalloc's malloc")]
    NoMalloc,
    #[error("malloc-shaped functions read different thread counters")]
    CountersDiffer,
    #[error("malloc-shaped functions lead to no one slow path")]
    NoSlowPath,
    #[error("{0} functions have the shape of jemalloc's malloc")]
    Mallocs(usize),
    #[error("no function has the shape of jemalloc's free")]
    NoFree,
}

/// jemalloc's entry points as found by their code.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FoundByCode {
    /// jemalloc's release, from its version string.
    pub version: String,
    /// (name given, shape, address), in address order.
    pub functions: Vec<(String, CallShape, u64)>,
    /// Entry points whose shape was not found: calls to them are not seen.
    pub missing: Vec<&'static str>,
    /// The found functions' extents, as file offsets (filled in once they
    /// are named): frames there are jemalloc's, not the program's.
    pub extents: Vec<std::ops::Range<u64>>,
}

impl FoundByCode {
    /// What was found, for `--verbose` and the profile: `jemalloc 5.3.0,
    /// entry points found by their code: malloc at 0x..., ...`.
    pub fn describe(&self) -> String {
        let found: Vec<String> = self
            .functions
            .iter()
            .map(|(name, _, address)| format!("{name} at {address:#x}"))
            .collect();
        let mut text = format!(
            "jemalloc {}, entry points found by their code: {}",
            self.version,
            found.join(", ")
        );
        if !self.missing.is_empty() {
            text.push_str(&format!(
                "; not found, so not seen: {}",
                self.missing.join(", ")
            ));
        }
        text
    }
}

/// The first instructions of one function, and where it starts.
struct Head {
    address: u64,
    instructions: Vec<Instruction>,
}

/// Finds jemalloc 5.3's entry points in `data` by their code; why not,
/// when they cannot be told for certain. Two passes over the function
/// starts keep only candidates: a big file's functions are many.
pub fn find(symbols: &FunctionSymbols, data: &[u8]) -> Result<FoundByCode, Refusal> {
    let version = fast_path::version_in_file(data).ok_or(Refusal::NoVersion)?;
    let release = Release::of(&version).ok_or(Refusal::UnknownVersion(version.clone()))?;
    let mut shaped = Vec::new();
    for_each_head(symbols, data, |head| {
        if let Some(fast) = release.malloc(symbols, data, head) {
            shaped.push((head.address, fast, rip_relative_leas(&head.instructions)));
        }
    });
    let malloc = find_malloc(symbols, data, shaped)?;
    let mut shapes = Shapes::default();
    for_each_head(symbols, data, |head| {
        shapes.sort(release, symbols, data, &malloc, head)
    });
    if shapes.frees.is_empty() {
        return Err(Refusal::NoFree);
    }
    let mut found = FoundByCode {
        version,
        functions: vec![("malloc".to_owned(), CallShape::SizeArg0, malloc.address)],
        missing: Vec::new(),
        extents: Vec::new(),
    };
    found.add(OPERATOR_NEW, CallShape::SizeArg0, &malloc.news);
    let frees = |sized: bool| -> Vec<u64> {
        let of_kind = shapes.frees.iter().filter(|f| f.0 == sized);
        of_kind.map(|f| f.1).collect()
    };
    found.add("free", CallShape::Free, &frees(false));
    found.add("sdallocx", CallShape::Free, &frees(true));
    found.add_one("calloc", CallShape::Calloc, &shapes.callocs);
    found.add_one("mallocx", CallShape::Mallocx, &shapes.mallocxs);
    let pair = shapes.realloc_pair(symbols, data, &malloc.tables);
    match (pair, &shapes.inlined_reallocs[..]) {
        (Some((realloc, rallocx)), _) => {
            found.add("realloc", CallShape::Realloc, &[realloc]);
            found.add("rallocx", CallShape::Rallocx, &[rallocx]);
        }
        (None, inlined) => {
            found.add_one("realloc", CallShape::Realloc, inlined);
            found.missing.push("rallocx");
        }
    }
    found.missing.extend(["posix_memalign", "aligned_alloc"]);
    found.functions.sort_by_key(|f| f.2);
    Ok(found)
}

impl FoundByCode {
    /// `name`, `name#2`, ... at each of `addresses`.
    fn add(&mut self, name: &str, shape: CallShape, addresses: &[u64]) {
        for (i, &address) in addresses.iter().enumerate() {
            let name = match i {
                0 => name.to_owned(),
                _ => format!("{name}#{}", i + 1),
            };
            self.functions.push((name, shape, address));
        }
    }

    /// `name` at the one address of `candidates`; missing when there are
    /// none or several.
    fn add_one(&mut self, name: &'static str, shape: CallShape, candidates: &[u64]) {
        match candidates {
            [address] => self.add(name, shape, &[*address]),
            _ => self.missing.push(name),
        }
    }

    /// Names the functions found in `symbols` (so that placing probes and
    /// reading the fast path go as with symbols), notes their extents, and
    /// gives them as jemalloc's entry points.
    pub(super) fn entry_points(&mut self, symbols: &mut FunctionSymbols) -> FoundEntryPoints {
        let mut entry_points = Vec::new();
        for (name, shape, address) in &self.functions {
            symbols.name_function(name, *address);
            let Some(function) = symbols.function(name) else {
                continue;
            };
            let start = function.file_offset;
            self.extents.push(start..start + function.size.max(1));
            entry_points.push(EntryPoint {
                symbol: name.clone(),
                shape: *shape,
                file_offset: start,
                placement: Placement::entry("not analysed"),
                forwards: false,
            });
        }
        FoundEntryPoints {
            kind: AllocatorKind::Jemalloc,
            prefix: String::new(),
            entry_points,
        }
    }
}

/// Calls `visit` with the first instructions of each function that reads
/// the thread's block through fs or is a two-instruction pass-on: the
/// shapes looked for all are.
fn for_each_head(symbols: &FunctionSymbols, data: &[u8], mut visit: impl FnMut(&Head)) {
    let mut head = Head {
        address: 0,
        instructions: Vec::with_capacity(MAX_INSTRUCTIONS),
    };
    for &address in symbols.function_starts() {
        let end = symbols
            .next_function_start(address)
            .unwrap_or(address + HEAD_BYTES);
        let len = end.saturating_sub(address).min(HEAD_BYTES);
        let Some(code) = symbols.code(data, address, len) else {
            continue;
        };
        head.address = address;
        head.instructions.clear();
        head.instructions.extend(
            Decoder::with_ip(64, code, address, DecoderOptions::NONE)
                .into_iter()
                .take(MAX_INSTRUCTIONS)
                .take_while(|i| !i.is_invalid()),
        );
        let reads_fs = head
            .instructions
            .iter()
            .any(|i| i.segment_prefix() == Register::FS);
        if reads_fs || is_pass_on(&head.instructions).is_some() {
            visit(&head);
        }
    }
}

/// The functions of the other shapes, once malloc's counters are known.
#[derive(Default)]
struct Shapes {
    /// (sized, address).
    frees: Vec<(bool, u64)>,
    callocs: Vec<u64>,
    mallocxs: Vec<u64>,
    /// (address, where it jumps): `xor ecx, ecx; jmp D`.
    pass_ons: Vec<(u64, u64)>,
    /// (address, where it jumps) of realloc-shaped functions.
    reallocs: Vec<(u64, u64)>,
    /// Functions shaped as a realloc with its resizing inlined.
    inlined_reallocs: Vec<u64>,
}

impl Shapes {
    fn sort(
        &mut self,
        release: Release,
        symbols: &FunctionSymbols,
        data: &[u8],
        malloc: &Malloc,
        h: &Head,
    ) {
        let same_block =
            |base| fast_path::tls_source(&h.instructions, base) == Some(malloc.fast.tls);
        let reads_tables = !rip_relative_leas(&h.instructions).is_disjoint(&malloc.tables);
        if let Some((sized, base)) = release.free(symbols, data, h, malloc.fast.allocated)
            && same_block(base)
            && reads_tables
        {
            self.frees.push((sized, h.address));
        }
        if calloc_shape(h).is_some_and(same_block) && reads_tables {
            self.callocs.push(h.address);
        }
        if mallocx_shape(h).is_some_and(same_block) && reads_tables {
            self.mallocxs.push(h.address);
        }
        if let Some(target) = is_pass_on(&h.instructions) {
            self.pass_ons.push((h.address, target));
        }
        if let Some(target) = passes_realloc_on(&h.instructions) {
            self.reallocs.push((h.address, target));
        }
        if inlined_realloc_shape(h).is_some_and(same_block) && reads_tables {
            self.inlined_reallocs.push(h.address);
        }
    }

    /// `realloc` and `rallocx`: a two-instruction function (`xor ecx, ecx;
    /// jmp D`, rallocx passing `is_realloc = false` on) and one that tests
    /// both arguments and jumps to the same D with `ecx = 1`, where D reads
    /// malloc's size class tables. Exactly one such pair.
    fn realloc_pair(
        &self,
        symbols: &FunctionSymbols,
        data: &[u8],
        tables: &BTreeSet<u64>,
    ) -> Option<(u64, u64)> {
        let pairs: Vec<(u64, u64, u64)> = self
            .reallocs
            .iter()
            .flat_map(|&(realloc, target)| {
                self.pass_ons
                    .iter()
                    .filter(move |&&(rallocx, t)| t == target && rallocx != realloc)
                    .map(move |&(rallocx, _)| (realloc, rallocx, target))
            })
            .collect();
        let [(realloc, rallocx, target)] = pairs[..] else {
            return None;
        };
        let end = symbols.next_function_start(target)?;
        let code = symbols.code(data, target, end.saturating_sub(target).min(16 * 1024))?;
        let instructions: Vec<Instruction> =
            Decoder::with_ip(64, code, target, DecoderOptions::NONE)
                .into_iter()
                .collect();
        (!rip_relative_leas(&instructions).is_disjoint(tables)).then_some((realloc, rallocx))
    }
}
