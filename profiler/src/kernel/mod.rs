//! The eBPF side as userspace sees it: load the object, size its maps,
//! attach probes, read its counters. Dropping [`KernelProbes`] detaches
//! every probe (the kernel also does so if memprobe dies: links are fds).
mod allocations_only;
mod attach;
mod calibration;
mod link_failure;
mod mapped_code;
mod windows;
pub use calibration::CalibrationProbes;
pub use link_failure::LinkFailure;
pub mod btf;
pub mod events;
pub mod features;
mod foreign;
mod shared;
pub mod uprobe_multi;
pub use windows::ThreadWindow;

use std::os::fd::OwnedFd;

use aya::{
    Ebpf, EbpfLoader,
    maps::{Array, HashMap, MapData, PerCpuArray, RingBuf},
    programs::UProbe,
};
use profiler_common::{Counter, FastPathConfig, FastPathKey, globals, maps, programs};

use crate::{
    collect::sampling,
    discover::placement::Placement,
    error::{Error, Result},
    kernel::uprobe_multi::{LinkKind, MultiPrograms},
};

/// The eBPF object built from `profiler-ebpf`.
const OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/profiler"));

/// Sizes of the kernel's tables.
#[derive(Clone, Debug)]
pub struct KernelOptions {
    /// Sampled pointers the kernel tracks for frees. Default: 262144.
    pub max_sampled_pointers: u32,
    /// Ring-buffer size in bytes (a power of two). Default: 8 MiB.
    pub ring_buffer_bytes: u32,
    /// Where in each function probes go. Default: emulated instructions.
    pub placement: PlacementMode,
    /// How calls get their return half. Default: sessions where the kernel
    /// has them.
    pub return_probes: ReturnProbes,
    /// Copy each sampled call's user stack for DWARF unwinding. Default: yes.
    pub copy_stack: bool,
    /// Let processes whose frame-pointer walks proved right skip most
    /// copies ([`KernelProbes::trust_frame_pointers`]). Default: yes.
    pub frame_pointer_fast_path: bool,
    /// `--track allocations`: probe allocating entry points only, at their
    /// entry: no free probes and no return halves. Default: no.
    pub allocations_only: bool,
}

impl Default for KernelOptions {
    fn default() -> Self {
        Self {
            max_sampled_pointers: 262_144,
            ring_buffer_bytes: 8 << 20,
            placement: PlacementMode::Emulated,
            return_probes: ReturnProbes::Auto,
            copy_stack: true,
            frame_pointer_fast_path: true,
            allocations_only: false,
        }
    }
}

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

/// The kernel's counters, each read by its [`Counter`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KernelCounters([u64; Counter::COUNT as usize]);

impl KernelCounters {
    pub fn get(&self, counter: Counter) -> u64 {
        self.0[counter as usize]
    }
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
    /// Why the kernel cannot tell of newly mapped code (`--verbose`):
    /// then rescans alone find `dlopen`ed libraries.
    pub mapped_code_unavailable: Option<LinkFailure>,
}

/// `thread.fsbase` in `struct task_struct`, from the kernel's BTF; 0 when
/// unknown (then nothing is sampled on jemalloc's slow path).
fn task_fsbase_offset() -> u64 {
    std::fs::read("/sys/kernel/btf/vmlinux")
        .ok()
        .and_then(|btf| btf::fsbase_offset(&btf))
        .unwrap_or(0)
}

