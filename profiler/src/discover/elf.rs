//! Function symbols of an ELF file, their file offsets (what uprobes take),
//! their code, and which symbol each PLT stub jumps to.
use std::collections::HashMap;

use object::{
    Object, ObjectSection, ObjectSegment, ObjectSymbol, ObjectSymbolTable, RelocationTarget,
    SymbolKind,
};

use crate::error::Result;

/// One function symbol.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Function {
    /// Virtual address in the file's own address space.
    pub address: u64,
    pub size: u64,
    /// File offset of the first instruction.
    pub file_offset: u64,
}

/// Defined function symbols of one ELF file, from `.dynsym` and `.symtab`,
/// with enough of the file kept to read their code.
#[derive(Debug, Default)]
pub struct FunctionSymbols {
    functions: HashMap<String, Function>,
    /// Loadable segments: (address, size in file, file offset).
    segments: Vec<(u64, u64, u64)>,
    /// PLT stub ranges, and GOT slot -> symbol for the stubs' jumps.
    plt_ranges: Vec<(u64, u64)>,
    got_symbols: HashMap<u64, String>,
    /// Whether the file has a `.symtab` (stripped files have none).
    pub has_symbol_table: bool,
}

impl FunctionSymbols {
    pub fn parse(data: &[u8]) -> Result<Self, String> {
        let file = object::File::parse(data).map_err(|e| e.to_string())?;
        let segments: Vec<(u64, u64, u64)> = file
            .segments()
            .map(|s| {
                let (offset, size) = s.file_range();
                (s.address(), size, offset)
            })
            .collect();
        let to_offset = |address: u64| {
            segments
                .iter()
                .find(|(start, size, _)| address >= *start && address < start + size)
                .map(|(start, _, file_start)| address - start + file_start)
        };
        let mut functions = HashMap::new();
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
        let plt_ranges = file
            .sections()
            .filter(|s| matches!(s.name(), Ok(".plt" | ".plt.sec" | ".plt.got")))
            .map(|s| (s.address(), s.address() + s.size()))
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
        Ok(Self {
            functions,
            segments,
            plt_ranges,
            got_symbols,
            has_symbol_table,
        })
    }

    pub fn function(&self, name: &str) -> Option<Function> {
        self.functions.get(name).copied()
    }

    pub fn offset(&self, name: &str) -> Option<u64> {
        self.function(name).map(|f| f.file_offset)
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.functions.keys().map(String::as_str)
    }

    /// Bytes of the file at `address`, at most `len`, within one segment.
    pub fn code<'d>(&self, data: &'d [u8], address: u64, len: u64) -> Option<&'d [u8]> {
        let (start, size, offset) = self
            .segments
            .iter()
            .find(|(start, size, _)| address >= *start && address < start + size)?;
        let from = (address - start + offset) as usize;
        let to = (start + size).min(address + len) - start + offset;
        data.get(from..to as usize)
    }

    pub fn is_plt(&self, address: u64) -> bool {
        self.plt_ranges
            .iter()
            .any(|(start, end)| address >= *start && address < *end)
    }

    /// The symbol whose GOT slot `slot` is.
    pub fn got_symbol(&self, slot: u64) -> Option<&str> {
        self.got_symbols.get(&slot).map(String::as_str)
    }
}
