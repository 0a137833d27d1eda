//! docs/overhead.md's redis tables: each configuration's ratios to its baseline
//! runs, with how far the rounds let them be trusted.
use super::{Half, RedisResult, Round, Row, Runs};

/// docs/overhead.md's redis table, and how memprobe's reported cost compares
/// with what redis-server gained.
pub(in crate::bench) fn redis_table(redis: &RedisResult) -> String {
    let (with, without) = (redis.unprofiled.with(), redis.unprofiled.without());
    let mut table = format!(
        "\n| redis-server 7 (libjemalloc), redis-benchmark {} of {}-byte values, 50 clients{}, random keys (a million, mostly set first), each run {}k of each; twin servers in turn, each once profiled and once the baseline | requests/s (vs without) | redis-server CPU s a run, with (without) | CPU per request vs without | redis-server's sleeps a run, with (without) | added CPU s over the measured runs ({}; rows timed from the attach, as many as fill its first minute): measured / memprobe's report | memprobe's own CPU s, peak RSS | p99 latency ms a run, with (without): ratio |\n|---|---|---|---|---|---|---|---|\n\
         | without memprobe (twin B's CPU per request over twin A's, nothing attached: {:.2}x) | {:.0} | {:.2} | 1.00x | {:.0} | - | - | {:.3} |\n",
        redis.load.tests.to_uppercase().replace(',', "/"),
        redis.load.value_bytes,
        match redis.load.pipeline {
            1 => String::new(),
            depth => format!(" each pipelining {depth} requests (the server never idle)"),
        },
        redis.load.requests() / 1000,
        4 * redis.load.rounds,
        without.cpu_per_run() / with.cpu_per_run().max(1e-12),
        (with.rate() + without.rate()) / 2.0,
        (with.cpu_per_run() + without.cpu_per_run()) / 2.0,
        (with.sleeps_per_run() + without.sleeps_per_run()) / 2.0,
        (with.p99_ms() + without.p99_ms()) / 2.0,
    );
    for row in &redis.rows {
        table.push_str(&table_row(row));
    }
    table
}

/// One configuration's line. Its ratios are the geometric means of its two
/// halves', so that the twins' own difference cancels.
fn table_row(row: &Row) -> String {
    let [a, b] = &row.halves;
    let ratio = |value: fn(&Runs) -> f64| {
        ((value(&a.with()) / value(&a.without()).max(1e-12))
            * (value(&b.with()) / value(&b.without()).max(1e-12)))
        .sqrt()
    };
    let cpu = cpu_per_request(row);
    let mean = |value: fn(&Runs) -> f64, runs: fn(&Half) -> Runs| {
        (value(&runs(a)) + value(&runs(b))) / 2.0
    };
    format!(
        "| {} | {:.0} ({:.1}%) | {:.2} ({:.2}) | {cpu} | {:.0} ({:.0}) | {} | {} | {:.3} ({:.3}): {} |\n",
        row.label,
        mean(Runs::rate, Half::with),
        100.0 * ratio(Runs::rate),
        mean(Runs::cpu_per_run, Half::with),
        mean(Runs::cpu_per_run, Half::without),
        mean(Runs::sleeps_per_run, Half::with),
        mean(Runs::sleeps_per_run, Half::without),
        added(row),
        own(row),
        mean(Runs::p99_ms, Half::with),
        mean(Runs::p99_ms, Half::without),
        per_round_ratio(row, Runs::p99_ms),
    )
}

/// redis-server's CPU per request with against without (see
/// [`per_round_ratio`]).
pub(super) fn cpu_per_request(row: &Row) -> String {
    per_round_ratio(row, |runs| runs.cpu)
}

/// A figure of the runs with against without: the geometric mean of the
/// rounds' ratios, with a 95% interval where there are enough rounds (for
/// p99 latency, whose runs' values wander more than their CPU, the
/// interval says whether a difference is there at all).
fn per_round_ratio(row: &Row, value: fn(&Runs) -> f64) -> String {
    let [a, b] = &row.halves;
    let log_ratios = |h: &Half| -> Vec<f64> {
        let ratio = |r: &Round| {
            (value(&r.with) / value(&r.without).max(1e-12))
                .max(1e-12)
                .ln()
        };
        h.rounds.iter().map(ratio).collect()
    };
    geometric_mean_ratio([&log_ratios(a), &log_ratios(b)])
}

