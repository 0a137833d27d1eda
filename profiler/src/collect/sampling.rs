//! jemalloc's sampling math: the per-sample correction that turns samples
//! taken by exponential byte countdowns back into unbiased estimates.

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
}
