//! The eBPF side as userspace sees it: load the object, size its maps,
//! attach probes, read its counters. Dropping [`KernelProbes`] detaches
//! every probe (the kernel also does so if memprobe dies: links are fds).
pub mod events;
pub mod features;
pub mod uprobe_session;
use std::{num::NonZeroU32, os::fd::OwnedFd, path::Path};

use aya::{
    Ebpf, EbpfLoader,
    maps::{Array, HashMap, MapData, PerCpuArray, RingBuf},
    programs::{
        UProbe,
        uprobe::{UProbeAttachLocation, UProbeAttachPoint, UProbeLinkId, UProbeScope},
    },
};
use profiler_common::{Counter, cookie, globals, maps, programs};

use crate::{
    collect::sampling,
    discover::Allocator,
    discover::entry_points::CallShape,
    discover::entry_points::EntryPoint,
    discover::placement::Placement,
    error::{Error, Result},
    kernel::features::KernelFeature,
    kernel::uprobe_session::SessionPrograms,
};

/// The eBPF object built from `profiler-ebpf`.
const OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/profiler"));

/// Sizes of the kernel's tables.
#[derive(Clone, Debug)]
pub struct KernelOptions {
    /// Mean sampling interval in bytes. Default: 512 KiB, as jemalloc.
    pub sample_interval: u64,
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
}