/// The geometric mean of ratios measured round by round in two halves
/// (given as their logarithms), with a 95% interval where the rounds
/// allow one.
pub(super) fn geometric_mean_ratio(log_ratios: [&[f64]; 2]) -> String {
    let (mean, margin) = mean_and_margin(log_ratios);
    match margin {
        Some(m) => format!(
            "{:.2}x ({:.2}x to {:.2}x)",
            mean.exp(),
            (mean - m).exp(),
            (mean + m).exp()
        ),
        None => format!("{:.2}x", mean.exp()),
    }
}

/// What redis-server gained over the measured runs (each round's CPU with
/// less its CPU without, summed), with a 95% margin where the rounds allow
/// one, against memprobe's report (a floor has none: its gain alone, to
/// set memprobe's against in seconds as well as in ratios, since rows taken
/// minutes apart run on a host whose speed differs).
fn added(row: &Row) -> String {
    let gains = |h: &Half| -> Vec<f64> {
        h.rounds
            .iter()
            .map(|r| r.with.cpu - r.without.cpu)
            .collect()
    };
    let [a, b] = &row.halves;
    let rounds = (a.rounds.len() + b.rounds.len()) as f64;
    let (mean, margin) = mean_and_margin([&gains(a), &gains(b)]);
    let (gained, margin) = (mean * rounds, margin.map(|m| m * rounds));
    let measured = match margin {
        Some(m) => format!("{gained:.2} ± {m:.2}"),
        None => format!("{gained:.2}"),
    };
    let Some(reported) = row.halves.iter().map(|h| h.reported).sum::<Option<f64>>() else {
        return format!("{measured} / -");
    };
    // Within the twins' noise a mode that traps almost never can read a
    // loss: no ratio to give.
    if gained <= 0.0 {
        return format!("{measured} / {reported:.2} (no gain measured)");
    }
    let percent = |gained: f64| 100.0 * reported / gained;
    let range = match margin {
        Some(m) if gained > m => {
            format!(
                ", {:.0}% to {:.0}%",
                percent(gained + m),
                percent(gained - m)
            )
        }
        Some(m) => format!(", over {:.0}%", percent(gained + m)),
        None => String::new(),
    };
    format!(
        "{measured} / {reported:.2} ({:.0}%{range})",
        percent(gained)
    )
}

/// The mean of values measured round by round in two halves, each half's
/// values shifted alike by what differs between the twins (so the halves
/// are centred on their own means to judge the spread), and the margin of
/// a 95% interval around it: None with fewer than three rounds.
fn mean_and_margin([a, b]: [&[f64]; 2]) -> (f64, Option<f64>) {
    let average = |values: &[f64]| values.iter().sum::<f64>() / values.len().max(1) as f64;
    let (mean_a, mean_b) = (average(a), average(b));
    let mean = (mean_a + mean_b) / 2.0;
    let spread =
        |values: &[f64], centre: f64| -> f64 { values.iter().map(|v| (v - centre).powi(2)).sum() };
    let freedom = (a.len() + b.len()).saturating_sub(2);
    if freedom == 0 || a.is_empty() || b.is_empty() {
        return (mean, None);
    }
    let variance = (spread(a, mean_a) + spread(b, mean_b)) / freedom as f64;
    let of_mean = variance / 4.0 * (1.0 / a.len() as f64 + 1.0 / b.len() as f64);
    (mean, Some(student_t95(freedom) * of_mean.sqrt()))
}

/// Student's t at 95% two-sided for `freedom` degrees of freedom.
fn student_t95(freedom: usize) -> f64 {
    const T: [f64; 10] = [
        12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    ];
    T.get(freedom.saturating_sub(1)).copied().unwrap_or(1.96)
}

/// memprobe's own CPU over both halves and its larger peak RSS.
fn own(row: &Row) -> String {
    let usages: Option<Vec<(f64, u64)>> = row.halves.iter().map(|h| h.own).collect();
    match usages {
        Some(usages) => format!(
            "{:.2} s, {:.1} MiB",
            usages.iter().map(|u| u.0).sum::<f64>(),
            usages.iter().map(|u| u.1).max().unwrap_or(0) as f64 / 1024.0
        ),
        None => "-".to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_twins_offset_is_no_spread() {
        // Halves 10 apart, each spread by 1 around its mean: variance 1 on
        // 4 degrees of freedom, the mean's 1/4 * (1/3 + 1/3).
        let (mean, margin) = mean_and_margin([&[1.0, 2.0, 3.0], &[11.0, 12.0, 13.0]]);
        assert_eq!(mean, 7.0);
        let expected = 2.776 * (1.0f64 / 6.0).sqrt();
        assert!((margin.unwrap() - expected).abs() < 1e-9, "{margin:?}");
        // One round a half leaves nothing to judge the spread by.
        assert_eq!(mean_and_margin([&[1.0], &[3.0]]), (2.0, None));
    }
}
