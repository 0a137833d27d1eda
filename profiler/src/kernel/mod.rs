//! The eBPF side as userspace sees it: load the object, size its maps,
//! attach probes, read its counters. Dropping [`KernelProbes`] detaches
//! every probe (the kernel also does so if memprobe dies: links are fds).
mod allocations_only;
mod attach;
mod calibration;
mod countdowns;
mod counters;
mod detach;
mod error;
mod link;
mod link_failure;
mod linkable;
mod load;
mod mappings;
mod thread_bases;
mod windows;
pub use calibration::CalibrationProbes;
pub use counters::{KernelCounters, ProbeSamples};
pub use error::KernelError;
pub use link_failure::LinkFailure;
pub use load::KernelOptions;
pub mod btf;
pub mod events;
pub mod features;
mod foreign;
mod shared;
pub mod uprobe_multi;
pub use windows::ThreadWindow;

use std::os::fd::OwnedFd;

use aya::{
    Ebpf,
    maps::{HashMap, MapData, RingBuf},
};
use profiler_common::{FastPathConfig, FastPathKey, maps, python::PythonProcess};

use crate::{
    binary::placement::Placement, kernel::error::Result, kernel::uprobe_multi::MultiPrograms,
};

/// The eBPF object built from `profiler-ebpf`.
const OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/profiler"));

/// Which processes a probe fires in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scope {
    /// Only this process: other processes mapping the same file run unprobed.
    Process(u32),
    /// Every process that maps the file (`--all`): each traps on every call.
    AllProcesses,
}

/// Where probes go in each function.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PlacementMode {
    /// On the first instruction the kernel emulates (see `placement`).
    #[default]
    Emulated,
    /// On each function's first instruction, as other tools do.
    Entry,
}

/// How a call whose result is needed gets its return half.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ReturnProbes {
    /// Sessions if the kernel loads them, else uretprobes.
    #[default]
    Auto,
    /// Uprobe sessions (Linux 6.13+): the return half runs for sampled
    /// calls only. Fails on older kernels.
    Sessions,
    /// A uretprobe on every call, as on kernels before 6.13.
    Uretprobes,
}

/// What runs when a probed call returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReturnHalf {
    /// Nothing: the entry has all it needs (free).
    None,
    /// A uretprobe: every call traps again at its return.
    Uretprobe,
    /// A uprobe session: only sampled calls trap at their return.
    Session,
}

/// One attached entry point, for `--verbose` and the cost report.
#[derive(Clone, Debug)]
pub struct AttachedProbe {
    pub scope: Scope,
    pub symbol: String,
    pub path: String,
    /// Which file is probed, whatever its path (`None`: not known).
    pub file: Option<crate::proc::FileId>,
    /// File offset of the function.
    pub file_offset: u64,
    pub placement: Placement,
    pub return_half: ReturnHalf,
    pub instance: u16,
    pub allocator: crate::discover::AllocatorKind,
    /// What the entry point's arguments are: a free, an allocation...
    pub shape: profiler_common::CallShape,
    /// Attached only in sampling windows (`--sampling windows`).
    pub windowed: bool,
    /// For jemalloc's slow path, reached through its own code (`operator
    /// new`'s fallback): the file-offset extents of that code, where a
    /// sample's leading frames are not the program's. `None` elsewhere.
    pub own_code: Option<std::sync::Arc<[std::ops::Range<u64>]>>,
}

