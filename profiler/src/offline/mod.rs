//! Commands on profiles already written: `leaks` over a run's snapshots and
//! `diff` of two profiles (memprobe's or jemalloc's own dumps).
pub mod analysis;
mod error;
pub mod report;
pub mod resident;

pub use error::OfflineError;
use std::{
    collections::BTreeMap,
    io::Write,
    path::{Path, PathBuf},
};

use crate::{
    offline::analysis::{LeakOptions, diff, rank_sites, write_diff, write_leak_report},
    output::WriteError,
    output::heap_v2::read::{ParsedHeap, parse},
    symbolize::Namer,
};

/// Frames of a site shown in reports.
const SITE_DEPTH: usize = 3;

pub fn read_heap(path: &Path) -> Result<ParsedHeap, OfflineError> {
    let text = std::fs::read(path).map_err(|cause| OfflineError::Read {
        path: path.to_owned(),
        cause,
    })?;
    parse(&String::from_utf8_lossy(&text)).map_err(|cause| OfflineError::BadProfile {
        path: path.to_owned(),
        cause,
    })
}

/// `memprobe.<pid>.<seq>.heap` files in `dir`, by pid, in sequence order.
pub fn snapshots_by_pid(dir: &Path) -> Result<BTreeMap<u32, Vec<PathBuf>>, OfflineError> {
    let entries = std::fs::read_dir(dir).map_err(|cause| OfflineError::Read {
        path: dir.to_owned(),
        cause,
    })?;
    let mut runs: BTreeMap<u32, Vec<(u64, PathBuf)>> = BTreeMap::new();
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let mut parts = name.split('.');
        if let (Some("memprobe"), Some(pid), Some(seq), Some("heap"), None) = (
            parts.next(),
            parts.next().and_then(|p| p.parse().ok()),
            parts.next().and_then(|s| s.parse().ok()),
            parts.next(),
            parts.next(),
        ) {
            runs.entry(pid).or_default().push((seq, entry.path()));
        }
    }
    Ok(runs
        .into_iter()
        .map(|(pid, mut files)| {
            files.sort();
            (pid, files.into_iter().map(|(_, p)| p).collect())
        })
        .collect())
}

/// Ranks the sites of one process's snapshots; writes the table.
pub fn leaks_of<W: Write>(
    files: &[PathBuf],
    options: &LeakOptions,
    binaries: &Binaries,
    most: usize,
    out: W,
) -> Result<(), OfflineError> {
    let snapshots = files
        .iter()
        .map(|f| read_heap(f))
        .collect::<Result<Vec<_>, OfflineError>>()?;
    // In-use figures are followed until a snapshot says what was tracked
    // instead (its `# tracking:` note: frees dropped for the budget,
    // `--track allocations`), where all that was allocated counts as in
    // use: sites are ranked over the snapshots before it.
    let followed = snapshots
        .iter()
        .take_while(|s| s.notes.tracking.is_none())
        .count();
    let sites = rank_sites(&snapshots[..followed], options);
    let maps = snapshots
        .last()
        .map(|s| s.mapped_libraries.as_str())
        .unwrap_or("");
    let mut namer = match snapshots.last() {
        Some(last) => namer_for(last, binaries),
        None => binaries.namer(maps),
    };
    let mut out = out;
    let unfollowed = snapshots.len() - followed;
    if unfollowed > 0 {
        writeln!(
            out,
            "frees not followed in the last {unfollowed} of {} snapshots (their `# tracking:` \
             note): {}",
            snapshots.len(),
            match followed {
                0 | 1 => "no site ranked".to_owned(),
                n => format!("sites ranked over the first {n}"),
            }
        )
        .map_err(OfflineError::Output)?;
    }
    if followed >= 2 {
        write_leak_report(&sites, most, |f| namer.site(f, SITE_DEPTH), &mut out)
            .map_err(OfflineError::Output)?;
    }
    let Some((parts, sites)) = resident::resident_growth(&snapshots) else {
        return Ok(());
    };
    resident::write(&parts, &sites, |f| namer.site(f, SITE_DEPTH), out)
        .map_err(OfflineError::Output)
}

/// `memprobe leaks DIR`: per process in DIR, its sites ranked.
pub fn leaks<W: Write>(
    dir: &Path,
    pid: Option<u32>,
    options: &LeakOptions,
    binaries: &Binaries,
    mut out: W,
) -> Result<(), OfflineError> {
    let runs = snapshots_by_pid(dir)?;
    let runs: Vec<_> = runs
        .into_iter()
        .filter(|(p, _)| pid.is_none_or(|want| want == *p))
        .collect();
    if runs.is_empty() {
        return Err(OfflineError::NoSnapshots(dir.to_owned()));
    }
    for (pid, files) in runs {
        writeln!(out, "pid {pid}: {} snapshots", files.len()).map_err(OfflineError::Output)?;
        leaks_of(&files, options, binaries, 20, &mut out)?;
        writeln!(out).map_err(OfflineError::Output)?;
    }
    Ok(())
}

/// A namer for a parsed profile: its own symbols first, then its binaries.
/// Where an offline command looks for the binaries of a profile and for
/// their debug files.
#[derive(Clone, Debug, Default)]
pub struct Binaries {
    /// Look for the binaries under this folder instead of `/` (jeprof's
    /// `--lib_prefix`).
    pub lib_prefix: Option<PathBuf>,
    /// Debug files here too: `.build-id/xx/rest.debug` by build ID, or by
    /// the binary's debuglink name.
    pub debug_dir: Option<PathBuf>,
}

