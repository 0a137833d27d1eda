//! Function symbols of an ELF file, their file offsets (what uprobes take),
//! their code, and which symbol each PLT stub jumps to.
use std::collections::HashMap;

use object::{
    Object, ObjectSection, ObjectSegment, ObjectSymbol, ObjectSymbolTable, RelocationTarget,
    SectionKind, SymbolKind,
};

use crate::proc::AddressRange;

/// One function symbol.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Function {
    /// Virtual address in the file's own address space.
    pub address: u64,
    pub size: u64,
    /// File offset of the first instruction.
    pub file_offset: u64,
}

/// Adds the defined function symbols of `file` (`.dynsym`, then `.symtab`)
/// that `segments` place in the file; the first of a name wins.
fn add_functions(
    functions: &mut HashMap<String, Function>,
    segments: &[Segment],
    file: &object::File<'_>,
) {
    let to_offset = |address: u64| segments.iter().find_map(|s| s.offset_of(address));
    for symbol in file.dynamic_symbols().chain(file.symbols()) {
        if symbol.kind() != SymbolKind::Text || symbol.is_undefined() || symbol.address() == 0 {
            continue;
        }
        let (Ok(name), Some(file_offset)) = (symbol.name(), to_offset(symbol.address())) else {
            continue;
        };
        functions.entry(name.to_owned()).or_insert(Function {
            address: symbol.address(),
            size: symbol.size(),
            file_offset,
        });
    }
}

/// A loadable segment: where its bytes are in the file and in memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Segment {
    pub address: u64,
    pub file_offset: u64,
    /// Bytes in the file (the in-memory rest is zeros).
    pub file_size: u64,
}

impl Segment {
    /// The segments of `file`.
    pub fn all<'d>(file: &object::File<'d>) -> Vec<Segment> {
        file.segments()
            .map(|s| {
                let (file_offset, file_size) = s.file_range();
                Segment {
                    address: s.address(),
                    file_offset,
                    file_size,
                }
            })
            .collect()
    }

    /// The file offset of `address`, if this segment's file bytes hold it.
    pub fn offset_of(&self, address: u64) -> Option<u64> {
        (address >= self.address && address < self.address + self.file_size)
            .then(|| address - self.address + self.file_offset)
    }

    /// The address of the byte at file `offset`, if this segment holds it.
    pub fn address_of(&self, offset: u64) -> Option<u64> {
        (offset >= self.file_offset && offset < self.file_offset + self.file_size)
            .then(|| offset - self.file_offset + self.address)
    }
}

/// Defined function symbols of one ELF file, from `.dynsym` and `.symtab`,
/// with enough of the file kept to read their code.
#[derive(Debug, Default)]
pub struct FunctionSymbols {
    functions: HashMap<String, Function>,
    segments: Vec<Segment>,
    /// PLT stub ranges, and GOT slot -> symbol for the stubs' jumps.
    plt_ranges: Vec<AddressRange>,
    got_symbols: HashMap<u64, String>,
    /// Where functions start, sorted, from `.eh_frame_hdr`'s table: the
    /// extents of functions that have no symbol in a stripped file.
    function_starts: Vec<u64>,
    /// Whether the file has a `.symtab` (stripped files have none).
    pub has_symbol_table: bool,
}