/// The kernel links of one attached entry point.
#[derive(Debug, Default)]
struct ProbeLinks {
    /// Plain uprobes and uretprobes: (program, link).
    uprobes: Vec<(&'static str, aya::programs::uprobe::UProbeLinkId)>,
    /// uprobe_multi links: a session, or entry programs; closing an fd
    /// detaches it.
    multi: Vec<OwnedFd>,
}

impl ProbeLinks {
    fn is_empty(&self) -> bool {
        self.uprobes.is_empty() && self.multi.is_empty()
    }
}

pub struct KernelProbes {
    ebpf: Ebpf,
    pub attached: Vec<AttachedProbe>,
    placement: PlacementMode,
    return_probes: ReturnProbes,
    sessions: Option<MultiPrograms>,
    /// The plain programs (entry and uretprobe) as uprobe_multi links:
    /// loaded once the kernel has taken one (`check_links`), dropped again
    /// if a calibration thread other than the main one did not hit it (6.6
    /// to 6.9 filter by thread, not process); aya's perf-event uprobes
    /// while `None`.
    entry_links: Option<MultiPrograms>,
    /// The programs that `sessions`, `entry_links` and the mapping probes
    /// load as they link; `None` where the object could not be prepared.
    linkable: Option<std::sync::Arc<linkable::LinkableCode>>,
    /// Why sessions are not used, when they were wanted (`--verbose`).
    pub sessions_unavailable: Option<String>,
    /// Each attached probe's links, in the order of `attached` (empty once
    /// detached); dropping them detaches.
    links: Vec<ProbeLinks>,
    /// Whether the kernel ever took a session link: after that, a refusal
    /// is an error, not a missing feature.
    sessions_linked: bool,
    /// Where other tools' links force returns (`foreign`), as last read.
    foreign: foreign::ForcingPlaces,
    frame_pointer_fast_path: bool,
    /// `--track allocations`: no process's frees are probed.
    allocations_only: bool,
    /// Processes whose frees were dropped to stay within their budget.
    frees_dropped: std::collections::HashSet<u32>,
    /// Under `--track allocations`, processes whose frees are followed
    /// for a while, as an endpoint asked.
    frees_followed: std::collections::HashSet<u32>,
    /// Why the kernel cannot tell of newly mapped code (`--verbose`):
    /// then rescans alone find `dlopen`ed libraries.
    pub mapped_code_unavailable: Option<LinkFailure>,
    /// Each profiled process's probes of what it maps.
    mappings: mappings::MappingProbes,
    /// Whether the kernel's BTF placed a task's fs base.
    knows_fsbase: bool,
    /// Why the kernel refused the iterator that lists threads' fs bases
    /// (`--verbose`); not tried without the fs base.
    pub threads_unlisted: Option<String>,
    /// Each attached probe's samples, as their records arrived.
    samples: Vec<counters::ProbeSamples>,
}

impl KernelProbes {
    /// Whether processes may be trusted with frame pointers (`--unwind auto`).
    pub fn frame_pointer_fast_path(&self) -> bool {
        self.frame_pointer_fast_path
    }

    /// Lets `pid`'s samples go without a stack copy (but one in
    /// [`FP_CHECK_ONE_IN`](profiler_common::FP_CHECK_ONE_IN)), or not. A
    /// full table only means more copies.
    pub fn trust_frame_pointers(&mut self, pid: u32, trusted: bool) {
        self.set_pid(maps::FP_TRUSTED, pid, trusted.then_some(1u8));
    }

    /// Puts `value` under `pid` in the table `map`, keyed by pid, or takes
    /// `pid` out (`None`); whether the kernel took it (not if full).
    fn set_pid<V: aya::Pod>(&mut self, map: &str, pid: u32, value: Option<V>) -> bool {
        let Some(map) = self.ebpf.map_mut(map) else {
            return false;
        };
        let Ok(mut table) = HashMap::<_, u32, V>::try_from(map) else {
            return false;
        };
        match value {
            Some(value) => table.insert(pid, value, 0).is_ok(),
            None => table.remove(&pid).is_ok(),
        }
    }

    /// The event ring buffer; can be taken once.
    pub fn take_events(&mut self) -> Result<RingBuf<MapData>> {
        let map = self
            .ebpf
            .take_map(maps::EVENTS)
            .ok_or_else(|| KernelError::Events {
                what: "taking the ring buffer",
                cause: "it was taken already".into(),
            })?;
        RingBuf::try_from(map).map_err(|e| KernelError::Events {
            what: "opening the ring buffer",
            cause: e.into(),
        })
    }

