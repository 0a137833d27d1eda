//! Function symbols of an ELF file and their file offsets (what uprobes take).
use std::{collections::HashMap, path::Path};

use object::{Object, ObjectSegment, ObjectSymbol, SymbolKind};

use crate::error::{Error, Result};

/// Defined function symbols of one ELF file, from `.dynsym` and `.symtab`.
#[derive(Debug, Default)]
pub struct FunctionSymbols {
    /// Name -> file offset of the first instruction.
    offsets: HashMap<String, u64>,
    /// Whether the file has a `.symtab` (stripped files have none).
    pub has_symbol_table: bool,
}

impl FunctionSymbols {
    pub fn read(path: &Path) -> Result<Self> {
        let data = std::fs::read(path).map_err(|source| Error::Read {
            path: path.to_owned(),
            source,
        })?;
        Self::parse(&data).map_err(|message| Error::Elf {
            path: path.to_owned(),
            message,
        })
    }

    pub fn parse(data: &[u8]) -> Result<Self, String> {
        let file = object::File::parse(data).map_err(|e| e.to_string())?;
        // File offsets come from the loadable segments holding each address.
        let segments: Vec<(u64, u64, u64)> = file
            .segments()
            .map(|s| (s.address(), s.size(), s.file_range().0))
            .collect();
        let to_offset = |address: u64| {
            segments
                .iter()
                .find(|(start, size, _)| address >= *start && address < start + size)
                .map(|(start, _, file_start)| address - start + file_start)
        };
        let mut offsets = HashMap::new();
        for symbol in file.dynamic_symbols().chain(file.symbols()) {
            if symbol.kind() != SymbolKind::Text || symbol.is_undefined() || symbol.address() == 0 {
                continue;
            }
            let (Ok(name), Some(offset)) = (symbol.name(), to_offset(symbol.address())) else {
                continue;
            };
            offsets.entry(name.to_owned()).or_insert(offset);
        }
        let has_symbol_table = file.symbols().next().is_some();
        Ok(Self {
            offsets,
            has_symbol_table,
        })
    }

    pub fn offset(&self, name: &str) -> Option<u64> {
        self.offsets.get(name).copied()
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.offsets.keys().map(String::as_str)
    }

    pub fn is_empty(&self) -> bool {
        self.offsets.is_empty()
    }
}