impl Default for KernelOptions {
    fn default() -> Self {
        Self {
            sample_interval: sampling::DEFAULT_SAMPLE_INTERVAL,
            max_sampled_pointers: 262_144,
            ring_buffer_bytes: 8 << 20,
            placement: PlacementMode::Emulated,
            return_probes: ReturnProbes::Auto,
            copy_stack: true,
            frame_pointer_fast_path: true,
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

/// One attached entry point, for `--verbose` and the cost report.
#[derive(Clone, Debug)]
pub struct AttachedProbe {
    pub scope: Scope,
    pub symbol: String,
    pub path: String,
    /// File offset of the function.
    pub file_offset: u64,
    pub placement: Placement,
    pub return_half: ReturnHalf,
    pub instance: u16,
}

pub struct KernelProbes {
    ebpf: Ebpf,
    pub attached: Vec<AttachedProbe>,
    placement: PlacementMode,
    return_probes: ReturnProbes,
    sessions: Option<SessionPrograms>,
    /// Why sessions are not used, when they were wanted (`--verbose`).
    pub sessions_unavailable: Option<String>,
    /// Session links; dropping them detaches.
    session_links: Vec<OwnedFd>,
    /// Whether the kernel ever took a session link: after that, a refusal
    /// is an error, not a missing feature.
    sessions_linked: bool,
    frame_pointer_fast_path: bool,
}

/// The summary's words for a run on uretprobes because the kernel has no
/// uprobe sessions.
const NO_SESSIONS: &str = "kernel has no uprobe sessions";

/// Where one allocator copy's probes go.
struct Target<'a> {
    scope: Scope,
    pid: u32,
    uprobe_scope: UProbeScope,
    path: &'a str,
    open_path: &'a Path,
}

impl<'a> Target<'a> {
    fn new(scope: Scope, path: &'a str, open_path: &'a Path) -> Result<Self> {
        let (pid, uprobe_scope) = match scope {
            Scope::Process(pid) => (
                pid,
                UProbeScope::OneProcess(NonZeroU32::new(pid).ok_or(Error::NoSuchProcess(0))?),
            ),
            Scope::AllProcesses => (0, UProbeScope::AllProcesses),
        };
        Ok(Self {
            scope,
            pid,
            uprobe_scope,
            path,
            open_path,
        })
    }

    fn error(&self, entry_point: &str, message: String) -> Error {
        Error::Attach {
            pid: self.pid,
            entry_point: entry_point.into(),
            path: self.path.into(),
            message,
        }
    }
}

/// Why an entry point did not get a session link.
enum SessionLink {
    /// No sessions in this run: use a uretprobe.
    Unavailable,
    /// The attach failed.
    Failed(String),
}

const ALL_PROGRAMS: [&str; 10] = [
    programs::ALLOC_SIZE_ARG0,
    programs::ALLOC_SIZE_ARG1,
    programs::ALLOC_CALLOC,
    programs::ALLOC_REALLOC,
    programs::ALLOC_POSIX_MEMALIGN,
    programs::ALLOC_MALLOCX,
    programs::ALLOC_RALLOCX,
    programs::RESIZE_XALLOCX,
    programs::FREE_ARG0,
    programs::CALL_RETURN,
];

fn load_error(what: &str, error: impl std::fmt::Display) -> Error {
    Error::Load(format!("{what}: {error}"))
}

impl KernelProbes {
    /// Loads the programs into the kernel; nothing is attached yet.
    pub fn load(options: &KernelOptions) -> Result<Self> {
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
            .load(OBJECT)
            .map_err(|e| load_error("eBPF object", e))?;
        let mut table: Array<_, u64> = Array::try_from(
            ebpf.map_mut(maps::EXP_QUANTILES)
                .ok_or_else(|| load_error(maps::EXP_QUANTILES, "missing"))?,
        )
        .map_err(|e| load_error(maps::EXP_QUANTILES, e))?;
        for (index, value) in sampling::quantile_table(options.sample_interval)
            .into_iter()
            .enumerate()
        {
            table
                .set(index as u32, value, 0)
                .map_err(|e| load_error(maps::EXP_QUANTILES, e))?;
        }
        for name in ALL_PROGRAMS {
            let program: &mut UProbe = ebpf
                .program_mut(name)
                .ok_or_else(|| load_error(name, "missing"))?
                .try_into()
                .map_err(|e| load_error(name, e))?;
            program.load().map_err(|e| load_error(name, e))?;
        }
        let (sessions, sessions_unavailable) = match options.return_probes {
            ReturnProbes::Uretprobes => (None, None),
            wanted => match SessionPrograms::load(&ebpf, OBJECT, &programs::session::ALL) {
                Ok(sessions) => (Some(sessions), None),
                Err(e) if wanted == ReturnProbes::Sessions => {
                    return Err(Error::Load(format!(
                        "{}: {e}; use --return-probes uretprobes",
                        KernelFeature::UprobeSessions
                    )));
                }
                Err(e) => (None, Some(e.to_string())),
            },
        };
        Ok(Self {
            ebpf,
            attached: Vec::new(),
            placement,
            return_probes: options.return_probes,
            sessions,
            sessions_unavailable,
            session_links: Vec::new(),
            sessions_linked: false,
            frame_pointer_fast_path: options.copy_stack && options.frame_pointer_fast_path,
        })
    }

    /// Attaches to every entry point of one jemalloc copy. `path` is how
    /// the file is named in messages, `open_path` where the kernel finds it.
    /// Returns how many entry points were attached. On failure the probes
    /// of this copy attached so far are detached again: nothing is left
    /// half-probed.
    pub fn attach(
        &mut self,
        scope: Scope,
        path: &str,
        open_path: &Path,
        allocator: &Allocator,
        instance: u16,
    ) -> Result<usize> {
        let target = Target::new(scope, path, open_path)?;
        let mut made = Vec::new();
        let attached_before = self.attached.len();
        let session_links_before = self.session_links.len();
        for entry in &allocator.entry_points {
            if let Err(error) = self.attach_entry(&target, entry, instance, &mut made) {
                for (program, link) in made {
                    if let Some(Ok(program)) =
                        self.ebpf.program_mut(program).map(<&mut UProbe>::try_from)
                    {
                        let _ = program.detach(link);
                    }
                }
                self.session_links.truncate(session_links_before);
                let detached = self.attached.len() - attached_before;
                self.attached.truncate(attached_before);
                return Err(Error::AttachUndone {
                    cause: Box::new(error),
                    detached,
                });
            }
        }
        Ok(allocator.entry_points.len())
    }

    /// Attaches one entry point: its entry program, and its return half as
    /// a session or a uretprobe. Plain uprobe links go into `made`.
    fn attach_entry(
        &mut self,
        target: &Target,
        entry: &EntryPoint,
        instance: u16,
        made: &mut Vec<(&'static str, UProbeLinkId)>,
    ) -> Result<()> {
        let probe_index = self.attached.len() as u32;
        let placement = match self.placement {
            PlacementMode::Emulated => entry.placement.clone(),
            PlacementMode::Entry => Placement::entry("--placement entry"),
        };
        // After `pushes` pushes the return address is at [rsp + 8 * pushes].
        let cookie = cookie::encode(probe_index, placement.pushes * 8, instance);
        let offset = entry.file_offset + placement.offset;
        let error = |message: String| target.error(&entry.symbol, message);
        let mut return_half = ReturnHalf::None;
        if let Some(program) = entry.shape.session_program() {
            return_half = match self.link_session(program, target, offset, cookie) {
                Ok(()) => ReturnHalf::Session,
                Err(SessionLink::Unavailable) => ReturnHalf::Uretprobe,
                Err(SessionLink::Failed(message)) => return Err(error(message)),
            };
        }
        if return_half != ReturnHalf::Session {
            let mut programs = vec![entry.shape.program()];
            if return_half == ReturnHalf::Uretprobe {
                programs.push(programs::CALL_RETURN);
            }
            for program in programs {
                let link = self
                    .attach_uprobe(program, target, offset, cookie)
                    .map_err(error)?;
                made.push((program, link));
            }
        }
        self.attached.push(AttachedProbe {
            scope: target.scope,
            symbol: entry.symbol.clone(),
            path: target.path.to_owned(),
            file_offset: entry.file_offset,
            placement,
            return_half,
            instance,
        });
        Ok(())
    }

    fn attach_uprobe(
        &mut self,
        program: &str,
        target: &Target,
        offset: u64,
        cookie: u64,
    ) -> std::result::Result<UProbeLinkId, String> {
        let program: &mut UProbe = self
            .ebpf
            .program_mut(program)
            .ok_or_else(|| format!("program {program} missing"))?
            .try_into()
            .map_err(|e| format!("{e}"))?;
        let point = UProbeAttachPoint {
            location: UProbeAttachLocation::AbsoluteOffset(offset),
            cookie: Some(cookie),
        };
        program
            .attach(point, target.open_path, target.uprobe_scope)
            .map_err(|e| format!("{e}"))
    }

    /// Links `program` as a uprobe session. The kernel says whether it has
    /// sessions only here, at link time (6.1 loads the program but refuses
    /// the link): in `auto` mode the first refusal switches this run to
    /// uretprobes, before any session link exists.
    fn link_session(
        &mut self,
        program: &str,
        target: &Target,
        offset: u64,
        cookie: u64,
    ) -> std::result::Result<(), SessionLink> {
        let Some(sessions) = &self.sessions else {
            return Err(SessionLink::Unavailable);
        };
        match sessions.attach(program, target.open_path, offset, cookie, target.pid) {
            Ok(link) => {
                self.session_links.push(link);
                self.sessions_linked = true;
                Ok(())
            }
            Err(e) if uprobe_session::kernel_lacks_sessions(&e) && !self.sessions_linked => {
                if self.return_probes == ReturnProbes::Sessions {
                    return Err(SessionLink::Failed(format!(
                        "{}: the kernel refused the link ({e}); use --return-probes uretprobes",
                        KernelFeature::UprobeSessions
                    )));
                }
                self.sessions = None;
                self.sessions_unavailable = Some(NO_SESSIONS.into());
                Err(SessionLink::Unavailable)
            }
            Err(e) => Err(SessionLink::Failed(format!("uprobe session: {e}"))),
        }
    }

    /// How calls get their return half in this run, and why: for the
    /// summary's cost line.
    pub fn return_probes_used(&self) -> String {
        match (&self.sessions, &self.sessions_unavailable) {
            (Some(_), _) => "uprobe sessions".into(),
            (None, Some(_)) => format!("uretprobes ({NO_SESSIONS})"),
            (None, None) => "uretprobes (--return-probes uretprobes)".into(),
        }
    }

    /// Whether processes may be trusted with frame pointers (`--unwind auto`).
    pub fn frame_pointer_fast_path(&self) -> bool {
        self.frame_pointer_fast_path
    }

    /// Lets `pid`'s samples go without a stack copy (but one in
    /// [`FP_CHECK_ONE_IN`](profiler_common::FP_CHECK_ONE_IN)), or not. A
    /// full table only means more copies.
    pub fn trust_frame_pointers(&mut self, pid: u32, trusted: bool) {
        let Some(map) = self.ebpf.map_mut(maps::FP_TRUSTED) else {
            return;
        };
        let Ok(mut table) = HashMap::<_, u32, u8>::try_from(map) else {
            return;
        };
        let _ = if trusted {
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
            .ok_or_else(|| Error::Events("ring buffer already taken".into()))?;
        RingBuf::try_from(map).map_err(|e| Error::Events(e.to_string()))
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

    /// Kernel counters summed over CPUs, indexed by [`Counter`].
    pub fn counters(&self) -> [u64; Counter::COUNT as usize] {
        let mut totals = [0; Counter::COUNT as usize];
        let Some(map) = self.ebpf.map(maps::COUNTERS) else {
            return totals;
        };
        let Ok(counters) = PerCpuArray::<_, u64>::try_from(map) else {
            return totals;
        };
        for counter in Counter::ALL {
            if let Ok(values) = counters.get(&(counter as u32), 0) {
                totals[counter as usize] = values.iter().sum();
            }
        }
        totals
    }
}

impl CallShape {
    /// The uprobe-session program of shapes that need their call's result.
    pub fn session_program(self) -> Option<&'static str> {
        use programs::session;
        Some(match self {
            CallShape::SizeArg0 => session::SIZE_ARG0,
            CallShape::SizeArg1 => session::SIZE_ARG1,
            CallShape::Calloc => session::CALLOC,
            CallShape::Realloc => session::REALLOC,
            CallShape::PosixMemalign => session::POSIX_MEMALIGN,
            CallShape::Mallocx => session::MALLOCX,
            CallShape::Rallocx => session::RALLOCX,
            CallShape::Xallocx => session::XALLOCX,
            CallShape::Free => return None,
        })
    }

    /// Shapes whose entry point allocates (for reports).
    pub fn allocates(self) -> bool {
        !matches!(self, CallShape::Free | CallShape::Xallocx)
    }
}
