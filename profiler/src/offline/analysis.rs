//! Reading a series of snapshots the way users do by eye: which sites keep
//! growing and never shrink (likely leaks), which are large but stable
//! (working sets), which were released after a burst; and diffs of two.
use std::{collections::HashMap, io, io::Write, time::Duration};

use crate::{output::heap_v2::read::ParsedHeap, units::bytes};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Trend {
    /// Grew across the snapshots and never went down.
    LikelyLeak,
    /// Large but about the same size throughout.
    WorkingSet,
    /// Rose, then was given back.
    ReleasedAfterBurst,
    /// None of the above.
    Fluctuating,
}

impl Trend {
    pub fn label(self) -> &'static str {
        match self {
            Trend::LikelyLeak => "likely leak",
            Trend::WorkingSet => "working set",
            Trend::ReleasedAfterBurst => "released after burst",
            Trend::Fluctuating => "fluctuating",
        }
    }
}

/// One site's in-use bytes across the snapshots.
#[derive(Clone, Debug)]
pub struct SiteTrend {
    pub frames: Vec<u64>,
    /// Estimated bytes in use, one per snapshot.
    pub inuse: Vec<f64>,
    /// The sampling variance of each estimate (see [`sampling_variance`]).
    pub inuse_variance: Vec<f64>,
    /// Least-squares growth in bytes per second.
    pub slope: f64,
    pub ever_shrank: bool,
    /// Age of the oldest live sampled allocation in the last snapshot.
    pub oldest_live_s: Option<f64>,
    pub trend: Trend,
}

/// Options of the leak ranking.
#[derive(Clone, Debug, Default)]
pub struct LeakOptions {
    /// Keep only sites whose oldest live allocation is older than this.
    pub min_age: Option<Duration>,
}

/// Classifies every site of `snapshots` (one process, in order) and ranks
/// likely leaks first, fastest growing first, then the rest by size.
pub fn rank_sites(snapshots: &[ParsedHeap], options: &LeakOptions) -> Vec<SiteTrend> {
    let times: Vec<f64> = snapshots
        .iter()
        .enumerate()
        .map(|(i, s)| s.notes.elapsed_s.unwrap_or(i as f64))
        .collect();
    let mut series: HashMap<Vec<u64>, SiteTrend> = HashMap::new();
    for (i, snapshot) in snapshots.iter().enumerate() {
        for stack in &snapshot.stacks {
            let site = series
                .entry(stack.frames.clone())
                .or_insert_with(|| SiteTrend {
                    frames: stack.frames.clone(),
                    inuse: vec![0.0; snapshots.len()],
                    inuse_variance: vec![0.0; snapshots.len()],
                    slope: 0.0,
                    ever_shrank: false,
                    oldest_live_s: None,
                    trend: Trend::Fluctuating,
                });
            site.inuse[i] = stack.inuse_bytes;
            site.inuse_variance[i] = sampling_variance(
                stack.inuse_objects,
                stack.inuse_bytes,
                snapshot.sample_interval as f64,
            );
            if i + 1 == snapshots.len() {
                site.oldest_live_s = stack.oldest_live_s;
            }
        }
    }
    let interval = snapshots.first().map_or(0, |s| s.sample_interval) as f64;
    let mut sites: Vec<SiteTrend> = series
        .into_values()
        .filter(|s| s.inuse.iter().any(|&b| b > 0.0))
        .filter(|s| {
            options
                .min_age
                .is_none_or(|min| s.oldest_live_s.is_some_and(|age| age >= min.as_secs_f64()))
        })
        .map(|mut s| {
            classify(&mut s, &times, interval);
            s
        })
        .collect();
    sites.sort_by(|a, b| {
        let leak = |s: &SiteTrend| s.trend == Trend::LikelyLeak;
        leak(b).cmp(&leak(a)).then(if leak(a) {
            b.slope.total_cmp(&a.slope)
        } else {
            last(b).total_cmp(&last(a))
        })
    });
    sites
}

fn last(site: &SiteTrend) -> f64 {
    site.inuse.last().copied().unwrap_or(0.0)
}

