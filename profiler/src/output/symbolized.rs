//! jeprof's self-symbolized profile: a `--- symbol` section naming every
//! address, then the `heap_v2` profile. `jeprof --text FILE` reads it with no
//! binary at hand, so a profile can be sent to whoever debugs it.
use std::io::{self, Write};

use crate::{output::heap_v2, proc::parse_maps, profile::HeapProfile, symbolize::Namer};

pub fn write<W: Write>(profile: &HeapProfile, namer: &mut Namer, mut out: W) -> io::Result<()> {
    let binary = parse_maps(&profile.mapped_libraries)
        .into_iter()
        .find(|m| m.is_file())
        .and_then(|m| m.path)
        .unwrap_or_default();
    writeln!(out, "--- symbol")?;
    writeln!(out, "binary={binary}")?;
    let mut addresses: Vec<u64> = profile
        .stacks
        .iter()
        .flat_map(|s| s.frames.iter())
        // Each key as jeprof looks it up: the return address - 1 (the first
        // frame is written that way, jeprof subtracts 1 from the others).
        .map(|f| f.saturating_sub(1))
        .collect();
    addresses.sort_unstable();
    addresses.dedup();
    for address in addresses {
        // Inlined functions as jeprof writes them: outer--inner.
        let mut names = namer.names(address);
        names.reverse();
        writeln!(out, "0x{address:016x} {}", names.join("--"))?;
    }
    writeln!(out, "---")?;
    writeln!(out, "--- heap")?;
    heap_v2::write(profile, out)
}
