//! Loading the eBPF object: the kernel's tables sized, the countdown table
//! filled, nothing attached yet: the allocators' programs are loaded as
//! their first link needs them.
use std::sync::Arc;

use aya::{Ebpf, EbpfLoader, maps::Array};
use profiler_common::{globals, maps, programs};

use crate::{
    kernel::error::{KernelError, Result},
    kernel::{
        KernelProbes, OBJECT, PlacementMode, ReturnProbes, btf, countdowns, foreign,
        linkable::LinkableCode,
        thread_bases,
        uprobe_multi::{LinkError, LinkKind, MultiPrograms},
    },
};

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

/// Where `struct task_struct` keeps what the programs read, from the
/// kernel's BTF; 0s when unknown (then nothing is sampled on jemalloc's
/// slow path).
fn task_offsets() -> btf::TaskOffsets {
    std::fs::read("/sys/kernel/btf/vmlinux")
        .ok()
        .and_then(|btf| btf::task_offsets(&btf))
        .unwrap_or_default()
}

fn load_error(
    what: &str,
    cause: impl Into<Box<dyn std::error::Error + Send + Sync>>,
) -> KernelError {
    KernelError::Load {
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
    for (index, value) in countdowns::quantile_table(sample_interval)
        .into_iter()
        .enumerate()
    {
        table
            .set(index as u32, value, 0)
            .map_err(|e| load_error(maps::EXP_QUANTILES, e))?;
    }
    Ok(())
}

/// Every program that may be linked by hand (see `linkable`).
fn linkable_programs() -> Vec<&'static str> {
    (programs::ALL.iter())
        .chain(&programs::session::ALL)
        .chain(&programs::MAPPINGS)
        .copied()
        .collect()
}

/// The uprobe session programs, where the run may use them; else why not
/// (`auto` falls back to uretprobes, `sessions` fails). Whether the kernel
/// has sessions is told at the first link.
fn sessions(
    linkable: &std::result::Result<Arc<LinkableCode>, LinkError>,
    wanted: ReturnProbes,
) -> Result<(Option<MultiPrograms>, Option<String>)> {
    if wanted == ReturnProbes::Uretprobes {
        return Ok((None, None));
    }
    match linkable {
        Ok(code) => Ok((
            Some(MultiPrograms::new(code.clone(), LinkKind::Session)),
            None,
        )),
        Err(e) if wanted == ReturnProbes::Sessions => {
            Err(KernelError::SessionsRefused(e.to_string()))
        }
        Err(e) => Ok((None, Some(e.to_string()))),
    }
}

impl KernelProbes {
    /// Loads the programs into the kernel; nothing is attached yet.
    pub fn load(options: &KernelOptions, sample_interval: u64) -> Result<Self> {
        let placement = options.placement;
        let task = task_offsets();
        let mut ebpf = EbpfLoader::new()
            .map_max_entries(maps::SAMPLED, options.max_sampled_pointers)
            .map_max_entries(maps::EVENTS, options.ring_buffer_bytes)
            .override_global(globals::COPY_STACK, &u8::from(options.copy_stack), true)
            .override_global(
                globals::RING_BUSY_BYTES,
                &(options.ring_buffer_bytes as u64 / 2),
                true,
            )
            .override_global(globals::SAMPLE_INTERVAL, &sample_interval, true)
            .override_global(
                globals::RING_WAKE_BYTES,
                &(options.ring_buffer_bytes as u64 / 8),
                true,
            )
            .override_global(globals::TASK_FSBASE, &task.fsbase, true)
            .override_global(globals::TASK_PID, &task.pid, true)
            .override_global(globals::TASK_TGID, &task.tgid, true)
            .override_global(globals::OWN_TGID, &std::process::id(), true)
            .load(OBJECT)
            .map_err(|e| load_error("eBPF object", e))?;
        set_countdowns(&mut ebpf, sample_interval)?;
        // The allocators' programs load as their first link needs them:
        // each costs the verifier tens of milliseconds, and a run links
        // few of them, in one of their three forms.
        // Without the fs base offset nothing is sampled in windows.
        let threads_unlisted = (task.fsbase != 0)
            .then(|| thread_bases::load(&mut ebpf).err())
            .flatten();
        let linkable = LinkableCode::parse(&ebpf, OBJECT, &linkable_programs()).map(Arc::new);
        let (sessions, sessions_unavailable) = sessions(&linkable, options.return_probes)?;
        Ok(Self {
            entry_links: None,
            linkable: linkable.ok(),
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
            frees_followed: std::collections::HashSet::new(),
            mapped_code_unavailable: None,
            mappings: Default::default(),
            knows_fsbase: task.fsbase != 0,
            threads_unlisted,
            samples: Vec::new(),
        })
    }

    /// Whether the kernel's BTF told where a task's fs base is (what
    /// sampling on jemalloc's slow path reads): read once, at load.
    pub fn knows_fsbase(&self) -> bool {
        self.knows_fsbase
    }
}