/// The sampling variance of an estimate of `bytes` in use by `objects`
/// objects, sampled every `interval` bytes on average. Each object of the
/// mean size `z` was sampled with probability `p = 1 - exp(-z/interval)`
/// and then stands for `1/p` objects, so the estimate's variance is
/// `objects * (1 - p) / p * z^2`: large for many small objects at a coarse
/// interval, zero for objects much larger than the interval.
pub fn sampling_variance(objects: f64, bytes: f64, interval: f64) -> f64 {
    if objects <= 0.0 || bytes <= 0.0 || interval <= 0.0 {
        return 0.0;
    }
    let size = bytes / objects;
    let p = -(-size / interval).exp_m1();
    objects * (1.0 - p) / p * size * size
}

/// Differences smaller than this many standard deviations of the sampling
/// noise are not taken for growth or shrinkage.
const NOISE_SIGMAS: f64 = 3.0;

fn classify(site: &mut SiteTrend, times: &[f64], interval: f64) {
    let peak = site.inuse.iter().copied().fold(0.0, f64::max);
    let variance = &site.inuse_variance;
    // A change between two snapshots is real beyond a few standard
    // deviations of both estimates' noise, and at least two samples.
    let noise_between = |i: usize, j: usize| {
        (NOISE_SIGMAS * (variance[i] + variance[j]).sqrt()).max(2.0 * interval)
    };
    let n = site.inuse.len();
    site.ever_shrank = (1..n).any(|i| site.inuse[i] < site.inuse[i - 1] - noise_between(i - 1, i));
    site.slope = slope(times, &site.inuse);
    let first = site.inuse[0];
    let end = last(site);
    let growth_noise = noise_between(0, n - 1);
    let peak_at = site.inuse.iter().position(|&b| b == peak).unwrap_or(0);
    let noise = noise_between(peak_at, peak_at);
    // The lowest after the first snapshot (which may be before the set
    // was built), and how far from the peak it may read by noise alone:
    // a churned set's objects are a fresh draw of samples every snapshot.
    let low_at = (n.min(1)..n)
        .min_by(|&a, &b| site.inuse[a].total_cmp(&site.inuse[b]))
        .unwrap_or(0);
    let settled_low = site.inuse[low_at];
    let low_noise = noise_between(peak_at, low_at);
    site.trend =
        if !site.ever_shrank && end - first > growth_noise.max(0.1 * peak) && site.slope > 0.0 {
            Trend::LikelyLeak
        } else if peak > noise && end <= 0.25 * peak {
            Trend::ReleasedAfterBurst
        } else if end > noise && peak - settled_low <= 0.3 * peak + low_noise {
            Trend::WorkingSet
        } else {
            Trend::Fluctuating
        };
}

pub(super) fn slope(times: &[f64], values: &[f64]) -> f64 {
    let n = times.len() as f64;
    if times.len() < 2 {
        return 0.0;
    }
    let mean_t = times.iter().sum::<f64>() / n;
    let mean_v = values.iter().sum::<f64>() / n;
    let (mut num, mut den) = (0.0, 0.0);
    for (t, v) in times.iter().zip(values) {
        num += (t - mean_t) * (v - mean_v);
        den += (t - mean_t) * (t - mean_t);
    }
    if den > 0.0 { num / den } else { 0.0 }
}

/// Writes the ranking as a table; `name` names a site from its frames.
pub fn write_leak_report<W: Write>(
    sites: &[SiteTrend],
    most: usize,
    mut name: impl FnMut(&[u64]) -> String,
    mut out: W,
) -> io::Result<()> {
    writeln!(
        out,
        "{:>4}  {:<21} {:>11} {:>12} {:>7} {:>11}  site",
        "rank", "trend", "in use now", "growth/s", "shrank", "oldest live"
    )?;
    for (rank, site) in sites.iter().take(most).enumerate() {
        writeln!(
            out,
            "{:>4}  {:<21} {:>11} {:>12} {:>7} {:>11}  {}",
            rank + 1,
            site.trend.label(),
            bytes(last(site)),
            format!("{}/s", signed_bytes(site.slope)),
            if site.ever_shrank { "yes" } else { "no" },
            site.oldest_live_s
                .map_or("-".to_owned(), |a| format!("{a:.1} s")),
            name(&site.frames)
        )?;
    }
    Ok(())
}

