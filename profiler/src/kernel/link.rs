//! Linking one program at one place: an entry point's programs as a
//! uprobe session where the kernel has sessions (found out at the first
//! link), else as an entry program and a uretprobe, each as a uprobe_multi
//! link where the kernel's links work, else as aya's perf-event uprobe.
use std::os::fd::OwnedFd;

use aya::programs::{
    UProbe,
    uprobe::{UProbeAttachLocation, UProbeAttachPoint, UProbeLinkId},
};
use profiler_common::{CallShape, programs};

use crate::{
    discover::entry_points::EntryPoint,
    kernel::{KernelProbes, LinkFailure, ProbeLinks, ReturnHalf, ReturnProbes, attach::Target},
};

/// The summary's words for a run on uretprobes because the kernel has no
/// uprobe sessions.
const NO_SESSIONS: &str = "kernel has no uprobe sessions";

/// Why an entry point did not get a session link.
pub(super) enum SessionLink {
    /// No sessions in this run: use a uretprobe.
    Unavailable,
    /// The attach failed.
    Failed(LinkFailure),
}

impl KernelProbes {
    /// Links `entry`'s programs at `offset`: one uprobe session where the
    /// kernel has them, else the entry program and a uretprobe (or no
    /// return half where the call's shape needs none); all or nothing.
    pub(super) fn link_entry(
        &mut self,
        target: &Target,
        entry: &EntryPoint,
        offset: u64,
        cookie: u64,
    ) -> std::result::Result<(ProbeLinks, ReturnHalf), LinkFailure> {
        let mut links = ProbeLinks::default();
        let mut return_half = ReturnHalf::None;
        if let Some(program) = entry.shape.session_program()
            && !self.allocations_only_in(target.scope)
        {
            return_half = match self.link_session(program, target, offset, cookie) {
                Ok(link) => {
                    links.multi.push(link);
                    return Ok((links, ReturnHalf::Session));
                }
                Err(SessionLink::Unavailable) if entry.shape.returns_by_uretprobe() => {
                    ReturnHalf::Uretprobe
                }
                Err(SessionLink::Unavailable) => ReturnHalf::None,
                Err(SessionLink::Failed(cause)) => return Err(cause),
            };
        }
        for program in plain_programs(entry.shape, return_half) {
            if let Err(cause) = self.attach_plain(program, target, offset, cookie, &mut links) {
                self.detach_links(links);
                return Err(cause);
            }
        }
        Ok((links, return_half))
    }

    /// Attaches `program` to run at `offset` (at the return for the
    /// uretprobe's program): as a uprobe_multi link where the kernel's
    /// links work (`check_links`), else as aya's perf-event uprobe.
    pub(super) fn attach_plain(
        &mut self,
        program: &'static str,
        target: &Target,
        offset: u64,
        cookie: u64,
        links: &mut ProbeLinks,
    ) -> std::result::Result<(), LinkFailure> {
        if let Some(entry_links) = &mut self.entry_links {
            let returns = program == programs::CALL_RETURN;
            let link = entry_links
                .attach(
                    program,
                    (target.open_path, offset),
                    cookie,
                    target.pid,
                    returns,
                )
                .map_err(LinkFailure::Multi)?;
            links.multi.push(link);
            return Ok(());
        }
        let link = self.attach_uprobe(program, target, offset, cookie)?;
        links.uprobes.push((program, link));
        Ok(())
    }

    fn attach_uprobe(
        &mut self,
        program: &str,
        target: &Target,
        offset: u64,
        cookie: u64,
    ) -> std::result::Result<UProbeLinkId, LinkFailure> {
        let name = program;
        let program: &mut UProbe = self
            .ebpf
            .program_mut(name)
            .ok_or_else(|| LinkFailure::MissingProgram(name.into()))?
            .try_into()
            .map_err(LinkFailure::program(name))?;
        // Loaded at its first link, as `linkable` loads the others.
        if program.fd().is_err() {
            program.load().map_err(LinkFailure::program(name))?;
        }
        let point = UProbeAttachPoint {
            location: UProbeAttachLocation::AbsoluteOffset(offset),
            cookie: Some(cookie),
        };
        program
            .attach(point, target.open_path, target.uprobe_scope)
            .map_err(LinkFailure::program(name))
    }

    /// Links `program` as a uprobe session. The kernel says whether it has
    /// sessions only here, at link time (6.1 loads the program but refuses
    /// the link): in `auto` mode the first refusal switches this run to
    /// uretprobes, before any session link exists.
    pub(super) fn link_session(
        &mut self,
        program: &'static str,
        target: &Target,
        offset: u64,
        cookie: u64,
    ) -> std::result::Result<OwnedFd, SessionLink> {
        let Some(sessions) = &mut self.sessions else {
            return Err(SessionLink::Unavailable);
        };
        match sessions.attach(
            program,
            (target.open_path, offset),
            cookie,
            target.pid,
            false,
        ) {
            Ok(link) => {
                self.sessions_linked = true;
                Ok(link)
            }
            Err(e) if e.kernel_lacks() && !self.sessions_linked => {
                if self.return_probes == ReturnProbes::Sessions {
                    return Err(SessionLink::Failed(LinkFailure::SessionsRefused(e)));
                }
                self.sessions = None;
                self.sessions_unavailable = Some(NO_SESSIONS.into());
                Err(SessionLink::Unavailable)
            }
            Err(e) => Err(SessionLink::Failed(LinkFailure::Session(e))),
        }
    }

    /// How calls get their return half in this run, and why, and how entry
    /// probes are linked: for the summary's cost line.
    pub fn return_probes_used(&self) -> String {
        let entries = if self.entry_links.is_some() {
            "uprobe_multi links"
        } else {
            "perf-event uprobes"
        };
        let returns = match (&self.sessions, &self.sessions_unavailable) {
            (Some(_), _) => "uprobe sessions".into(),
            (None, Some(_)) => format!("uretprobes ({NO_SESSIONS})"),
            (None, None) => "uretprobes (--return-probes uretprobes)".into(),
        };
        format!("{returns}; entry probes: {entries}")
    }
}

/// The plain programs that probe an entry point of `shape` when it is not
/// a uprobe session: a uretprobe comes with the entry program.
fn plain_programs(shape: CallShape, return_half: ReturnHalf) -> Vec<&'static str> {
    match return_half {
        ReturnHalf::Uretprobe => vec![shape.program(), programs::CALL_RETURN],
        ReturnHalf::None | ReturnHalf::Session => vec![shape.program()],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_uretprobe_comes_with_the_entry_program_but_not_for_a_free_in_resize() {
        let programs = plain_programs(CallShape::Realloc, ReturnHalf::Uretprobe);
        assert_eq!(programs, [programs::ALLOC_REALLOC, programs::CALL_RETURN]);
        // Without sessions jemalloc's realloc is a plain free: no return half.
        assert!(CallShape::Realloc.returns_by_uretprobe());
        assert!(!CallShape::FreeInResize.returns_by_uretprobe());
        assert!(!CallShape::Free.returns_by_uretprobe());
        let programs = plain_programs(CallShape::FreeInResize, ReturnHalf::None);
        assert_eq!(programs, [programs::FREE_ARG0]);
    }
}
