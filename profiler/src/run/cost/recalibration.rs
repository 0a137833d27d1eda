//! The per-hit costs measured again while the run goes on: each
//! measurement is a snapshot of a host whose speed changes in spells of
//! seconds, and hits are priced at the mean of the last few
//! ([`super::recent`]). The first come soon, 1 s apart, then 2, 4, 8...
//! until `--recalibrate-every`: a run of seconds gets several, for some
//! 0.15 s of one CPU each. Each tick's hits are priced before new costs are
//! taken, so hits keep the costs of their time.
use std::time::{Duration, Instant};

use crate::run::{
    Session,
    cost::{
        CostModel,
        calibrate::{CalibrationError, Remeasurement},
    },
    notice::CostNotice,
};

/// From the start to the first measurement again; each gap after doubles
/// up to `--recalibrate-every`.
const FIRST_GAP: Duration = Duration::from_secs(1);

/// The gap before the next measurement, `taken` having been taken: 1 s,
/// 2 s, 4 s... up to `every`.
fn gap_after(taken: usize, every: Duration) -> Duration {
    let doublings = taken.saturating_sub(1).min(20) as u32;
    FIRST_GAP.saturating_mul(1 << doublings).min(every)
}

/// When the next measurement starts, or the one under way.
#[derive(Default)]
pub(in crate::run) enum Recalibration {
    /// Not scheduled yet (the first tick schedules it).
    #[default]
    Unscheduled,
    Due(Instant),
    Running(Remeasurement),
}

impl Session<'_> {
    /// Each tick, after the ledger priced the tick's hits: starts a
    /// measurement when one is due, takes its costs once it ended.
    pub(in crate::run) fn keep_costs_measured(&mut self) {
        if let Some(retired) = self.costs.retired.pop() {
            self.probes.detach_calibration(retired);
        }
        let Some(every) = self.options.recalibrate_every else {
            return;
        };
        // Costs that could not be measured at start are not tried again;
        // with `--all` the copy timed would be profiled too.
        if !self.costs.model.measured || !self.scope.recalibrates() {
            return;
        }
        let now = Instant::now();
        let gap = gap_after(self.costs.recent.taken(), every);
        self.costs.recalibration = match std::mem::take(&mut self.costs.recalibration) {
            Recalibration::Unscheduled => Recalibration::Due(self.started + gap),
            Recalibration::Due(at) if now >= at => match Remeasurement::start(&mut self.probes) {
                Ok(running) => Recalibration::Running(running),
                Err(error) => {
                    self.take_costs(Err(error));
                    Recalibration::Due(now + gap)
                }
            },
            Recalibration::Running(running) if running.is_done() => {
                let (measured, retired) = running.finish();
                self.costs.retired.extend(retired);
                self.take_costs(measured);
                let gap = gap_after(self.costs.recent.taken(), every);
                Recalibration::Due(now + gap)
            }
            unchanged => unchanged,
        };
    }

    /// The costs measured at the start, or the defaults; said with
    /// `--verbose`.
    pub(in crate::run) fn take_first_costs(
        &mut self,
        measured: Result<CostModel, CalibrationError>,
    ) {
        let line = match measured {
            Ok(model) => {
                self.costs.model = self.costs.recent.add(model);
                format!(
                    "probe costs: {model}; on endbr64 (CET builds' first instruction) {:.1} µs",
                    model.endbr64.as_secs_f64() * 1e6
                )
            }
            Err(error) => format!(
                "probe costs not measured ({}): estimates use defaults",
                crate::error::chain(&error)
            ),
        };
        self.say(CostNotice::ProbeCosts(line));
    }

    /// The new costs, folded into the mean hits are priced at, or the old
    /// ones kept; said with `--verbose`.
    fn take_costs(&mut self, measured: Result<CostModel, CalibrationError>) {
        let line = match measured {
            Ok(model) => {
                let mean = self.costs.recent.add(model);
                self.costs.model = mean;
                format!(
                    "probe costs measured again: {model}; hits priced from now on at the mean \
                     of the last {}: {mean}",
                    self.costs.recent.kept()
                )
            }
            Err(error) => format!(
                "probe costs not measured again ({}): kept",
                crate::error::chain(&error)
            ),
        };
        self.say(CostNotice::ProbeCosts(line));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_measurements_come_soon_then_every_so_often() {
        let every = Duration::from_secs(120);
        let gaps: Vec<u64> = (1..=9)
            .map(|taken| gap_after(taken, every).as_secs())
            .collect();
        assert_eq!(gaps, [1, 2, 4, 8, 16, 32, 64, 120, 120]);
        assert_eq!(gap_after(usize::MAX, every), every);
        assert_eq!(gap_after(3, Duration::from_secs(2)).as_secs(), 2);
    }
}
