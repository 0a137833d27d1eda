//! What profiled processes map, told by uprobes in each of them alone:
//! libc's `mmap`, `munmap` and `mremap` (anonymous memory with the stack
//! that mapped it, and the ranges given back or moved, for the memory
//! account), and the dynamic loader's `_dl_debug_state`, which it calls as
//! it maps a library, so that an allocator in a `dlopen`ed library is
//! probed within milliseconds instead of at the next rescan. Not syscall
//! tracepoints: enabling one sends every system call of every process on
//! the host through the kernel's slow path (some 80 ns each, measured
//! here); these trap only in the processes profiled, and only at these
//! calls.
use std::{collections::HashMap, num::NonZeroU32, path::Path};

use aya::{
    Ebpf,
    programs::{
        UProbe,
        uprobe::{UProbeAttachLocation, UProbeAttachPoint, UProbeLinkId, UProbeScope},
    },
};
use profiler_common::programs;

use crate::{
    kernel::{KernelProbes, LinkFailure},
    proc::Mapping,
};

/// The probes in libc: program, function.
const IN_LIBC: [(&str, &str); 5] = [
    (programs::MMAP_CALL, "mmap"),
    (programs::MMAP_RETURN, "mmap"),
    (programs::MUNMAP_CALL, "munmap"),
    (programs::MREMAP_CALL, "mremap"),
    (programs::MREMAP_RETURN, "mremap"),
];
/// The probe in the dynamic loader.
const IN_LOADER: (&str, &str) = (programs::LIBRARY_LOADED, "_dl_debug_state");

/// Loads the programs, attached to each process as it is profiled; why
/// not, where the kernel refuses them.
pub(super) fn load(ebpf: &mut Ebpf) -> Result<(), LinkFailure> {
    for name in IN_LIBC
        .map(|(name, _)| name)
        .into_iter()
        .chain([IN_LOADER.0])
    {
        let program: &mut UProbe = ebpf
            .program_mut(name)
            .ok_or_else(|| LinkFailure::MissingProgram(name.into()))?
            .try_into()
            .map_err(LinkFailure::program(name))?;
        program.load().map_err(LinkFailure::program(name))?;
    }
    Ok(())
}

/// One process's mapping probes, by the file they are in.
#[derive(Default)]
pub(super) struct MappingLinks {
    libc: Option<Vec<(&'static str, UProbeLinkId)>>,
    loader: Option<Vec<(&'static str, UProbeLinkId)>>,
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
        if self.mapped_code_unavailable.is_some() {
            return;
        }
        let Some(scope) = NonZeroU32::new(pid).map(UProbeScope::OneProcess) else {
            return;
        };
        let links = self.mapping_links.remove(&pid).unwrap_or_default();
        let libc = links.libc.or_else(|| {
            let path = file_named(paths, "libc.so")?;
            self.attach_all(&IN_LIBC, &in_root(pid, path), scope)
        });
        let loader = links.loader.or_else(|| {
            let path = file_named(paths, "ld-linux")?;
            self.attach_all(&[IN_LOADER], &in_root(pid, path), scope)
        });
        self.mapping_links
            .insert(pid, MappingLinks { libc, loader });
    }

    /// Stops probing what `pid` maps.
    pub fn unwatch_mappings(&mut self, pid: u32) {
        let Some(links) = self.mapping_links.remove(&pid) else {
            return;
        };
        let all = links.libc.into_iter().chain(links.loader).flatten();
        self.detach_mapping_probes(all);
    }

    /// Attaches each of `probes` in `file`, or none.
    fn attach_all(
        &mut self,
        probes: &[(&'static str, &str)],
        file: &Path,
        scope: UProbeScope,
    ) -> Option<Vec<(&'static str, UProbeLinkId)>> {
        let mut links = Vec::new();
        for &(name, function) in probes {
            let program: Option<&mut UProbe> =
                self.ebpf.program_mut(name).and_then(|p| p.try_into().ok());
            let point = UProbeAttachPoint {
                location: UProbeAttachLocation::Symbol(function),
                cookie: None,
            };
            match program.map(|p| p.attach(point, file, scope)) {
                Some(Ok(link)) => links.push((name, link)),
                _ => {
                    self.detach_mapping_probes(links);
                    return None;
                }
            }
        }
        Some(links)
    }

    fn detach_mapping_probes(
        &mut self,
        links: impl IntoIterator<Item = (&'static str, UProbeLinkId)>,
    ) {
        for (name, link) in links {
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

/// What `pid`'s probes are, for [`KernelProbes`]' table.
pub(super) type MappingTable = HashMap<u32, MappingLinks>;
