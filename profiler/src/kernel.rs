//! The eBPF side as userspace sees it: load the object, size its maps,
//! attach probes, read its counters. Dropping [`KernelProbes`] detaches
//! every probe (the kernel also does so if memprobe dies: links are fds).
use std::{num::NonZeroU32, path::Path};

use aya::{
    Ebpf, EbpfLoader,
    maps::{Array, MapData, PerCpuArray, RingBuf},
    programs::{
        UProbe,
        uprobe::{UProbeAttachLocation, UProbeAttachPoint, UProbeScope},
    },
};
use profiler_common::{Counter, cookie, maps, programs};

use crate::{
    discovery::Allocator,
    entry_points::CallShape,
    error::{Error, Result},
    placement::Placement,
    sampling,
};

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
}

impl Default for KernelOptions {
    fn default() -> Self {
        Self {
            sample_interval: sampling::DEFAULT_SAMPLE_INTERVAL,
            max_sampled_pointers: 262_144,
            ring_buffer_bytes: 8 << 20,
            placement: PlacementMode::Emulated,
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

/// One attached entry point, for `--verbose` and the cost report.
#[derive(Clone, Debug)]
pub struct AttachedProbe {
    pub scope: Scope,
    pub symbol: String,
    pub path: String,
    /// File offset of the function.
    pub file_offset: u64,
    pub placement: Placement,
    pub with_return: bool,
    pub instance: u16,
}

pub struct KernelProbes {
    ebpf: Ebpf,
    pub attached: Vec<AttachedProbe>,
    placement: PlacementMode,
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
            .load(aya::include_bytes_aligned!(concat!(
                env!("OUT_DIR"),
                "/profiler"
            )))
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
        Ok(Self {
            ebpf,
            attached: Vec::new(),
            placement,
        })
    }

    /// Attaches to every entry point of one jemalloc copy. `path` is how
    /// the file is named in messages, `open_path` where the kernel finds it.
    /// Returns how many entry points were attached.
    pub fn attach(
        &mut self,
        scope: Scope,
        path: &str,
        open_path: &Path,
        allocator: &Allocator,
        instance: u16,
    ) -> Result<usize> {
        let (pid, uprobe_scope) = match scope {
            Scope::Process(pid) => (
                pid,
                UProbeScope::OneProcess(NonZeroU32::new(pid).ok_or(Error::NoSuchProcess(0))?),
            ),
            Scope::AllProcesses => (0, UProbeScope::AllProcesses),
        };
        for entry in &allocator.entry_points {
            let probe_index = self.attached.len() as u32;
            let placement = match self.placement {
                PlacementMode::Emulated => entry.placement.clone(),
                PlacementMode::Entry => Placement::entry("--placement entry"),
            };
            // After `pushes` pushes the return address is at [rsp + 8 * pushes].
            let return_address_offset = placement.pushes * 8;
            let point = || UProbeAttachPoint {
                location: UProbeAttachLocation::AbsoluteOffset(
                    entry.file_offset + placement.offset,
                ),
                cookie: Some(cookie::encode(probe_index, return_address_offset, instance)),
            };
            let attach_error = |message: String| Error::Attach {
                pid,
                entry_point: entry.symbol.clone(),
                path: path.into(),
                message,
            };
            let mut attach_one = |program: &str| -> Result<()> {
                let program: &mut UProbe = self
                    .ebpf
                    .program_mut(program)
                    .ok_or_else(|| attach_error(format!("program {program} missing")))?
                    .try_into()
                    .map_err(|e| attach_error(format!("{e}")))?;
                program
                    .attach(point(), open_path, uprobe_scope)
                    .map_err(|e| attach_error(format!("{e}")))?;
                Ok(())
            };
            attach_one(entry.shape.program())?;
            let with_return = entry.shape.needs_return();
            if with_return {
                attach_one(programs::CALL_RETURN)?;
            }
            self.attached.push(AttachedProbe {
                scope,
                symbol: entry.symbol.clone(),
                path: path.to_owned(),
                file_offset: entry.file_offset,
                placement,
                with_return,
                instance,
            });
        }
        Ok(allocator.entry_points.len())
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
    /// Shapes whose entry point allocates (for reports).
    pub fn allocates(self) -> bool {
        !matches!(self, CallShape::Free | CallShape::Xallocx)
    }
}
