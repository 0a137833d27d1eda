//! jeprof's sampling numbers: what a `heap_v2` file's (count, bytes)
//! pairs stand for, written so that jeprof's un-sampling gives back
//! memprobe's estimates.
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
    use crate::collect::sampling::sample_probability;

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