impl FunctionSymbols {
    pub fn parse(data: &[u8]) -> Result<Self, object::Error> {
        let file = object::File::parse(data)?;
        let segments = Segment::all(&file);
        let mut functions = HashMap::new();
        add_functions(&mut functions, &segments, &file);
        let plt_ranges = file
            .sections()
            .filter(|s| matches!(s.name(), Ok(".plt" | ".plt.sec" | ".plt.got")))
            .map(|s| AddressRange {
                start: s.address(),
                end: s.address() + s.size(),
            })
            .collect();
        let mut got_symbols = HashMap::new();
        // Dynamic relocations index the dynamic symbol table.
        if let (Some(relocations), Some(dynamic)) =
            (file.dynamic_relocations(), file.dynamic_symbol_table())
        {
            for (slot, relocation) in relocations {
                if let RelocationTarget::Symbol(index) = relocation.target()
                    && let Ok(symbol) = dynamic.symbol_by_index(index)
                    && let Ok(name) = symbol.name()
                {
                    got_symbols.insert(slot, name.to_owned());
                }
            }
        }
        let has_symbol_table = file.symbols().next().is_some();
        let function_starts = file
            .section_by_name(".eh_frame_hdr")
            .and_then(|s| Some(eh_frame_hdr_starts(s.address(), s.data().ok()?)))
            .unwrap_or_default();
        Ok(Self {
            functions,
            segments,
            plt_ranges,
            got_symbols,
            function_starts,
            has_symbol_table,
        })
    }

    /// Takes the function symbols of the file's separate debug file (its
    /// `.symtab`, which a stripped file lacks), placed by this file's
    /// segments: the debug file's own hold no code.
    pub fn adopt_debug_symbols(&mut self, debug_data: &[u8]) -> Result<(), object::Error> {
        let debug = object::File::parse(debug_data)?;
        let before = self.functions.len();
        add_functions(&mut self.functions, &self.segments, &debug);
        if self.functions.len() > before {
            self.has_symbol_table = true;
        }
        Ok(())
    }

    pub fn function(&self, name: &str) -> Option<Function> {
        self.functions.get(name).copied()
    }

    /// The one function whose name ends with `suffix` (a jemalloc
    /// function, whatever its prefix); `None` where none or more than one
    /// does.
    pub fn function_ending(&self, suffix: &str) -> Option<Function> {
        let mut named = self.names().filter(|name| name.ends_with(suffix));
        let name = named.next()?;
        named.next().is_none().then(|| self.function(name))?
    }

    pub fn offset(&self, name: &str) -> Option<u64> {
        self.function(name).map(|f| f.file_offset)
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.functions.keys().map(String::as_str)
    }

    /// Bytes of the file at `address`, at most `len`, within one segment.
    pub fn code<'d>(&self, data: &'d [u8], address: u64, len: u64) -> Option<&'d [u8]> {
        let segment = self
            .segments
            .iter()
            .find(|s| s.offset_of(address).is_some())?;
        let from = segment.offset_of(address)?;
        let end = (segment.address + segment.file_size).min(address + len);
        let to = end - segment.address + segment.file_offset;
        data.get(from as usize..to as usize)
    }

    /// Where functions start, per the call frame information, sorted.
    pub fn function_starts(&self) -> &[u64] {
        &self.function_starts
    }

    /// Names the function at `address` (found by its code in a stripped
    /// file): it extends to the next function start.
    pub fn name_function(&mut self, name: &str, address: u64) {
        let Some(file_offset) = self.file_offset(address) else {
            return;
        };
        let size = self
            .next_function_start(address)
            .map_or(0, |end| end - address);
        self.functions.insert(
            name.to_owned(),
            Function {
                address,
                size,
                file_offset,
            },
        );
    }

    /// Where the function after the one at `address` starts, per the
    /// call frame information.
    pub fn next_function_start(&self, address: u64) -> Option<u64> {
        let index = self.function_starts.partition_point(|&s| s <= address);
        self.function_starts.get(index).copied()
    }

    /// Whether a function starts at `address` (per its symbols or the call
    /// frame information).
    pub fn is_function_start(&self, address: u64) -> bool {
        self.function_starts.binary_search(&address).is_ok()
            || self.functions.values().any(|f| f.address == address)
    }

    /// The first loadable segment's file offset and address: where the
    /// file's address 0 is in a process, from where that is mapped.
    pub fn anchor(&self) -> Option<(u64, u64)> {
        let first = self.segments.first()?;
        Some((first.file_offset, first.address))
    }

    /// The file offset of the byte at `address`.
    pub fn file_offset(&self, address: u64) -> Option<u64> {
        self.segments.iter().find_map(|s| s.offset_of(address))
    }

    pub fn is_plt(&self, address: u64) -> bool {
        self.plt_ranges.iter().any(|range| range.contains(address))
    }

    /// The symbol whose GOT slot `slot` is.
    pub fn got_symbol(&self, slot: u64) -> Option<&str> {
        self.got_symbols.get(&slot).map(String::as_str)
    }
}

