//! What profiled processes map, told by uprobes in each of them alone:
//! libc's `mmap`, `munmap` and `mremap` (anonymous memory with the stack
//! that mapped it, and the ranges given back or moved, for the memory
//! account), and the dynamic loader's `_dl_debug_state`, which it calls as
//! it maps a library, so that an allocator in a `dlopen`ed library is
//! probed within milliseconds instead of at the next rescan; and libc's
//! `_exit` and `__call_tls_dtors` (which an ending thread calls), where a
//! process sampled in windows has its threads' counters read a last time
//! (`windows`). Not syscall
//! tracepoints: enabling one sends every system call of every process on
//! the host through the kernel's slow path (some 80 ns each, measured
//! here); these trap only in the processes profiled, and only at these
//! calls. uprobe_multi links where the kernel's work, as the allocators'
//! probes; aya's perf-event uprobes elsewhere.
use std::{collections::HashMap, num::NonZeroU32, os::fd::OwnedFd, path::Path};

use aya::{
    Ebpf,
    programs::{
        UProbe,
        uprobe::{UProbeAttachLocation, UProbeAttachPoint, UProbeLinkId, UProbeScope},
    },
};
use profiler_common::programs;

use crate::{
    binary::elf::FunctionSymbols,
    kernel::{
        KernelProbes, LinkFailure,
        uprobe_multi::{LinkKind, MultiPrograms},
    },
    proc::{FileId, Mapping},
};

/// A probe: its program, the function it is at, whether at its return.
type Probe = (&'static str, &'static str, bool);

/// The probes in libc.
const IN_LIBC: [Probe; 7] = [
    (programs::MMAP_CALL, "mmap", false),
    (programs::MMAP_RETURN, "mmap", true),
    (programs::MUNMAP_CALL, "munmap", false),
    (programs::MREMAP_CALL, "mremap", false),
    (programs::MREMAP_RETURN, "mremap", true),
    (programs::PROCESS_EXIT, "_exit", false),
    (programs::THREAD_EXIT, "__call_tls_dtors", false),
];
/// The probe in the dynamic loader.
const IN_LOADER: [Probe; 1] = [(programs::LIBRARY_LOADED, "_dl_debug_state", false)];

/// Loads the programs as perf-event uprobes; why not, where the kernel
/// refuses them.
fn load_perf_programs(ebpf: &mut Ebpf) -> Result<(), LinkFailure> {
    for name in programs::MAPPINGS {
        let program: &mut UProbe = ebpf
            .program_mut(name)
            .ok_or_else(|| LinkFailure::MissingProgram(name.into()))?
            .try_into()
            .map_err(LinkFailure::program(name))?;
        program.load().map_err(LinkFailure::program(name))?;
    }
    Ok(())
}

/// One attached mapping probe.
enum MappingLink {
    /// A uprobe_multi link, held: dropping it detaches.
    Multi(#[allow(dead_code)] OwnedFd),
    /// Aya's perf-event uprobe of `program`.
    Perf(&'static str, UProbeLinkId),
}

/// One process's mapping probes, by the file they are in.
#[derive(Default)]
pub(super) struct MappingLinks {
    libc: Option<Vec<MappingLink>>,
    loader: Option<Vec<MappingLink>>,
}

/// What the mapping probes keep across processes.
#[derive(Default)]
pub(super) struct MappingProbes {
    /// Each profiled process's probes.
    links: HashMap<u32, MappingLinks>,
    /// The programs loaded for uprobe_multi links, once the allocators'
    /// probes have them.
    multi: Option<MultiPrograms>,
    /// Whether the programs were loaded as perf-event uprobes, where the
    /// allocators' probes are: at the first process watched.
    perf_loaded: bool,
    /// Where each probed function is in a file, by the file.
    offsets: HashMap<FileId, Option<Vec<u64>>>,
}

impl MappingProbes {
    /// Per process, the perf events its mapping probes put on its main
    /// thread (those not in uprobe_multi links).
    pub(super) fn task_events(&self) -> impl Iterator<Item = (u32, usize)> + '_ {
        self.links.iter().filter_map(|(&pid, links)| {
            let all = links.libc.iter().chain(&links.loader).flatten();
            let perf = all.filter(|l| matches!(l, MappingLink::Perf(..))).count();
            (perf > 0).then_some((pid, perf))
        })
    }

    /// The ids of the programs loaded for links, which are memprobe's own.
    pub fn program_ids(&self) -> Vec<u32> {
        self.multi
            .iter()
            .flat_map(MultiPrograms::program_ids)
            .collect()
    }
}

impl KernelProbes {
    /// Probes what `pid` maps, in the libc and the loader among its
    /// `mappings` not probed yet (a process found running); a file that
    /// cannot be probed is left to the rescans and to the memory account's
    /// unexplained part.
    pub fn watch_mappings(&mut self, pid: u32, mappings: &[Mapping]) {
        let paths: Vec<&str> = mappings.iter().filter_map(|m| m.path.as_deref()).collect();
        self.watch_mapping_files(pid, &paths);
    }

