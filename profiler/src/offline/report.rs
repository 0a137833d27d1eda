//! `memprobe report`: the top functions of a profile by flat and cumulative
//! bytes or objects, in `jeprof --text`'s columns and with its numbers.
use std::{
    collections::{HashMap, HashSet},
    io::{self, Write},
};

use crate::{output::heap_v2::read::ParsedHeap, profile::MemoryAccount};

/// Which estimate to rank by, as jeprof's `--inuse_space` and friends.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Measure {
    #[default]
    InuseSpace,
    InuseObjects,
    AllocSpace,
    AllocObjects,
}

impl Measure {
    fn of(self, stack: &crate::output::heap_v2::read::ParsedStack) -> f64 {
        match self {
            Measure::InuseSpace => stack.inuse_bytes,
            Measure::InuseObjects => stack.inuse_objects,
            Measure::AllocSpace => stack.alloc_bytes,
            Measure::AllocObjects => stack.alloc_objects,
        }
    }

    fn is_space(self) -> bool {
        matches!(self, Measure::InuseSpace | Measure::AllocSpace)
    }
}

/// One function's row.
#[derive(Clone, Debug, PartialEq)]
pub struct Row {
    pub name: String,
    pub flat: f64,
    pub cum: f64,
}

/// Flat (as the leaf) and cumulative (anywhere in the stack, once per stack)
/// totals per function, largest flat first, and the total.
pub fn rows(
    heap: &ParsedHeap,
    measure: Measure,
    mut names: impl FnMut(&[u64]) -> Vec<String>,
) -> (Vec<Row>, f64) {
    let mut flat: HashMap<String, f64> = HashMap::new();
    let mut cum: HashMap<String, f64> = HashMap::new();
    let mut total = 0.0;
    for stack in &heap.stacks {
        let value = measure.of(stack);
        // Differences against a base may be negative, as with jeprof --base.
        if value == 0.0 {
            continue;
        }
        total += value;
        let frames = names(&stack.frames);
        if let Some(leaf) = frames.first() {
            *flat.entry(leaf.clone()).or_default() += value;
        }
        let unique: HashSet<&String> = frames.iter().collect();
        for name in unique {
            *cum.entry(name.clone()).or_default() += value;
        }
    }
    let mut rows: Vec<Row> = cum
        .into_iter()
        .map(|(name, cum)| Row {
            flat: flat.get(&name).copied().unwrap_or(0.0),
            name,
            cum,
        })
        .collect();
    rows.sort_by(|a, b| {
        b.flat
            .total_cmp(&a.flat)
            .then(b.cum.total_cmp(&a.cum))
            .then(a.name.cmp(&b.name))
    });
    (rows, total)
}

/// `new` minus `base`, per identical stack, as `jeprof --base` computes it:
/// each profile un-sampled on its own, then subtracted.
pub fn subtract(new: &ParsedHeap, base: &ParsedHeap) -> ParsedHeap {
    use crate::output::heap_v2::read::ParsedStack;
    let mut stacks: Vec<ParsedStack> = new.stacks.clone();
    let mut index: HashMap<Vec<u64>, usize> = stacks
        .iter()
        .enumerate()
        .map(|(i, s)| (s.frames.clone(), i))
        .collect();
    for old in &base.stacks {
        let i = *index.entry(old.frames.clone()).or_insert_with(|| {
            stacks.push(ParsedStack {
                frames: old.frames.clone(),
                inuse_objects: 0.0,
                inuse_bytes: 0.0,
                alloc_objects: 0.0,
                alloc_bytes: 0.0,
                oldest_live_s: None,
            });
            stacks.len() - 1
        });
        let stack = &mut stacks[i];
        stack.inuse_objects -= old.inuse_objects;
        stack.inuse_bytes -= old.inuse_bytes;
        stack.alloc_objects -= old.alloc_objects;
        stack.alloc_bytes -= old.alloc_bytes;
    }
    ParsedHeap {
        stacks,
        ..new.clone()
    }
}

