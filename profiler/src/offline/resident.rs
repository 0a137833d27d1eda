//! How a process's resident memory grew across its snapshots, by part of
//! its memory account and by direct-mapping site: a flat heap under a
//! climbing resident total is a finding in itself (fragmentation, or
//! mappings the heap profile does not see).
use std::{collections::BTreeMap, io, io::Write};

use crate::{offline::analysis::slope, output::heap_v2::read::ParsedHeap, units::bytes};

/// One part's (or site's) resident bytes across the snapshots.
#[derive(Clone, Debug, PartialEq)]
pub struct Growth {
    pub name: String,
    /// Its direct-mapping site's frames; empty for a part.
    pub frames: Vec<u64>,
    pub first: u64,
    pub last: u64,
    /// Least-squares growth, bytes per second.
    pub slope: f64,
}

/// Resident growth of `snapshots` (one process, in order) by part and by
/// site, fastest first; `None` where fewer than two have an account.
pub fn resident_growth(snapshots: &[ParsedHeap]) -> Option<(Vec<Growth>, Vec<Growth>)> {
    let accounted: Vec<(f64, &crate::profile::MemoryAccount)> = snapshots
        .iter()
        .enumerate()
        .filter_map(|(i, s)| Some((s.notes.elapsed_s.unwrap_or(i as f64), s.account.as_ref()?)))
        .collect();
    if accounted.len() < 2 {
        return None;
    }
    let times: Vec<f64> = accounted.iter().map(|(t, _)| *t).collect();
    let mut parts: BTreeMap<String, (Vec<u64>, Vec<f64>)> = BTreeMap::new();
    let mut sites: BTreeMap<String, (Vec<u64>, Vec<f64>)> = BTreeMap::new();
    for (i, (_, account)) in accounted.iter().enumerate() {
        let total = [("resident", account.resident, String::new())];
        for (name, value, _) in total.into_iter().chain(account.parts()) {
            let series = parts
                .entry(name.to_owned())
                .or_insert_with(|| (Vec::new(), vec![0.0; accounted.len()]));
            series.1[i] = value as f64;
        }
        for site in &account.sites {
            let series = sites
                .entry(site.name.clone())
                .or_insert_with(|| (site.frames.clone(), vec![0.0; accounted.len()]));
            series.1[i] = site.resident as f64;
        }
    }
    let grown = |series: BTreeMap<String, (Vec<u64>, Vec<f64>)>, frames_kept: bool| {
        let mut grown: Vec<Growth> = series
            .into_iter()
            .map(|(name, (frames, values))| Growth {
                slope: slope(&times, &values),
                first: values.first().copied().unwrap_or(0.0) as u64,
                last: values.last().copied().unwrap_or(0.0) as u64,
                frames: if frames_kept { frames } else { Vec::new() },
                name,
            })
            .collect();
        // The total first, then the fastest growing.
        grown.sort_by(|a, b| {
            (a.name != "resident")
                .cmp(&(b.name != "resident"))
                .then(b.slope.total_cmp(&a.slope))
        });
        grown
    };
    Some((grown(parts, false), grown(sites, true)))
}

/// What the growth says: which part grew most, and whether the heap did.
pub fn finding(parts: &[Growth]) -> Option<String> {
    let of = |name: &str| parts.iter().find(|g| g.name == name);
    let resident = of("resident")?;
    let heap = of("heap in use")?;
    if resident.slope <= 0.0 {
        return None;
    }
    let top = parts.iter().find(|g| g.name != "resident")?;
    let flat_heap = heap.slope < 0.1 * resident.slope;
    let why = match top.name.as_str() {
        "allocator footprint" => {
            "the allocators keep memory they no longer use (fragmentation, \
                                  caches, retained pages)"
        }
        "direct mappings" => "memory the program maps itself, which no heap profile sees",
        "heap in use" => "the heap: see the sites above",
        _ => "",
    };
    let head = if flat_heap {
        "the heap stays flat while resident memory climbs"
    } else {
        "resident memory climbs"
    };
    Some(format!(
        "{head}, {}/s; most of it {} ({}/s){}{why}",
        bytes(resident.slope),
        top.name,
        bytes(top.slope),
        if why.is_empty() { "" } else { ": " },
    ))
}

/// The growth as two tables, parts then sites; `name` names a site.
pub fn write<W: Write>(
    parts: &[Growth],
    sites: &[Growth],
    mut name: impl FnMut(&[u64]) -> String,
    mut out: W,
) -> io::Result<()> {
    writeln!(out)?;
    writeln!(
        out,
        "{:>12} {:>11} {:>11}  resident memory",
        "growth/s", "first", "last"
    )?;
    // Parts that held nothing throughout say nothing.
    for part in parts.iter().filter(|p| p.first > 0 || p.last > 0) {
        let row = growth_row(part);
        writeln!(out, "{row}  {}", part.name)?;
    }
    if let Some(finding) = finding(parts) {
        writeln!(out, "finding: {finding}")?;
    }
    if sites.is_empty() {
        return Ok(());
    }
    writeln!(
        out,
        "{:>12} {:>11} {:>11}  direct mapping site",
        "growth/s", "first", "last"
    )?;
    for site in sites {
        let row = growth_row(site);
        let named = name(&site.frames);
        let named = if named.is_empty() { &site.name } else { &named };
        writeln!(out, "{row}  {named}")?;
    }
    Ok(())
}

fn growth_row(growth: &Growth) -> String {
    let sign = if growth.slope < 0.0 { "-" } else { "+" };
    format!(
        "{:>12} {:>11} {:>11}",
        format!("{sign}{}/s", bytes(growth.slope.abs())),
        bytes(growth.first as f64),
        bytes(growth.last as f64)
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::MemoryAccount;

    fn snapshot(at: f64, heap: u64, footprint: u64) -> ParsedHeap {
        let mut parsed = ParsedHeap::default();
        parsed.notes.elapsed_s = Some(at);
        parsed.account = Some(MemoryAccount {
            resident: heap + footprint,
            heap_in_use: heap,
            allocator_footprint: footprint,
            ..MemoryAccount::default()
        });
        parsed
    }

    #[test]
    fn a_flat_heap_under_a_climbing_footprint_is_said() {
        let snapshots: Vec<ParsedHeap> = (0..4)
            .map(|i| snapshot(i as f64 * 10.0, 32 << 20, (8 + 8 * i) << 20))
            .collect();
        let (parts, sites) = resident_growth(&snapshots).unwrap();
        assert!(sites.is_empty());
        assert_eq!(parts[0].name, "resident");
        assert_eq!(parts[1].name, "allocator footprint");
        let finding = finding(&parts).unwrap();
        assert!(finding.starts_with("the heap stays flat"), "{finding}");
        assert!(finding.contains("allocator footprint"), "{finding}");
    }
}
