//! `--dump-on-growth [rss:]SIZE/WINDOW`: when a process's estimated in-use
//! heap (or its resident memory) grew by SIZE within WINDOW (from the
//! lowest point in that window), a snapshot is due, at most once per
//! minimum gap; the next one needs as much growth again.
use std::{
    collections::VecDeque,
    time::{Duration, Instant},
};

use crate::{
    run::options::{Growing, GrowthTrigger},
    units,
};

/// What a process measured at one tick, for the growth triggers.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Reading {
    /// The estimated heap in use.
    pub heap: f64,
    /// Resident bytes, read where a trigger watches them.
    pub resident: Option<f64>,
}

/// One process's in-use bytes over the trigger's window.
#[derive(Debug, Default)]
pub struct GrowthWindow {
    /// (when, estimated bytes in use) once a tick; the oldest entry is the
    /// baseline.
    readings: VecDeque<(Instant, f64)>,
    last_dump: Option<Instant>,
}

impl GrowthWindow {
    /// Takes one reading; returns the snapshot's reason when one is due.
    pub fn observe(
        &mut self,
        now: Instant,
        inuse: f64,
        trigger: GrowthTrigger,
        min_gap: Duration,
    ) -> Option<String> {
        self.readings.push_back((now, inuse));
        while self
            .readings
            .front()
            .is_some_and(|(when, _)| now.duration_since(*when) > trigger.window)
        {
            self.readings.pop_front();
        }
        let (since, lowest) = self
            .readings
            .iter()
            .copied()
            .min_by(|a, b| a.1.total_cmp(&b.1))
            .unwrap_or((now, inuse));
        let gap_ok = self
            .last_dump
            .is_none_or(|last| now.duration_since(last) >= min_gap);
        if inuse - lowest < trigger.size as f64 || !gap_ok {
            return None;
        }
        self.last_dump = Some(now);
        self.readings.clear();
        self.readings.push_back((now, inuse));
        let what = match trigger.of {
            Growing::Heap => "growth",
            Growing::Resident => "resident growth",
        };
        Some(format!(
            "{what}: +{} in {} (trigger {} within {})",
            units::bytes(inuse - lowest),
            humantime::format_duration(Duration::from_secs(now.duration_since(since).as_secs())),
            units::bytes(trigger.size as f64),
            humantime::format_duration(trigger.window)
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn due_on_growth_within_the_window_and_not_again_until_as_much_more() {
        let trigger = GrowthTrigger {
            of: Growing::Heap,
            size: 100,
            window: Duration::from_secs(10),
        };
        let gap = Duration::from_secs(1);
        let start = Instant::now();
        let at = |s: u64| start + Duration::from_secs(s);
        let mut window = GrowthWindow::default();
        assert_eq!(window.observe(at(0), 1000.0, trigger, gap), None);
        assert_eq!(window.observe(at(1), 1050.0, trigger, gap), None);
        let reason = window.observe(at(2), 1100.0, trigger, gap).unwrap();
        assert!(reason.starts_with("growth: +100 B in 2s"), "{reason}");
        // The baseline moved to the dump: 50 more is not enough.
        assert_eq!(window.observe(at(4), 1150.0, trigger, gap), None);
        assert!(window.observe(at(5), 1200.0, trigger, gap).is_some());
        // Growth spread over more than the window never triggers.
        let mut slow = GrowthWindow::default();
        for s in 0..40 {
            assert_eq!(
                slow.observe(at(s), 1000.0 + 9.0 * s as f64, trigger, gap),
                None
            );
        }
    }
}
