//! The table the kernel programs draw each thread's exponential byte
//! countdowns from.
use profiler_common::sampling::{LN2_INDEX, QUANTILE_COUNT, TABLE_LEN};

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

#[cfg(test)]
mod tests {
    use super::*;

    /// The countdown the kernel derives from `random` with `table`; the same
    /// computation as the eBPF side, for tests.
    pub fn countdown_from(random: u32, table: &[u64]) -> u64 {
        let (zeros, index) = profiler_common::sampling::split_random(random);
        zeros as u64 * table[LN2_INDEX as usize] + table[index as usize]
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
}
