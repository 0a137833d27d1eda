//! What memprobe costs the profiled processes: probe hits per entry point,
//! and the time they add, estimated from per-hit costs measured on this
//! host ([`calibrate`]) and measured again as the run goes on
//! ([`recalibration`]).
pub mod calibrate;
pub(super) mod recalibration;

mod ledger;
mod model;

pub use ledger::{CostLedger, ProbeCost, human_count, rates};
pub use model::CostModel;
