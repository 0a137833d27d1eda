//! What a process's windows cost and what the process uses itself: the
//! windowed probes' estimated seconds as they were read, and the process's
//! own CPU use, which their cost is held to a share of.
use std::time::Instant;

/// The least span over which a process's own CPU use is read.
const MIN_SPAN: f64 = 0.5;

/// One process's windows' cost, and its own CPU use.
#[derive(Debug)]
pub(super) struct WindowCost {
    /// The windowed probes' estimated cost so far (seconds) and when it
    /// was last read; the same at the last window's close.
    pub priced: (f64, Instant),
    at_last_close: (f64, Instant),
    /// Their share of a CPU averaged over the last cycle (the last window
    /// and the gap before it; the last second, for one that stays open).
    pub recent: f64,
    /// The process's CPU seconds and its windows' cost (seconds) when last
    /// read (none yet: an idle program's CPU reads 0 s, so 0 marks no
    /// reading), and its own CPU use (a share of a CPU, its windows' traps
    /// not counted) between the last two readings.
    cpu: Option<(f64, f64, Instant)>,
    pub own_cpu: f64,
}

impl WindowCost {
    pub fn new(now: Instant) -> Self {
        Self {
            priced: (0.0, now),
            at_last_close: (0.0, now),
            recent: 0.0,
            cpu: None,
            own_cpu: 0.0,
        }
    }

    /// Takes the windowed probes' cost so far (`priced` seconds, read
    /// now): their share of a CPU since the last reading.
    pub fn since(&mut self, priced: f64, now: Instant) -> f64 {
        let (before, then) = std::mem::replace(&mut self.priced, (priced, now));
        let elapsed = now.duration_since(then).as_secs_f64();
        if elapsed <= 0.0 {
            return 0.0;
        }
        (priced - before).max(0.0) / elapsed
    }

    /// Takes the process's CPU seconds so far and the windows' cost so far
    /// (`priced`, seconds), read now: its own CPU use since the last
    /// reading, a share of a CPU, kept as `own_cpu`. Readings less than
    /// [`MIN_SPAN`] apart are left for a longer span (CPU time is counted
    /// in 10 ms ticks). (At least a quarter of what it used: an estimate of
    /// the traps' cost above the time they took must not make it look
    /// idle.)
    pub fn own_cpu_since(&mut self, cpu: f64, priced: f64, now: Instant) {
        let Some((before, priced_before, then)) = self.cpu else {
            self.cpu = Some((cpu, priced, now));
            return;
        };
        let elapsed = now.duration_since(then).as_secs_f64();
        if elapsed < MIN_SPAN {
            return;
        }
        self.cpu = Some((cpu, priced, now));
        let used = (cpu - before).max(0.0);
        let windowed = (priced - priced_before).max(0.0);
        self.own_cpu = (used - windowed).max(used / 4.0) / elapsed;
    }

    /// A short window closed, its cost read last: the cycle since the one
    /// before closed (this window and the gap before it) sets the recent
    /// cost.
    pub fn cycle_closed(&mut self) {
        let (priced, now) = self.priced;
        let (before, then) = std::mem::replace(&mut self.at_last_close, (priced, now));
        let cycle = now.duration_since(then).as_secs_f64();
        if cycle > 0.0 {
            self.recent = (priced - before).max(0.0) / cycle;
        }
    }

    /// The window that stayed open closed, its cost read last: the next
    /// cycle starts here.
    pub fn continuous_closed(&mut self) {
        self.at_last_close = self.priced;
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn the_process_own_use_leaves_the_windows_traps_out() {
        let start = Instant::now();
        let mut cost = WindowCost::new(start);
        let at = |ms: u64| start + Duration::from_millis(ms);
        // An idle program's first reading: 0 s so far.
        cost.own_cpu_since(0.0, 0.0, at(0));
        cost.own_cpu_since(10.0, 0.0, at(1000));
        assert!((cost.own_cpu - 10.0).abs() < 1e-9, "{}", cost.own_cpu);
        // 0.5 s of CPU in 2 s, 0.1 s of it the windows' traps.
        cost.own_cpu_since(10.5, 0.1, at(3000));
        assert!((cost.own_cpu - 0.2).abs() < 1e-9, "{}", cost.own_cpu);
        // Too soon after: left for a longer span.
        cost.own_cpu_since(10.51, 0.1, at(3100));
        assert_eq!(cost.cpu.map(|(cpu, ..)| cpu), Some(10.5));
        // Traps estimated above what it used: a quarter of that, not 0.
        cost.own_cpu_since(10.9, 1.1, at(5000));
        assert!((cost.own_cpu - 0.05).abs() < 1e-9, "{}", cost.own_cpu);
    }

    #[test]
    fn a_cycle_costs_its_window_over_the_window_and_the_gap_before_it() {
        let start = Instant::now();
        let at = |ms: u64| start + Duration::from_millis(ms);
        let mut cost = WindowCost::new(start);
        // 20 ms of traps in a window closing 2 s after the cycle began.
        assert_eq!(cost.since(0.0, at(1900)), 0.0);
        assert!((cost.since(0.02, at(2000)) - 0.2).abs() < 1e-9);
        cost.cycle_closed();
        assert!((cost.recent - 0.01).abs() < 1e-9, "{}", cost.recent);
    }
}
