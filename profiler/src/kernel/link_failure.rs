//! Why one of memprobe's programs was not linked at a place in a file.
use aya::programs::ProgramError;

use crate::kernel::{features::KernelFeature, uprobe_multi::LinkError};

#[derive(Debug, thiserror::Error)]
pub enum LinkFailure {
    #[error("program {0} is missing from the eBPF object")]
    MissingProgram(String),

    #[error("program {name}")]
    Program {
        name: String,
        #[source]
        cause: ProgramError,
    },

    #[error("uprobe_multi link")]
    Multi(#[source] LinkError),

    #[error("uprobe session")]
    Session(#[source] LinkError),

    #[error(
        "{}: the kernel refused the link; use --return-probes uretprobes",
        KernelFeature::UprobeSessions
    )]
    SessionsRefused(#[source] LinkError),
}

impl LinkFailure {
    pub(super) fn program(name: &str) -> impl FnOnce(ProgramError) -> Self + '_ {
        move |cause| Self::Program {
            name: name.into(),
            cause,
        }
    }
}
