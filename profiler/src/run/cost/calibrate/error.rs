//! Why the probes' costs could not be measured (the run then prices hits
//! at default costs, and says so).
use std::{io, path::PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum CalibrationError {
    #[error("cannot start {} to time its probes", .0.display())]
    Start(PathBuf, #[source] io::Error),

    #[error("the calibration copy stopped")]
    Stopped,

    #[error("cannot ask the calibration copy")]
    Ask(#[source] io::Error),

    #[error("the calibration copy answered {0:?}, not a time")]
    BadTiming(String),

    #[error("the timing thread panicked")]
    Panicked,

    #[error("cannot read /proc/self/maps")]
    OwnMaps(#[source] io::Error),

    #[error("the function timed is in no mapped file")]
    NotMapped,

    #[error("cannot attach the probes timed")]
    Attach(#[source] Box<crate::kernel::KernelError>),
}