fn load_error(what: &str, cause: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Error {
    Error::Load {
        what: what.to_owned(),
        cause: cause.into(),
    }
}

/// The table the kernel draws each thread's byte countdowns from, for a
/// mean of `sample_interval` bytes.
fn set_countdowns(ebpf: &mut Ebpf, sample_interval: u64) -> Result<()> {
    let mut table: Array<_, u64> = Array::try_from(
        ebpf.map_mut(maps::EXP_QUANTILES)
            .ok_or_else(|| load_error(maps::EXP_QUANTILES, "missing"))?,
    )
    .map_err(|e| load_error(maps::EXP_QUANTILES, e))?;
    for (index, value) in sampling::quantile_table(sample_interval)
        .into_iter()
        .enumerate()
    {
        table
            .set(index as u32, value, 0)
            .map_err(|e| load_error(maps::EXP_QUANTILES, e))?;
    }
    Ok(())
}

/// The uprobe session programs, where the kernel has sessions and the
/// run may use them; else why not (`auto` falls back to uretprobes,
/// `sessions` fails).
fn load_sessions(
    ebpf: &Ebpf,
    wanted: ReturnProbes,
) -> Result<(Option<MultiPrograms>, Option<String>)> {
    if wanted == ReturnProbes::Uretprobes {
        return Ok((None, None));
    }
    match MultiPrograms::load(ebpf, OBJECT, &programs::session::ALL, LinkKind::Session) {
        Ok(sessions) => Ok((Some(sessions), None)),
        Err(e) if wanted == ReturnProbes::Sessions => Err(Error::SessionsRefused(e)),
        Err(e) => Ok((None, Some(e.to_string()))),
    }
}

impl KernelProbes {
    /// Loads the programs into the kernel; nothing is attached yet.
    pub fn load(options: &KernelOptions, sample_interval: u64) -> Result<Self> {
        let placement = options.placement;
        let mut ebpf = EbpfLoader::new()
            .map_max_entries(maps::SAMPLED, options.max_sampled_pointers)
            .map_max_entries(maps::EVENTS, options.ring_buffer_bytes)
            .override_global(globals::COPY_STACK, &u8::from(options.copy_stack), true)
            .override_global(
                globals::RING_BUSY_BYTES,
                &(options.ring_buffer_bytes as u64 / 2),
                true,
            )
            .override_global(globals::TASK_FSBASE, &task_fsbase_offset(), true)
            .override_global(globals::OWN_TGID, &std::process::id(), true)
            .load(OBJECT)
            .map_err(|e| load_error("eBPF object", e))?;
        set_countdowns(&mut ebpf, sample_interval)?;
        for name in programs::ALL {
            let program: &mut UProbe = ebpf
                .program_mut(name)
                .ok_or_else(|| load_error(name, "missing"))?
                .try_into()
                .map_err(|e| load_error(name, e))?;
            program.load().map_err(|e| load_error(name, e))?;
        }
        let mapped_code_unavailable = mapped_code::attach(&mut ebpf).err();
        let (sessions, sessions_unavailable) = load_sessions(&ebpf, options.return_probes)?;
        Ok(Self {
            entry_links: None,
            ebpf,
            attached: Vec::new(),
            placement,
            return_probes: options.return_probes,
            sessions,
            sessions_unavailable,
            links: Vec::new(),
            sessions_linked: false,
            foreign: foreign::ForcingPlaces::new(),
            frame_pointer_fast_path: options.copy_stack && options.frame_pointer_fast_path,
            allocations_only: options.allocations_only,
            frees_dropped: std::collections::HashSet::new(),
            mapped_code_unavailable,
        })
    }

    /// Whether processes may be trusted with frame pointers (`--unwind auto`).
    pub fn frame_pointer_fast_path(&self) -> bool {
        self.frame_pointer_fast_path
    }

    /// Lets `pid`'s samples go without a stack copy (but one in
    /// [`FP_CHECK_ONE_IN`](profiler_common::FP_CHECK_ONE_IN)), or not. A
    /// full table only means more copies.
    pub fn trust_frame_pointers(&mut self, pid: u32, trusted: bool) {
        self.set_pid(maps::FP_TRUSTED, pid, trusted);
    }

    /// Puts `pid` in the pid table `map`, or takes it out.
    fn set_pid(&mut self, map: &str, pid: u32, present: bool) {
        let Some(map) = self.ebpf.map_mut(map) else {
            return;
        };
        let Ok(mut table) = HashMap::<_, u32, u8>::try_from(map) else {
            return;
        };
        let _ = if present {
            table.insert(pid, 1, 0)
        } else {
            table.remove(&pid)
        };
    }

    /// The event ring buffer; can be taken once.
    pub fn take_events(&mut self) -> Result<RingBuf<MapData>> {
        let map = self
            .ebpf
            .take_map(maps::EVENTS)
            .ok_or_else(|| Error::Events {
                what: "taking the ring buffer",
                cause: "it was taken already".into(),
            })?;
        RingBuf::try_from(map).map_err(|e| Error::Events {
            what: "opening the ring buffer",
            cause: e.into(),
        })
    }

    /// Hits of each attached entry point, summed over CPUs, in the order of
    /// [`attached`](Self::attached).
    pub fn probe_hits(&self) -> Vec<u64> {
        let mut hits = vec![0; self.attached.len()];
        let Some(map) = self.ebpf.map(maps::PROBE_HITS) else {
            return hits;
        };
        let Ok(counters) = PerCpuArray::<_, u64>::try_from(map) else {
            return hits;
        };
        for (index, slot) in hits.iter_mut().enumerate() {
            if let Ok(values) = counters.get(&(index as u32), 0) {
                *slot = values.iter().sum();
            }
        }
        hits
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

    /// Whether the kernel's BTF told where a task's fs base is (what
    /// sampling on jemalloc's slow path reads).
    pub fn knows_fsbase() -> bool {
        task_fsbase_offset() != 0
    }

    /// Zeroes the kernel counters and the hit counts: what calibration
    /// counted is not the targets'.
    /// Hits of the calibration's probes (the last counter slot), since the
    /// counters were last reset.
    pub fn calibration_hits(&self) -> u64 {
        let Some(map) = self.ebpf.map(maps::PROBE_HITS) else {
            return 0;
        };
        let Ok(counters) = PerCpuArray::<_, u64>::try_from(map) else {
            return 0;
        };
        counters
            .get(&(profiler_common::MAX_COUNTED_PROBES - 1), 0)
            .map_or(0, |values| values.iter().sum())
    }

    pub fn reset_counters(&mut self) {
        for (name, slots) in [
            (maps::COUNTERS, Counter::COUNT),
            (maps::PROBE_HITS, profiler_common::MAX_COUNTED_PROBES),
        ] {
            let Some(map) = self.ebpf.map_mut(name) else {
                continue;
            };
            let Ok(mut counters) = PerCpuArray::<_, u64>::try_from(map) else {
                continue;
            };
            let cpus = aya::util::nr_cpus().map_or(1, |n| n.max(1));
            for index in 0..slots {
                if let Ok(zeros) = aya::maps::PerCpuValues::try_from(vec![0u64; cpus]) {
                    let _ = counters.set(index, zeros, 0);
                }
            }
        }
    }

    /// Kernel counters summed over CPUs.
    pub fn counters(&self) -> KernelCounters {
        let mut totals = KernelCounters::default();
        let Some(map) = self.ebpf.map(maps::COUNTERS) else {
            return totals;
        };
        let Ok(counters) = PerCpuArray::<_, u64>::try_from(map) else {
            return totals;
        };
        for counter in Counter::ALL {
            if let Ok(values) = counters.get(&(counter as u32), 0) {
                totals.0[counter as usize] = values.iter().sum();
            }
        }
        totals
    }
}

#[cfg(test)]
mod tests {
    use object::{Object, ObjectSymbol};

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
        let programs = programs::ALL.iter().chain(&programs::session::ALL);
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