    /// As [`watch_mappings`](Self::watch_mappings), among the files at
    /// `paths` (a launched command's, before it maps them: the kernel
    /// installs the probes as it does).
    pub fn watch_mapping_files(&mut self, pid: u32, paths: &[&str]) {
        if self.mapped_code_unavailable.is_some() || pid == 0 {
            return;
        }
        if let Some(code) = &self.linkable
            && self.entry_links.is_some()
        {
            (self.mappings.multi)
                .get_or_insert_with(|| MultiPrograms::new(code.clone(), LinkKind::Entry));
        } else if !self.mappings.perf_loaded {
            if let Err(cause) = load_perf_programs(&mut self.ebpf) {
                self.mapped_code_unavailable = Some(cause);
                return;
            }
            self.mappings.perf_loaded = true;
        }
        let links = self.mappings.links.remove(&pid).unwrap_or_default();
        let libc = links.libc.or_else(|| {
            let path = file_named(paths, "libc.so")?;
            self.attach_all(&IN_LIBC, &in_root(pid, path), pid)
        });
        let loader = links.loader.or_else(|| {
            let path = file_named(paths, "ld-linux")?;
            self.attach_all(&IN_LOADER, &in_root(pid, path), pid)
        });
        self.mappings
            .links
            .insert(pid, MappingLinks { libc, loader });
    }

    /// Stops probing what `pid` maps.
    pub fn unwatch_mappings(&mut self, pid: u32) {
        let Some(links) = self.mappings.links.remove(&pid) else {
            return;
        };
        let all = links.libc.into_iter().chain(links.loader).flatten();
        self.detach_mapping_probes(all);
    }

    /// Attaches each of `probes` in `file` for `pid`, or none.
    fn attach_all(&mut self, probes: &[Probe], file: &Path, pid: u32) -> Option<Vec<MappingLink>> {
        let offsets = self.function_offsets(file, probes)?;
        let mut links = Vec::new();
        for (&(name, _, returns), offset) in probes.iter().zip(offsets) {
            match self.attach_mapping_probe(name, file, offset, (pid, returns)) {
                Some(link) => links.push(link),
                None => {
                    self.detach_mapping_probes(links);
                    return None;
                }
            }
        }
        Some(links)
    }

    /// Where each of `probes`' functions is in `file` (read once a file).
    fn function_offsets(&mut self, file: &Path, probes: &[Probe]) -> Option<Vec<u64>> {
        let id = FileId::of(&std::fs::metadata(file).ok()?);
        self.mappings
            .offsets
            .entry(id)
            .or_insert_with(|| {
                let data = std::fs::read(file).ok()?;
                let symbols = FunctionSymbols::parse(&data).ok()?;
                probes.iter().map(|(_, f, _)| symbols.offset(f)).collect()
            })
            .clone()
    }

    fn attach_mapping_probe(
        &mut self,
        name: &'static str,
        file: &Path,
        offset: u64,
        (pid, returns): (u32, bool),
    ) -> Option<MappingLink> {
        if let Some(multi) = &mut self.mappings.multi {
            let link = multi.attach(name, (file, offset), 0, pid, returns).ok()?;
            return Some(MappingLink::Multi(link));
        }
        let program: &mut UProbe = self.ebpf.program_mut(name)?.try_into().ok()?;
        let point = UProbeAttachPoint {
            location: UProbeAttachLocation::AbsoluteOffset(offset),
            cookie: None,
        };
        let scope = UProbeScope::OneProcess(NonZeroU32::new(pid)?);
        let link = program.attach(point, file, scope).ok()?;
        Some(MappingLink::Perf(name, link))
    }

    fn detach_mapping_probes(&mut self, links: impl IntoIterator<Item = MappingLink>) {
        for link in links {
            let MappingLink::Perf(name, link) = link else {
                continue;
            };
            if let Some(program) = self.ebpf.program_mut(name)
                && let Ok(program) = <&mut UProbe>::try_from(program)
            {
                let _ = program.detach(link);
            }
        }
    }
}

/// The first of `paths` whose file name starts with `prefix`.
fn file_named<'a>(paths: &[&'a str], prefix: &str) -> Option<&'a str> {
    paths.iter().copied().find(|path| {
        Path::new(path)
            .file_name()
            .is_some_and(|n| n.to_string_lossy().starts_with(prefix))
    })
}

/// `path` as the process sees it, opened through its root (its mount
/// namespace; never a path out of it).
fn in_root(pid: u32, path: &str) -> std::path::PathBuf {
    crate::proc::proc_path(pid, "root").join(path.trim_start_matches('/'))
}
