//! jemalloc's sampling math: exponential byte countdowns and the per-sample
//! correction that turns samples back into unbiased estimates.
use profiler_common::sampling::{LN2_INDEX, QUANTILE_COUNT, TABLE_LEN};

/// jemalloc's default mean sampling interval (`lg_prof_sample` 19).
pub const DEFAULT_SAMPLE_INTERVAL: u64 = 1 << 19;

/// Probability that an allocation of `size` counted bytes is sampled when
/// countdowns are exponential with mean `interval`.
pub fn sample_probability(size: u64, interval: u64) -> f64 {
    if interval == 0 {
        return 1.0;
    }
    -(-(size as f64) / interval as f64).exp_m1()
}

/// How many allocations one sample of `size` bytes stands for: `1 / p`.
/// How many allocations a call sampled on jemalloc's slow path stands for:
/// it closed a window of `window` bytes (counted down at once, so sampled
/// with probability `1 - exp(-window/interval)`), and is the window's
/// crossing call with probability `usable / window`.
pub fn window_weight(usable: u64, window: u64, interval: u64) -> f64 {
    let window = window.max(usable) as f64;
    let sampled = 1.0 - (-window / interval.max(1) as f64).exp();
    window / (usable.max(1) as f64 * sampled.max(f64::MIN_POSITIVE))
}

pub fn sample_weight(size: u64, interval: u64) -> f64 {
    let p = sample_probability(size, interval);
    if p > 0.0 { 1.0 / p } else { 0.0 }
}

/// The table the kernel draws countdowns from (see
/// `profiler_common::sampling`): `-ln(m)` for `m` at the middle of each of
/// [`QUANTILE_COUNT`] slices of `[0.5, 1)`, then `ln 2`, all times `interval`.
pub fn quantile_table(interval: u64) -> Vec<u64> {
    let scale = interval as f64;
    let mut table = Vec::with_capacity(TABLE_LEN as usize);
    for index in 0..QUANTILE_COUNT {
        let m = 0.5 + (index as f64 + 0.5) / (2 * QUANTILE_COUNT) as f64;
        table.push((-m.ln() * scale).round() as u64);
    }
    debug_assert_eq!(table.len(), LN2_INDEX as usize);
    table.push((std::f64::consts::LN_2 * scale).round() as u64);
    table
}

/// The countdown the kernel derives from `random` with `table`; the same
/// computation as the eBPF side, for tests.
pub fn countdown_from(random: u32, table: &[u64]) -> u64 {
    let (zeros, index) = profiler_common::sampling::split_random(random);
    zeros as u64 * table[LN2_INDEX as usize] + table[index as usize]
}

/// A per-stack estimate as jeprof's `heap_v2` expects it: jeprof multiplies
/// each (count, bytes) pair by `1 / (1 - exp(-(bytes/count)/R))`, so write
/// values that this formula turns back into `objects` and `bytes`, as
/// jemalloc 5.3 does. The written count is a whole number of "samples": for
/// objects much smaller than R, what jeprof reads back is quantized to about
/// R bytes per written count, so a stack's bytes come back within R/2.
pub fn jeprof_encode(objects: f64, bytes: f64, interval: u64) -> (u64, u64) {
    if objects <= 0.0 || bytes < 1.0 {
        return (0, 0);
    }
    let p = sample_probability_f(bytes / objects, interval as f64);
    let written_bytes = (bytes * p).round().max(1.0) as u64;
    let written_count = (objects * p).round().max(1.0) as u64;
    (written_count, written_bytes)
}

/// jeprof's reading of a written (count, bytes) pair.
pub fn jeprof_decode(count: u64, bytes: u64, interval: u64) -> (f64, f64) {
    if count == 0 {
        return (0.0, bytes as f64);
    }
    let average = bytes as f64 / count as f64;
    let scale = 1.0 / sample_probability_f(average, interval as f64);
    (count as f64 * scale, bytes as f64 * scale)
}

fn sample_probability_f(size: f64, interval: f64) -> f64 {
    if interval <= 0.0 {
        1.0
    } else {
        -(-size / interval).exp_m1()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weight_matches_jemalloc_formula() {
        // An object as big as the interval is sampled with p = 1 - 1/e.
        let w = sample_weight(4096, 4096);
        assert!((w - 1.0 / (1.0 - (-1.0f64).exp())).abs() < 1e-12);
        // Huge objects are always sampled; tiny ones stand for many.
        assert!((sample_weight(1 << 30, 4096) - 1.0).abs() < 1e-9);
        assert!((sample_weight(8, 1 << 19) - 65536.5).abs() < 1.0);
    }

    #[test]
    fn countdowns_are_exponential_with_the_right_mean() {
        let interval = 1 << 19;
        let table = quantile_table(interval);
        // Every 32-bit value with a fixed stride: a deterministic, even cover.
        let stride = 65_537u64;
        let draws: Vec<f64> = (0..(1u64 << 32))
            .step_by(stride as usize)
            .map(|r| countdown_from(r as u32, &table) as f64)
            .collect();
        let mean = draws.iter().sum::<f64>() / draws.len() as f64;
        assert!(
            (mean / interval as f64 - 1.0).abs() < 0.002,
            "mean {mean} for interval {interval}"
        );
        // Memorylessness shows in the tail: P(X > k R) = exp(-k).
        for k in [1.0, 2.0, 4.0, 8.0] {
            let above = draws.iter().filter(|&&d| d > k * interval as f64).count();
            let fraction = above as f64 / draws.len() as f64;
            let expected = (-k).exp();
            assert!(
                (fraction / expected - 1.0).abs() < 0.02,
                "P(X > {k}R) = {fraction}, expected {expected}"
            );
        }
    }

    #[test]
    fn jeprof_reads_back_what_we_encode() {
        let interval = 524_288;
        for (objects, bytes) in [
            (128.5, 526_338.0),
            (106.9, 12_258_141.0),
            (2000.0, 8_192_000.0),
            (16.0, 16_777_216.0),
            (300_000.0, 9_600_000.0),
        ] {
            let (count, written) = jeprof_encode(objects, bytes, interval);
            let (o, b) = jeprof_decode(count, written, interval);
            // The only loss is the written count's rounding: at most half a
            // sample, i.e. R/2 bytes, or 1% when objects are large.
            let bound = (0.01 * bytes).max(interval as f64 / 2.0);
            assert!((b - bytes).abs() <= bound, "{bytes} -> {b}");
            // Objects: the count's rounding moves jeprof's average size too,
            // which doubles its relative effect.
            let written = objects * sample_probability(average_size(bytes, objects), interval);
            let relative = 2.0 * 0.5 / written + 0.01;
            assert!((o / objects - 1.0).abs() <= relative, "{objects} -> {o}");
        }
    }

    fn average_size(bytes: f64, objects: f64) -> u64 {
        (bytes / objects).round() as u64
    }

    #[test]
    fn jeprof_worked_example() {
        // From formats.md: jeprof shows 128.5 objects / 526,338 bytes.
        let (o, b) = jeprof_decode(1, 4096, 524_288);
        assert!((o - 128.5).abs() < 0.1);
        assert!((b - 526_338.0).abs() < 2.0);
    }

    #[test]
    fn nothing_encodes_to_nothing() {
        assert_eq!(jeprof_encode(0.0, 0.0, 4096), (0, 0));
    }
}