    /// For each attached probe: `None` once detached, else whether each of
    /// its calls traps at its return for another profiled process's probe
    /// at the same place (see `shared`).
    pub fn forced_returns(&self) -> Vec<Option<bool>> {
        let live: Vec<bool> = self.links.iter().map(|links| !links.is_empty()).collect();
        shared::forced_returns(&self.attached, &live, &self.foreign)
    }

    /// Reads again where other tools' links (another memprobe's among
    /// them) force returns in processes they are not made for.
    pub fn read_foreign_links(&mut self) {
        let own: std::collections::HashSet<u32> = [&self.sessions, &self.entry_links]
            .into_iter()
            .flatten()
            .flat_map(MultiPrograms::program_ids)
            .chain(self.mappings.program_ids())
            .collect();
        self.foreign = foreign::forcing_places(&own);
    }

    /// Tells the slow-path program where `pid`'s copy `instance` of
    /// jemalloc keeps a thread's counters.
    pub fn set_fast_path(&mut self, pid: u32, instance: u16, config: FastPathConfig) -> bool {
        let Some(map) = self.ebpf.map_mut(maps::FAST_PATHS) else {
            return false;
        };
        let Ok(mut table) = HashMap::<_, FastPathKey, FastPathConfig>::try_from(map) else {
            return false;
        };
        let key = FastPathKey {
            pid,
            instance: u32::from(instance),
        };
        table.insert(key, config, 0).is_ok()
    }

    /// Has the kernel walk `pid`'s Python frames with each of its samples;
    /// false if its table is full.
    pub fn watch_python(&mut self, pid: u32, process: PythonProcess) -> bool {
        self.set_pid(maps::PYTHON_PROCESSES, pid, Some(process))
    }

    /// Takes `pid` out of the Python table, once it exited or was detached.
    pub fn forget_python(&mut self, pid: u32) {
        self.set_pid::<PythonProcess>(maps::PYTHON_PROCESSES, pid, None);
    }

    /// Takes `pid`'s copies out of the slow-path program's table, once it
    /// exited or was detached: the table is bounded, and an agent meets
    /// thousands of processes over its life.
    pub fn forget_fast_paths(&mut self, pid: u32) {
        let Some(map) = self.ebpf.map_mut(maps::FAST_PATHS) else {
            return;
        };
        let Ok(mut table) = HashMap::<_, FastPathKey, FastPathConfig>::try_from(map) else {
            return;
        };
        let keys: Vec<FastPathKey> = table.keys().flatten().filter(|k| k.pid == pid).collect();
        for key in keys {
            let _ = table.remove(&key);
        }
    }
}

#[cfg(test)]
mod tests {
    use object::{Object, ObjectSymbol};

    use profiler_common::{globals, programs};

    use super::*;

    /// A misspelt name would give silent zeros (a map lookup that finds
    /// nothing) or a probe that never loads: every name userspace uses must
    /// be in the object it embeds, as aya-obj reads it (maps, programs) and
    /// as a symbol (the globals userspace sets).
    #[test]
    fn every_name_userspace_uses_is_in_the_object() {
        let parsed = aya_obj::Object::parse(OBJECT).unwrap();
        for map in maps::ALL {
            assert!(
                parsed.maps.contains_key(map),
                "map {map} is not in the object"
            );
        }
        let programs = (programs::ALL.iter())
            .chain(&programs::session::ALL)
            .chain(&[programs::THREAD_BASES]);
        for program in programs {
            assert!(
                parsed.programs.contains_key(*program),
                "program {program} is not in the object"
            );
        }
        // The shape table names only programs the object has.
        for shape in profiler_common::CallShape::ALL {
            assert!(parsed.programs.contains_key(shape.program()), "{shape:?}");
            if let Some(session) = shape.session_program() {
                assert!(parsed.programs.contains_key(session), "{shape:?}");
            }
        }
        let file = object::File::parse(OBJECT).unwrap();
        let symbols: std::collections::HashSet<&str> =
            file.symbols().filter_map(|s| s.name().ok()).collect();
        for global in globals::ALL {
            assert!(
                symbols.contains(global),
                "global {global} is not in the object"
            );
        }
    }
}
