//! What the run tells its user on stderr while it runs, as typed notices:
//! the parts decide what happened, and the run says it, each line
//! starting with `memprobe: ` and clearing the progress line first.
use std::fmt;

use crate::run::Session;

/// Something a part of the run has to tell the user.
#[derive(Debug, Clone, PartialEq)]
pub(in crate::run) enum Notice {
    Targets(TargetNotice),
    Sampling(SamplingNotice),
    Cost(CostNotice),
}

/// What was found in the processes, or not, and how it was probed.
#[derive(Debug, Clone, PartialEq)]
pub(in crate::run) enum TargetNotice {
    /// A library with an allocator mapped since the last look, probed.
    Loaded {
        pid: u32,
        /// "jemalloc in /usr/lib/libjemalloc.so.2", one per copy.
        copies: Vec<String>,
        probes: usize,
        /// How long after its mapping, where the kernel told of it.
        after_ms: Option<u64>,
    },
    /// A copy found after the start that could not be probed.
    LateAttachFailed { error: String },
    /// A process's maps could not be rescanned.
    RescanFailed { error: String },
    /// A file with jemalloc that cannot be probed (`note` says why).
    NotProbed { pid: u32, note: String },
    /// jemalloc found by its code, and how (`--verbose`).
    FoundByCode { pid: Option<u32>, note: String },
    /// jemalloc found by its code with entry points it could not find.
    EntryPointsUnseen {
        pid: Option<u32>,
        file: String,
        missing: Vec<String>,
    },
    /// A process runs CPython: its samples carry their Python frames where
    /// memprobe reads its version (`--verbose`), its native ones alone
    /// where not.
    Python {
        pid: u32,
        version: String,
        path: String,
        read: bool,
    },
    /// No allocation call through any allocator found, for a while.
    Silent {
        pid: u32,
        command: String,
        seconds: u64,
        allocators: Vec<String>,
    },
}

/// Why frees are followed for a while under `--track allocations`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::run) enum FollowCause {
    /// A delta asked of the endpoints.
    Request,
    /// An `rss:` growth trigger fired.
    Growth,
}

/// How a process's allocations are sampled, and changes to it.
#[derive(Debug, Clone, PartialEq)]
pub(in crate::run) enum SamplingNotice {
    /// How a copy is sampled, and why (`--verbose`).
    Sampling { pid: u32, note: String },
    /// Under `--track allocations`, its frees followed for a while: for a
    /// delta asked of the endpoints, or after its resident memory grew.
    FreesFollowed {
        pid: u32,
        seconds: u64,
        cause: FollowCause,
    },
    /// And no longer.
    FreesFollowedEnd { pid: u32 },
    /// jemalloc's profiler is on but does not sample (`--verbose`).
    OwnProfilerUnused { pid: u32, path: String, why: String },
    /// jemalloc's profiler was switched on or off while profiled.
    OwnProfilerSwitched {
        pid: u32,
        path: String,
        active: bool,
        /// In-use allocations memprobe had sampled itself, no longer
        /// followed once jemalloc's samples are taken.
        forgotten: usize,
    },
    /// A copy whose probes could not be attached again.
    SamplingLost {
        pid: u32,
        path: String,
        error: String,
    },
    /// A copy's sampling windows (`--verbose`): `note` says how.
    WindowsStarted {
        pid: u32,
        path: String,
        note: String,
    },
    /// Windows made rarer: at every call they cost `cost` of a CPU, the
    /// process using `own` itself (`--verbose`).
    WindowsRarer {
        pid: u32,
        duty: f64,
        cost: f64,
        own: f64,
        /// How long every call was probed before it closed.
        after: std::time::Duration,
    },
    /// Windows back to every call, cheap enough (`--verbose`).
    EveryCallAgain { pid: u32, cost: f64 },
    /// A window could not open; `at_entry` whether its calls are sampled
    /// at every call instead.
    WindowRefused {
        pid: u32,
        path: String,
        why: String,
        at_entry: bool,
    },
}

/// What the probes cost, and the budget's steps.
#[derive(Debug, Clone, PartialEq)]
pub(in crate::run) enum CostNotice {
    /// The budget's first step.
    WindowsNarrowed {
        pid: u32,
        /// Their least share of the time, which they open from now on.
        duty: f64,
        reason: String,
    },
    /// The budget's second step.
    FreesDropped { pid: u32, reason: String },
    /// A uprobe session made for another process traps at these
    /// functions' returns in this one too.
    ForcedReturns {
        pid: u32,
        path: String,
        symbols: Vec<String>,
    },
    /// Probe costs measured (`--verbose`).
    ProbeCosts(String),
}