impl Binaries {
    fn namer(&self, mapped_libraries: &str) -> Namer {
        Namer::new(mapped_libraries, self.lib_prefix.clone()).with_debug_dir(self.debug_dir.clone())
    }
}

fn namer_for(heap: &ParsedHeap, binaries: &Binaries) -> Namer {
    binaries
        .namer(&heap.mapped_libraries)
        .with_symbols(&heap.symbols)
        .with_python(&heap.python_frames)
}

/// `memprobe report FILE`: jeprof --text's table, computed here.
pub fn report<W: Write>(
    file: &Path,
    base: Option<&Path>,
    measure: crate::offline::report::Measure,
    binaries: &Binaries,
    most: usize,
    out: W,
) -> Result<(), OfflineError> {
    let heap = read_heap(file)?;
    let base = base.map(read_heap).transpose()?;
    let account = heap.account.clone();
    let heap = match &base {
        Some(base) => crate::offline::report::subtract(&heap, base),
        None => heap,
    };
    let mut namer = namer_for(&heap, binaries);
    let (rows, total) = crate::offline::report::rows(&heap, measure, |frames| namer.stack(frames));
    let mut out = out;
    crate::offline::report::write(&rows, total, measure, most, &mut out)
        .map_err(OfflineError::Output)?;
    let Some(account) = account else {
        return Ok(());
    };
    let base = base.and_then(|b| b.account);
    let name = |frames: &[u64]| {
        let names = namer.stack(frames);
        names.into_iter().take(4).collect::<Vec<_>>().join(" < ")
    };
    crate::offline::report::write_memory(&account, base.as_ref(), name, out)
        .map_err(OfflineError::Output)
}

/// `memprobe convert FILE --to pprof|folded`.
pub fn convert<W: Write>(
    file: &Path,
    to: crate::output::Format,
    binaries: &Binaries,
    out: W,
) -> Result<(), OfflineError> {
    use crate::{
        output::{Format, folded, pprof},
        profile::HeapProfile,
    };
    let heap = read_heap(file)?;
    let mut namer = namer_for(&heap, binaries);
    let profile = HeapProfile {
        pid: 0,
        sample_interval: heap.sample_interval,
        stacks: heap.stacks.clone(),
        mapped_libraries: heap.mapped_libraries.clone(),
        notes: heap.notes.clone(),
        jit_symbols: Vec::new(),
        python_frames: heap.python_frames.clone(),
        memory: None,
        account: None,
    };
    let written = match to {
        Format::Pprof => pprof::write(&profile, &mut namer, out),
        Format::Folded => folded::write(&named_inuse(&heap, &mut namer), out),
        Format::Heap | Format::Svg | Format::SymbolizedHeap => {
            return Err(OfflineError::Output(std::io::Error::other(format!(
                "convert writes pprof or folded stacks, not {}",
                to.extension()
            ))));
        }
    };
    written.map_err(OfflineError::Output)
}

/// `memprobe diff OLD NEW`: growth per site, in text.
pub fn diff_files<W: Write>(
    old: &Path,
    new: &Path,
    binaries: &Binaries,
    out: W,
) -> Result<(), OfflineError> {
    let (before, after) = (read_heap(old)?, read_heap(new)?);
    let rows = diff(&before, &after);
    let mut namer = namer_for(&after, binaries);
    write_diff(&rows, 30, |f| namer.site(f, SITE_DEPTH), out).map_err(OfflineError::Output)
}

/// A profile's stacks, named, with their in-use bytes.
fn named_inuse(heap: &ParsedHeap, namer: &mut Namer) -> Vec<crate::output::folded::NamedStack> {
    heap.stacks
        .iter()
        .map(|s| {
            (
                namer.stack(&s.frames),
                s.inuse_bytes.round().max(0.0) as u64,
            )
        })
        .collect()
}

/// Folded lines of a profile's in-use bytes, named.
fn folded_inuse(heap: &ParsedHeap, namer: &mut Namer) -> Vec<String> {
    crate::output::folded::lines(&named_inuse(heap, namer))
}

/// `memprobe flamegraph FILE [--base OLD] -o OUT.svg`: a flame graph of the
/// bytes in use; with a base, a differential one (red grew, blue shrank).
pub fn flamegraph_file(
    file: &Path,
    base: Option<&Path>,
    binaries: &Binaries,
    output: &Path,
) -> Result<(), OfflineError> {
    let after = read_heap(file)?;
    let mut namer = namer_for(&after, binaries);
    let after_lines = folded_inuse(&after, &mut namer);
    let mut svg = Vec::new();
    let written = match base {
        None => crate::output::flamegraph::write(&after_lines, "Bytes in use", &mut svg),
        Some(base) => {
            let before = read_heap(base)?;
            let before_lines = folded_inuse(&before, &mut namer);
            crate::output::flamegraph::write_differential(
                &before_lines,
                &after_lines,
                "Bytes in use: growth since the base (red) and shrinkage (blue)",
                &mut svg,
            )
        }
    };
    let write_error = |cause| {
        OfflineError::Write(WriteError {
            path: output.to_owned(),
            cause,
        })
    };
    written.map_err(write_error)?;
    std::fs::write(output, svg).map_err(write_error)
}
