//! What memprobe costs the profiled processes: probe hits per entry point,
//! and the time they add, estimated from per-hit costs measured on this
//! host ([`calibrate`]) and measured again as the run goes on
//! ([`recalibration`]), hits priced at the mean of the last measurements
//! ([`recent`]).
pub mod calibrate;
pub(super) mod recalibration;

mod ledger;
mod model;
mod recent;

pub use ledger::{CostLedger, ProbeCost, human_count, rates};
pub use model::CostModel;

use crate::kernel::{CalibrationProbes, KernelProbes};

/// What the probes cost: what a hit costs on this host (the mean of the
/// last measurements, which it keeps), when it is measured next, and the
/// hits priced so far.
#[derive(Default)]
pub(in crate::run) struct Costs {
    pub model: CostModel,
    pub recent: recent::RecentCosts,
    pub recalibration: recalibration::Recalibration,
    /// A finished measurement's probes, detached one a tick.
    pub retired: Vec<CalibrationProbes>,
    pub ledger: CostLedger,
}

impl Costs {
    /// Prices the hits since the last look at the costs of now; the
    /// probes whose returns another's probe began forcing.
    pub fn price(&mut self, probes: &KernelProbes) -> Vec<usize> {
        self.ledger.update(&self.model, probes)
    }
}
