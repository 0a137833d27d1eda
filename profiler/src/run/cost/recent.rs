//! The costs hits are priced at: the mean of the last few measurements,
//! not the latest alone. On this machine kind a measurement is a snapshot
//! of a host whose speed changes under it: plain code ran at 1.3, 2.9 or
//! 3.5 ns a call in spells of a tenth of a second to seconds, traps slowing with
//! it (a trap's cost over a call's held within 8%), so one half-second
//! measurement read anywhere from 0.6 to 0.9 µs an emulated hit while a
//! loop of seconds paid their mean. The profiled process pays the mean of
//! the host's states over its run, which the mean of measurements spread
//! over the run estimates.
use std::{collections::VecDeque, time::Duration};

use crate::run::cost::CostModel;

/// Measurements the mean is taken over: the last eight follow a host that
/// drifts over hours, at one every two minutes once the first few came.
const KEPT: usize = 8;

/// The last [`KEPT`] measurements, and how many were taken in all.
#[derive(Debug, Default)]
pub(in crate::run) struct RecentCosts {
    kept: VecDeque<CostModel>,
    taken: usize,
}

impl RecentCosts {
    /// Adds a measurement; returns the mean of those kept.
    pub fn add(&mut self, measured: CostModel) -> CostModel {
        if self.kept.len() == KEPT {
            self.kept.pop_front();
        }
        self.kept.push_back(measured);
        self.taken += 1;
        self.mean()
    }

    /// Measurements taken in all.
    pub fn taken(&self) -> usize {
        self.taken
    }

    /// Measurements the mean is over.
    pub fn kept(&self) -> usize {
        self.kept.len()
    }

    /// Each kind's mean over the kept measurements (the defaults before
    /// any).
    fn mean(&self) -> CostModel {
        let count = self.kept.len() as u32;
        if count == 0 {
            return CostModel::default();
        }
        let mean =
            |kind: fn(&CostModel) -> Duration| self.kept.iter().map(kind).sum::<Duration>() / count;
        CostModel {
            emulated: mean(|m| m.emulated),
            free: mean(|m| m.free),
            single_stepped: mean(|m| m.single_stepped),
            return_half: mean(|m| m.return_half),
            forced_return: mean(|m| m.forced_return),
            endbr64: mean(|m| m.endbr64),
            switch_per_thread: mean(|m| m.switch_per_thread),
            switch_per_event: mean(|m| m.switch_per_event),
            measured: true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn emulated(nanos: u64) -> CostModel {
        CostModel {
            emulated: Duration::from_nanos(nanos),
            measured: true,
            ..CostModel::default()
        }
    }

    #[test]
    fn hits_are_priced_at_the_mean_of_the_last_measurements() {
        let mut recent = RecentCosts::default();
        assert_eq!(recent.add(emulated(900)).emulated.as_nanos(), 900);
        assert_eq!(recent.add(emulated(600)).emulated.as_nanos(), 750);
        for _ in 0..KEPT {
            recent.add(emulated(600));
        }
        // The 900 ns one has left the window.
        let mean = recent.add(emulated(680));
        assert_eq!(mean.emulated.as_nanos(), 610);
        assert!(mean.measured);
        assert_eq!((recent.taken(), recent.kept()), (KEPT + 3, KEPT));
    }
}