/// The address of the one data symbol in `data`'s symbol table whose
/// name ends with `suffix` (a jemalloc global, whatever its prefix);
/// `None` where there is none or more than one.
pub fn data_symbol_ending(data: &[u8], suffix: &str) -> Option<u64> {
    let file = object::File::parse(data).ok()?;
    let mut found = file
        .symbols()
        .filter(|s| s.kind() == SymbolKind::Data)
        .filter(|s| s.name().is_ok_and(|name| name.ends_with(suffix)))
        .map(|s| s.address());
    let address = found.next()?;
    found.next().is_none().then_some(address)
}

/// The read-only data sections of an ELF file (where jemalloc's strings
/// are), or the whole file when it has no section headers: a 500 MB
/// library is not paged in whole to find a string.
pub fn read_only_data(data: &[u8]) -> Vec<&[u8]> {
    let Ok(file) = object::File::parse(data) else {
        return vec![data];
    };
    let sections: Vec<&[u8]> = file
        .sections()
        .filter(|s| {
            matches!(
                s.kind(),
                SectionKind::ReadOnlyData | SectionKind::ReadOnlyString
            )
        })
        .filter_map(|s| s.data().ok())
        .collect();
    if file.sections().next().is_none() {
        return vec![data];
    }
    sections
}

/// The function starts of an `.eh_frame_hdr` at `address`, in the encoding
/// every x86-64 toolchain writes (a table of 4-byte offsets from the
/// section); none for another encoding.
fn eh_frame_hdr_starts(address: u64, data: &[u8]) -> Vec<u64> {
    const VERSION: u8 = 1;
    const COUNT_UDATA4: u8 = 0x03;
    const TABLE_DATAREL_SDATA4: u8 = 0x3b;
    let word = |at: usize| -> Option<[u8; 4]> { data.get(at..at + 4)?.try_into().ok() };
    let (Some(&[VERSION, _, COUNT_UDATA4, TABLE_DATAREL_SDATA4]), Some(count)) =
        (data.get(..4), word(8))
    else {
        return Vec::new();
    };
    let count = u32::from_le_bytes(count) as usize;
    let mut starts: Vec<u64> = (0..count)
        .map_while(|i| word(12 + i * 8))
        .map(|w| address.wrapping_add_signed(i32::from_le_bytes(w) as i64))
        .collect();
    starts.sort_unstable();
    starts
}

#[cfg(test)]
mod tests {
    use super::*;

    #[used]
    #[unsafe(no_mangle)]
    static MEMPROBE_TEST_ONE_LIMIT: u64 = 1;
    #[used]
    #[unsafe(no_mangle)]
    static MEMPROBE_TEST_FIRST_TWIN: u64 = 2;
    #[used]
    #[unsafe(no_mangle)]
    static MEMPROBE_TEST_SECOND_TWIN: u64 = 3;

    /// This test binary's own globals, by the end of their names: one
    /// found, two sharing an ending not (which of them would be a guess).
    #[test]
    fn a_data_symbol_is_found_by_the_end_of_its_name_when_one_has_it() {
        let data = std::fs::read("/proc/self/exe").unwrap();
        assert!(data_symbol_ending(&data, "TEST_ONE_LIMIT").is_some());
        assert_eq!(data_symbol_ending(&data, "_TWIN"), None);
        assert_eq!(data_symbol_ending(&data, "NO_SUCH_GLOBAL_HERE"), None);
    }
}