impl Notice {
    /// Said only with `--verbose`.
    fn verbose_only(&self) -> bool {
        matches!(
            self,
            Notice::Targets(
                TargetNotice::FoundByCode { .. } | TargetNotice::Python { read: true, .. }
            ) | Notice::Sampling(
                SamplingNotice::Sampling { .. }
                    | SamplingNotice::OwnProfilerUnused { .. }
                    | SamplingNotice::WindowsStarted { .. }
                    | SamplingNotice::WindowsRarer { .. }
                    | SamplingNotice::EveryCallAgain { .. }
            ) | Notice::Cost(CostNotice::ProbeCosts(_))
        )
    }
}

impl fmt::Display for Notice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Notice::Targets(notice) => notice.fmt(f),
            Notice::Sampling(notice) => notice.fmt(f),
            Notice::Cost(notice) => notice.fmt(f),
        }
    }
}

impl From<TargetNotice> for Notice {
    fn from(notice: TargetNotice) -> Self {
        Notice::Targets(notice)
    }
}

impl From<SamplingNotice> for Notice {
    fn from(notice: SamplingNotice) -> Self {
        Notice::Sampling(notice)
    }
}

impl From<CostNotice> for Notice {
    fn from(notice: CostNotice) -> Self {
        Notice::Cost(notice)
    }
}

/// "pid 12: " for one process, nothing for system-wide probes.
fn whose(pid: Option<u32>) -> String {
    pid.map_or(String::new(), |pid| format!("pid {pid}: "))
}

impl fmt::Display for TargetNotice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Python {
                pid,
                version,
                path,
                read: true,
            } => write!(
                f,
                "pid {pid} runs Python {version} ({path}): its stacks show their Python lines"
            ),
            Self::Python {
                pid, version, path, ..
            } => write!(
                f,
                "pid {pid} runs Python {version} ({path}), whose frames memprobe cannot read \
                 (it reads {}): its stacks stay native",
                crate::python::VERSIONS_READ
            ),
            Self::Loaded {
                pid,
                copies,
                probes,
                after_ms,
            } => {
                write!(
                    f,
                    "pid {pid} loaded {}: attached {probes} probes",
                    copies.join(", ")
                )?;
                match after_ms {
                    Some(ms) => write!(f, ", {ms} ms after it was mapped"),
                    None => Ok(()),
                }
            }
            Self::LateAttachFailed { error } => {
                write!(f, "warning: {error}; profiling goes on without it")
            }
            Self::RescanFailed { error } => write!(f, "warning: {error}"),
            Self::NotProbed { pid, note } => write!(
                f,
                "warning: pid {pid}: {note}; give its debug file with --debug-dir"
            ),
            Self::FoundByCode { pid, note } => write!(f, "{}{note}", whose(*pid)),
            Self::EntryPointsUnseen { pid, file, missing } => write!(
                f,
                "{}{file}: jemalloc's entry points found by their code; calls to {} are not seen",
                whose(*pid),
                missing.join(", ")
            ),
            Self::Silent {
                pid,
                command,
                seconds,
                allocators,
            } => write!(
                f,
                "pid {pid} ({command}): no allocation call in {seconds}s through the allocators \
                 found ({}): it allocates through another allocator, or is idle",
                allocators.join(", ")
            ),
        }
    }
}

impl fmt::Display for SamplingNotice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Sampling { pid, note } => write!(f, "pid {pid}: {note}"),
            Self::OwnProfilerUnused { pid, path, why } => write!(
                f,
                "pid {pid}: {path}: jemalloc's profiler is built in and on but {why}: its \
                 samples are not used"
            ),
            Self::OwnProfilerSwitched {
                pid,
                path,
                active,
                forgotten,
            } => own_profiler_switched(f, (*pid, path), *active, *forgotten),
            Self::FreesFollowed {
                pid,
                seconds,
                cause,
            } => {
                let why = match cause {
                    FollowCause::Request => "as /debug/pprof/heap?seconds= asked",
                    FollowCause::Growth => "after its resident memory grew (--follow-on-growth)",
                };
                write!(f, "pid {pid}: frees followed for {seconds} s, {why}")
            }
            Self::FreesFollowedEnd { pid } => {
                write!(
                    f,
                    "pid {pid}: frees no longer followed: allocations only again"
                )
            }
            Self::SamplingLost { pid, path, error } => write!(
                f,
                "warning: pid {pid}: {path}: {error}; its allocations are no longer sampled"
            ),
            Self::WindowsStarted { pid, path, note } => {
                write!(f, "pid {pid}: {path}: {note}")
            }
            Self::WindowsRarer {
                pid,
                duty,
                cost,
                own,
                after,
            } => write!(
                f,
                "pid {pid}: malloc in windows {:.1}% of the time from now (at every call it \
                 cost {:.1}% of a CPU for {:.1} s; the process used {:.0}% of one itself)",
                duty * 100.0,
                cost * 100.0,
                after.as_secs_f64(),
                own * 100.0
            ),
            Self::EveryCallAgain { pid, cost } => write!(
                f,
                "pid {pid}: malloc at every call again (in its last window it cost {:.1}% of a \
                 CPU)",
                cost * 100.0
            ),
            Self::WindowRefused {
                pid,
                path,
                why,
                at_entry,
            } => write!(
                f,
                "warning: pid {pid}: {path}: a sampling window could not open ({why}); {}",
                if *at_entry {
                    "malloc and operator new sampled at every call from now on"
                } else {
                    "malloc and operator new are no longer sampled"
                }
            ),
        }
    }
}

