//! When a process's windows open and for how long: their timing, fixed or
//! set by what they cost, and how densely a window samples.
use std::time::Duration;

/// How long a window stays open, and the mean time between two: fixed
/// (`--windows 100ms/4s`), or set by what the windows cost (the default).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct WindowTiming {
    pub length: Duration,
    /// `None`: as often as `cost` allows.
    pub every: Option<Duration>,
    /// What the windows may cost a process, as a share of the CPU time it
    /// uses itself (`--windows 0.3%`; [`WINDOWS_COST`] by default).
    pub cost: f64,
}

impl Default for WindowTiming {
    fn default() -> Self {
        Self {
            length: Duration::from_millis(100),
            every: None,
            cost: WINDOWS_COST,
        }
    }
}

/// What a process's windows may cost it, averaged over the run, as a
/// share of the CPU time it uses itself: 1%. A program whose calls cost
/// less than that when every one traps is probed at every call, as entry
/// sampling would; a busier one, in windows open that share of what every
/// call would cost (a busy redis-server: some 3% of the time).
pub const WINDOWS_COST: f64 = 0.01;

/// Below this share of one CPU (0.1%: some 1,000 traps a second) calls are
/// probed at every call whatever the process uses itself: a quiet
/// program, a short one, an allocation burst.
pub const ALWAYS_OPEN_BELOW: f64 = 0.001;

/// The least share of time in windows, whatever they cost: 100 ms every
/// 20 s, so that a profile still gets some windows in a minute (less
/// where they were asked to cost less: see [`WindowTiming::least_duty`]).
pub const MIN_DUTY: f64 = 0.005;

impl WindowTiming {
    /// The share of time to spend in windows for a process whose windowed
    /// probes cost `open_cost` of a CPU while open, to keep their average
    /// at `allowed` (a share of a CPU): the fixed timing's share if one was
    /// given.
    pub fn duty(&self, open_cost: f64, allowed: f64) -> f64 {
        if let Some(every) = self.every {
            return self.length.as_secs_f64() / every.as_secs_f64();
        }
        if open_cost <= allowed.max(ALWAYS_OPEN_BELOW) {
            return 1.0;
        }
        (allowed / open_cost).clamp(self.least_duty(), 1.0)
    }

    /// The least share of time in windows: [`MIN_DUTY`], or the share of
    /// CPU they were asked to cost where that is less (`--windows 0.3%`,
    /// the shipped agent's: 100 ms every 33 s). A window costs a process
    /// at most its share of time (every call traps while it is open), so
    /// the windows never cost more than was asked, even to give a profile
    /// more of them.
    pub fn least_duty(&self) -> f64 {
        MIN_DUTY.min(self.cost)
    }

    /// The wait before the next window at `duty`, for windows whose
    /// probes stay in for `trapping` (their length at least): uniform from
    /// half the mean to one and a half times it, so that window times
    /// follow no period of the program's shorter than that spread, while
    /// each window stands for a stretch of the run of about the same
    /// length (a sample stands for the bytes since the window before:
    /// exponential gaps, a few many times the mean, made a few windows'
    /// samples weigh most of the run).
    pub(super) fn gap(&self, duty: f64, trapping: Duration) -> Duration {
        let length = self.length.max(trapping).as_secs_f64();
        let mean = (length / duty.max(self.least_duty()) - length).max(0.0);
        Duration::from_secs_f64(mean * rand::random_range(0.5..1.5))
    }
}

/// The densest a window samples, whatever the interval: a sample per
/// 4 KiB allocated on average. Every call traps in a window; a sample per
/// call or so on top (a 4 KiB interval made 32 times denser) filled the
/// ring buffer of a loop allocating a million times a second.
pub const DENSEST_INTERVAL: u64 = 4096;

/// How much denser than an entry probe a window open `duty` of the time
/// samples at `interval`, as a power of two: about as many samples as
/// sampling every call would give, never denser than [`DENSEST_INTERVAL`].
pub fn window_shift(duty: f64, interval: u64) -> u64 {
    let shift = (1.0 / duty.max(f64::MIN_POSITIVE)).log2().round();
    let densest = (interval / DENSEST_INTERVAL).max(1).ilog2() as u64;
    (shift.max(0.0) as u64)
        .min(profiler_common::MAX_WINDOW_SHIFT)
        .min(densest)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_follow_no_period() {
        let timing = WindowTiming {
            length: Duration::from_millis(100),
            every: Some(Duration::from_secs(4)),
            ..WindowTiming::default()
        };
        let duty = timing.duty(0.5, WINDOWS_COST);
        assert!((duty - 0.025).abs() < 1e-9);
        let gap = |trapping| timing.gap(duty, trapping).as_secs_f64();
        let gaps: Vec<f64> = (0..2000).map(|_| gap(timing.length)).collect();
        let mean = gaps.iter().sum::<f64>() / gaps.len() as f64;
        // Uniform over 1.95 s to 5.85 s (the time between two less a window).
        assert!((mean - 3.9).abs() < 0.1, "{mean}");
        assert!(gaps.iter().all(|&g| (1.95..=5.85).contains(&g)));
        assert!(gaps.iter().any(|&g| g < 2.2) && gaps.iter().any(|&g| g > 5.6));
        // Probes that stayed in 150 ms: the same share of the time, as
        // long a gap again and a half.
        let longer: Vec<f64> = (0..2000).map(|_| gap(Duration::from_millis(150))).collect();
        let mean = longer.iter().sum::<f64>() / longer.len() as f64;
        assert!((mean - 5.85).abs() < 0.15, "{mean}");
    }

    #[test]
    fn windows_open_as_long_as_their_cost_allows() {
        let timing = WindowTiming::default();
        // A process using one CPU may spend 1% of a CPU in windows.
        let allowed = WINDOWS_COST * 1.0;
        // Cheap calls: every one probed.
        assert_eq!(timing.duty(0.004, allowed), 1.0);
        let interval = 512 * 1024;
        assert_eq!(window_shift(1.0, interval), 0);
        // Calls that cost 40% of a CPU when all trap: open 2.5% of the
        // time, sampled 2^5 times denser.
        let duty = timing.duty(0.4, allowed);
        assert!((duty - 0.025).abs() < 1e-9, "{duty}");
        assert_eq!(window_shift(duty, interval), 5);
        // At a 4 KiB interval, no denser than that.
        assert_eq!(window_shift(duty, 4096), 0);
        assert_eq!(window_shift(duty, 32 * 1024), 3);
        // Dearer still: never less than MIN_DUTY, nor denser than allowed.
        assert_eq!(timing.duty(30.0, allowed), MIN_DUTY);
        let shift = window_shift(MIN_DUTY, interval);
        assert_eq!(shift, profiler_common::MAX_WINDOW_SHIFT);
        // A budget that allows nothing narrows them to the least, unless
        // they cost next to nothing.
        assert_eq!(timing.duty(0.02, 0.0), MIN_DUTY);
        assert_eq!(timing.duty(0.0005, 0.0), 1.0);
    }

    #[test]
    fn windows_asked_to_cost_less_than_their_least_share_open_less() {
        let agent = WindowTiming {
            cost: 0.003,
            ..WindowTiming::default()
        };
        assert_eq!(agent.least_duty(), 0.003);
        assert_eq!(agent.duty(30.0, 0.003), 0.003);
        // 100 ms every 33 s on average.
        let gap = agent.gap(agent.least_duty(), agent.length).as_secs_f64();
        assert!((16.5..50.0).contains(&gap), "{gap}");
        assert_eq!(WindowTiming::default().least_duty(), MIN_DUTY);
    }
}