fn signed_bytes(value: f64) -> String {
    if value < 0.0 {
        format!("-{}", bytes(-value))
    } else {
        format!("+{}", bytes(value))
    }
}

/// In-use bytes per stack in two profiles, largest growth first.
pub fn diff(old: &ParsedHeap, new: &ParsedHeap) -> Vec<(Vec<u64>, f64, f64)> {
    let mut sites: HashMap<&[u64], (f64, f64)> = HashMap::new();
    for stack in &old.stacks {
        sites.entry(&stack.frames).or_default().0 += stack.inuse_bytes;
    }
    for stack in &new.stacks {
        sites.entry(&stack.frames).or_default().1 += stack.inuse_bytes;
    }
    let mut rows: Vec<(Vec<u64>, f64, f64)> = sites
        .into_iter()
        .map(|(frames, (a, b))| (frames.to_vec(), a, b))
        .filter(|(_, a, b)| a != b)
        .collect();
    rows.sort_by(|x, y| (y.2 - y.1).total_cmp(&(x.2 - x.1)));
    rows
}

pub fn write_diff<W: Write>(
    rows: &[(Vec<u64>, f64, f64)],
    most: usize,
    mut name: impl FnMut(&[u64]) -> String,
    mut out: W,
) -> io::Result<()> {
    let total: f64 = rows.iter().map(|(_, a, b)| b - a).sum();
    writeln!(out, "total in use: {}", signed_bytes(total))?;
    writeln!(
        out,
        "{:>12} {:>11} {:>11}  site",
        "change", "before", "after"
    )?;
    for (frames, before, after) in rows.iter().take(most) {
        writeln!(
            out,
            "{:>12} {:>11} {:>11}  {}",
            signed_bytes(after - before),
            bytes(*before),
            bytes(*after),
            name(frames)
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{output::heap_v2::read::ParsedStack, profile::ProfileNotes};

    fn snapshot(t: f64, sites: &[(u64, f64)]) -> ParsedHeap {
        ParsedHeap {
            sample_interval: 65536,
            notes: ProfileNotes {
                elapsed_s: Some(t),
                ..ProfileNotes::default()
            },
            stacks: sites
                .iter()
                .map(|&(frame, inuse)| ParsedStack {
                    frames: vec![frame],
                    inuse_objects: 1.0,
                    inuse_bytes: inuse,
                    alloc_objects: 1.0,
                    alloc_bytes: inuse,
                    oldest_live_s: Some(t),
                })
                .collect(),
            ..ParsedHeap::default()
        }
    }

    #[test]
    fn the_three_trends_users_tell_apart() {
        const MIB: f64 = 1048576.0;
        let series: Vec<ParsedHeap> = (0..6)
            .map(|i| {
                let t = i as f64;
                let burst = if (1..3).contains(&i) { 16.0 * MIB } else { 0.0 };
                snapshot(t, &[(1, 2.5 * MIB * (t + 1.0)), (2, 8.0 * MIB), (3, burst)])
            })
            .collect();
        let ranked = rank_sites(&series, &LeakOptions::default());
        let trend_of = |frame| ranked.iter().find(|s| s.frames[0] == frame).unwrap().trend;
        assert_eq!(ranked[0].frames, [1]);
        assert_eq!(trend_of(1), Trend::LikelyLeak);
        assert_eq!(trend_of(2), Trend::WorkingSet);
        assert_eq!(trend_of(3), Trend::ReleasedAfterBurst);
        assert!((ranked[0].slope - 2.5 * MIB).abs() < 1.0);
        let young = rank_sites(
            &series,
            &LeakOptions {
                min_age: Some(Duration::from_secs(10)),
            },
        );
        assert!(young.is_empty());
    }

    /// A churned working set of 64 KiB objects sampled every 64 KiB moves by
    /// about its noise between snapshots (8.1 -> 9.1 MiB was seen): not a
    /// leak. Small objects leaking steadily are one, noise and all.
    #[test]
    fn growth_within_the_sampling_noise_is_not_a_leak() {
        const MIB: f64 = 1048576.0;
        let stack = |frame: u64, bytes: f64, size: f64| ParsedStack {
            frames: vec![frame],
            inuse_objects: bytes / size,
            inuse_bytes: bytes,
            alloc_objects: bytes / size,
            alloc_bytes: bytes,
            oldest_live_s: Some(0.0),
        };
        let series: Vec<ParsedHeap> = [8.1, 8.4, 8.6, 8.9, 9.1]
            .iter()
            .enumerate()
            .map(|(i, &working)| ParsedHeap {
                sample_interval: 65536,
                notes: ProfileNotes {
                    elapsed_s: Some(i as f64),
                    ..ProfileNotes::default()
                },
                stacks: vec![
                    stack(1, working * MIB, 65536.0),
                    stack(2, (i as f64 + 1.0) * MIB, 4096.0),
                ],
                ..ParsedHeap::default()
            })
            .collect();
        let ranked = rank_sites(&series, &LeakOptions::default());
        let trend_of = |frame| ranked.iter().find(|s| s.frames[0] == frame).unwrap().trend;
        assert_eq!(trend_of(1), Trend::WorkingSet);
        assert_eq!(trend_of(2), Trend::LikelyLeak);
        // 128 objects of 64 KiB at 64 KiB: sd = 64 KiB * sqrt(128 * (1-p)/p).
        let p = 1.0 - (-1.0f64).exp();
        let sd = sampling_variance(128.0, 8.0 * MIB, 65536.0).sqrt();
        assert!((sd - 65536.0 * (128.0 * (1.0 - p) / p).sqrt()).abs() < 1.0);
    }

    /// The same churned set, its 128 objects a fresh draw of samples at
    /// every snapshot, may read 37% under its peak once (CI saw 31%): a
    /// working set still. Objects much larger than the interval carry no
    /// such noise: the same dip of theirs is real.
    #[test]
    fn a_dip_within_the_sampling_noise_is_still_a_working_set() {
        const MIB: f64 = 1048576.0;
        let series = |sizes: &[f64], object: f64| -> Vec<ParsedHeap> {
            sizes
                .iter()
                .enumerate()
                .map(|(i, &mib)| ParsedHeap {
                    sample_interval: 65536,
                    notes: ProfileNotes {
                        elapsed_s: Some(i as f64),
                        ..ProfileNotes::default()
                    },
                    stacks: vec![ParsedStack {
                        frames: vec![1],
                        inuse_objects: mib * MIB / object,
                        inuse_bytes: mib * MIB,
                        alloc_objects: mib * MIB / object,
                        alloc_bytes: mib * MIB,
                        oldest_live_s: Some(0.8),
                    }],
                    ..ParsedHeap::default()
                })
                .collect()
        };
        let trend = |heaps: Vec<ParsedHeap>| rank_sites(&heaps, &LeakOptions::default())[0].trend;
        let readings = [8.0, 8.0, 8.0, 5.0, 8.0, 8.0, 8.0];
        assert_eq!(trend(series(&readings, 65536.0)), Trend::WorkingSet);
        assert_eq!(trend(series(&readings, MIB)), Trend::Fluctuating);
    }

    #[test]
    fn diff_orders_by_growth() {
        let old = snapshot(0.0, &[(1, 100.0), (2, 500.0)]);
        let new = snapshot(1.0, &[(1, 900.0), (2, 100.0), (3, 50.0)]);
        let rows = diff(&old, &new);
        assert_eq!(rows[0].0, [1]);
        assert_eq!(rows.last().unwrap().0, [2]);
        let mut out = Vec::new();
        write_diff(&rows, 10, |f| format!("site{}", f[0]), &mut out).unwrap();
        let text = String::from_utf8(out).unwrap();
        assert!(text.starts_with("total in use: +450 B\n"), "{text}");
    }
}