/// A copy's jemalloc profiler switched on (`active`) or off.
fn own_profiler_switched(
    f: &mut fmt::Formatter<'_>,
    (pid, path): (u32, &str),
    active: bool,
    forgotten: usize,
) -> fmt::Result {
    write!(f, "pid {pid}: {path}: jemalloc's profiler was made ")?;
    if active {
        write!(
            f,
            "active; memprobe takes its samples from now on, and no longer follows the \
             {forgotten} allocations in use it had sampled itself"
        )
    } else {
        f.write_str(
            "inactive (prof.active false); memprobe samples its allocations itself from now on",
        )
    }
}

impl fmt::Display for CostNotice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::WindowsNarrowed { pid, duty, reason } => write!(
                f,
                "pid {pid}: malloc windows narrowed to {:.1}% of the time, {reason}",
                duty * 100.0
            ),
            Self::FreesDropped { pid, reason } => {
                write!(f, "pid {pid}: frees no longer tracked, {reason}")
            }
            Self::ForcedReturns { pid, path, symbols } => write!(
                f,
                "pid {pid} maps {path} as another profiled process does: each call of its {} \
                 now traps at its return too, sampled or not (a uprobe session made for another \
                 process asks for the return half of every call it is filtered out of); counted \
                 in its cost",
                symbols.join(", ")
            ),
            Self::ProbeCosts(line) => f.write_str(line),
        }
    }
}

impl Session<'_> {
    /// Says `notice` on stderr (a `--verbose` one only with `--verbose`).
    pub(in crate::run) fn say(&mut self, notice: impl Into<Notice>) {
        let notice = notice.into();
        if notice.verbose_only() && !self.options.verbose {
            return;
        }
        self.clear_progress();
        let _ = writeln!(self.status, "memprobe: {notice}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_loaded_library_says_how_soon_when_known() {
        let notice = TargetNotice::Loaded {
            pid: 7,
            copies: vec!["jemalloc in /lib/libjemalloc.so.2".into()],
            probes: 9,
            after_ms: Some(12),
        };
        assert_eq!(
            notice.to_string(),
            "pid 7 loaded jemalloc in /lib/libjemalloc.so.2: attached 9 probes, 12 ms after it \
             was mapped"
        );
    }

    #[test]
    fn only_the_run_s_details_wait_for_verbose() {
        assert!(Notice::from(CostNotice::ProbeCosts(String::new())).verbose_only());
        let dropped = Notice::from(CostNotice::FreesDropped {
            pid: 1,
            reason: "over budget".into(),
        });
        assert!(!dropped.verbose_only());
        assert_eq!(
            dropped.to_string(),
            "pid 1: frees no longer tracked, over budget"
        );
    }

    /// The budget's lines fit a terminal (with a seven-digit pid), where
    /// the profile keeps how the share was reckoned.
    #[test]
    fn the_budget_s_lines_fit_a_terminal() {
        let over = crate::run::budget::OverBudget {
            share: 1.47,
            limit: 0.10,
        };
        let (pid, reason) = (4_194_304, over.brief());
        let lines = [
            CostNotice::WindowsNarrowed {
                pid,
                duty: crate::run::sampling::windows::WindowTiming::default().least_duty(),
                reason: reason.clone(),
            },
            CostNotice::FreesDropped { pid, reason },
        ];
        for line in lines.map(|n| format!("memprobe: {}", Notice::from(n))) {
            assert!(line.len() <= 120, "{} columns: {line}", line.len());
            assert!(line.contains("147% of its CPU, limit 10%"), "{line}");
        }
        assert!(over.to_string().contains("more allowed for the caches"));
    }
}