/// Writes the rows like `jeprof --text`: MB (MiB) with one decimal for
/// space, counts for objects; flat, flat%, sum%, cum, cum%, name.
pub fn write<W: Write>(
    rows: &[Row],
    total: f64,
    measure: Measure,
    most: usize,
    mut out: W,
) -> io::Result<()> {
    let scale = if measure.is_space() {
        1024.0 * 1024.0
    } else {
        1.0
    };
    let unit = if measure.is_space() { " MB" } else { "" };
    // As jeprof: a share of the total even when a --base makes it negative.
    let percent = |v: f64| if total != 0.0 { 100.0 * v / total } else { 0.0 };
    writeln!(out, "Total: {:.1}{unit}", total / scale)?;
    let mut sum = 0.0;
    for row in rows.iter().take(most) {
        sum += row.flat;
        writeln!(
            out,
            "{:>8.1} {:>5.1}% {:>5.1}% {:>8.1} {:>5.1}% {}",
            row.flat / scale,
            percent(row.flat),
            percent(sum),
            row.cum / scale,
            percent(row.cum),
            row.name
        )?;
    }
    Ok(())
}

/// The memory account under the sites, pmap-like: each part of the
/// resident total with its share (and its change since `base`'s, given
/// one), then the direct mappings by site, `name` naming their stacks.
pub fn write_memory<W: Write>(
    account: &MemoryAccount,
    base: Option<&MemoryAccount>,
    mut name: impl FnMut(&[u64]) -> String,
    mut out: W,
) -> io::Result<()> {
    let mib = |bytes: u64| bytes as f64 / (1024.0 * 1024.0);
    let share = |bytes: u64| 100.0 * bytes as f64 / account.resident.max(1) as f64;
    writeln!(out)?;
    writeln!(
        out,
        "Resident: {:.1} MB, accounted for:",
        mib(account.resident)
    )?;
    let before: Vec<(&str, u64, String)> = base.map_or(Vec::new(), MemoryAccount::parts);
    for (part, bytes, detail) in account.parts() {
        let change = match before.iter().find(|(p, ..)| *p == part) {
            Some((_, then, _)) => format!(" {:>+9.1}", mib(bytes) - mib(*then)),
            None => String::new(),
        };
        let detail = if detail.is_empty() {
            String::new()
        } else {
            format!("  ({detail})")
        };
        writeln!(
            out,
            "{:>8.1} {:>5.1}%{change}  {part}{detail}",
            mib(bytes),
            share(bytes)
        )?;
    }
    if account.sites.is_empty() {
        return Ok(());
    }
    writeln!(out)?;
    writeln!(out, "Direct mappings (MB):")?;
    writeln!(
        out,
        "{:>8} {:>9} {:>8}  site",
        "resident", "mapped", "mappings"
    )?;
    for site in &account.sites {
        writeln!(
            out,
            "{:>8.1} {:>9.1} {:>8}  {}",
            mib(site.resident),
            mib(site.mapped),
            site.mappings,
            name(&site.frames)
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::output::heap_v2::read::ParsedStack;

    #[test]
    fn flat_counts_leaves_and_cum_counts_each_stack_once() {
        let stack = |frames: Vec<u64>, bytes: f64| ParsedStack {
            frames,
            inuse_objects: 1.0,
            inuse_bytes: bytes,
            alloc_objects: 1.0,
            alloc_bytes: bytes,
            oldest_live_s: None,
        };
        let heap = ParsedHeap {
            stacks: vec![
                stack(vec![1, 9], 3.0 * 1048576.0),
                stack(vec![2, 9, 9], 1.0 * 1048576.0),
            ],
            ..Default::default()
        };
        let names = |frames: &[u64]| frames.iter().map(|f| format!("f{f}")).collect();
        let (rows, total) = rows(&heap, Measure::InuseSpace, names);
        assert_eq!(total, 4.0 * 1048576.0);
        assert_eq!(rows[0].name, "f1");
        let f9 = rows.iter().find(|r| r.name == "f9").unwrap();
        assert_eq!((f9.flat, f9.cum), (0.0, 4.0 * 1048576.0));
        let mut out = Vec::new();
        write(&rows, total, Measure::InuseSpace, 10, &mut out).unwrap();
        let text = String::from_utf8(out).unwrap();
        assert!(
            text.starts_with("Total: 4.0 MB\n     3.0  75.0%  75.0%      3.0  75.0% f1\n"),
            "{text}"
        );
    }
}
