//! The per-hit costs measured again every `--recalibrate-every` while the
//! run goes on: a VM's trap costs drift by a fifth over minutes, and the
//! time reported added and the budget should follow. Each tick's hits are
//! priced before new costs are taken, so hits keep the costs of their
//! time.
use std::time::Instant;

use crate::run::{
    Session,
    cost::{
        CostModel,
        calibrate::{CalibrationError, Remeasurement},
    },
    notice::CostNotice,
};

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
        let Some(every) = self.options.recalibrate_every else {
            return;
        };
        // Costs that could not be measured at start are not tried again;
        // with `--all` the copy timed would be profiled too.
        if !self.costs.model.measured || !self.scope.recalibrates() {
            return;
        }
        let now = Instant::now();
        self.costs.recalibration = match std::mem::take(&mut self.costs.recalibration) {
            Recalibration::Unscheduled => Recalibration::Due(self.started + every),
            Recalibration::Due(at) if now >= at => match Remeasurement::start(&mut self.probes) {
                Ok(running) => Recalibration::Running(running),
                Err(error) => {
                    self.take_costs(Err(error));
                    Recalibration::Due(now + every)
                }
            },
            Recalibration::Running(running) if running.is_done() => {
                let measured = running.finish(&mut self.probes);
                self.take_costs(measured);
                Recalibration::Due(now + every)
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
                self.costs.model = model;
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

    /// The new costs, or the old ones kept; said with `--verbose`.
    fn take_costs(&mut self, measured: Result<CostModel, CalibrationError>) {
        let line = match measured {
            Ok(model) => {
                self.costs.model = model;
                format!("probe costs measured again: {model}")
            }
            Err(error) => format!(
                "probe costs not measured again ({}): kept",
                crate::error::chain(&error)
            ),
        };
        self.say(CostNotice::ProbeCosts(line));
    }
}
