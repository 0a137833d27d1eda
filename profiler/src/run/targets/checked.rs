//! The targets as named on the command line, checked before anything is
//! loaded (a pid that does not exist, a command not found, a process with
//! no allocator fails here, with nothing to undo), then attached to.
use std::{process::ExitStatus, sync::Arc, time::Duration};

use tokio::sync::oneshot;

use crate::{
    discover::{Allocator, AllocatorCache, Found, allocators_in_file},
    error::{Error, Result},
    kernel::Scope,
    proc::{FileId, ProcessError, age, command_name, has_ended, parse_maps, read_maps},
    run::{
        Session, SessionOptions, Targets,
        targets::launch::{self, PredictedFile},
    },
};

/// The targets as checked before anything is loaded.
pub(in crate::run) enum Checked {
    /// Running processes: their maps and the allocator copies found.
    Pids(Vec<(u32, String, Vec<Found>)>),
    All,
    /// The command, and the files it is predicted to map with the
    /// allocator copies each holds.
    Launch(
        Vec<std::ffi::OsString>,
        Vec<(PredictedFile, Vec<Arc<Allocator>>)>,
    ),
}

/// A launched command: its pid and, once it exits, its status.
pub(in crate::run) struct LaunchedCommand {
    pub pid: u32,
    pub exit: Option<oneshot::Receiver<std::io::Result<ExitStatus>>>,
}

/// Every named target is checked before anything is loaded or attached.
pub(in crate::run) fn check_targets(
    options: &SessionOptions,
    cache: &mut AllocatorCache,
) -> Result<Checked> {
    let (debug_dir, wanted) = (options.debug_dir.as_deref(), &options.allocators);
    Ok(match &options.targets {
        Targets::Pids(pids) => {
            let mut initial = Vec::new();
            for &pid in pids.iter() {
                let (maps, found) = find_once_loaded(cache, pid)?;
                initial.push((pid, maps, found));
            }
            Checked::Pids(initial)
        }
        Targets::Launch(command) => {
            let program = command.first().ok_or(Error::NoCommand)?;
            let executable = launch::resolve_program(program)?;
            let mut predicted = Vec::new();
            for file in launch::predict_files(&executable)? {
                let allocators = allocators_in_file(&file.path, debug_dir, wanted)?;
                predicted.push((file, allocators));
            }
            Checked::Launch(command.clone(), predicted)
        }
        Targets::All => Checked::All,
    })
}

/// How long after its start a process may still be inside `execve` or its
/// loader, its files not all mapped (`./server & memprobe --pid $!`): one
/// found without an allocator is looked at again until it is this old.
const LOADING_GRACE: Duration = Duration::from_secs(1);

/// `pid`'s maps and the allocator copies in them, once it has one or is
/// past [`LOADING_GRACE`].
fn find_once_loaded(cache: &mut AllocatorCache, pid: u32) -> Result<(String, Vec<Found>)> {
    let loading = || age(pid).is_some_and(|age| age < LOADING_GRACE);
    loop {
        let maps = match read_maps(pid) {
            Ok(maps) => maps,
            // Inside `execve` the new image has no mappings for a moment:
            // its maps read as empty, as a zombie's do.
            Err(ProcessError::NoSuchProcess(_)) if !has_ended(pid) && loading() => {
                std::thread::sleep(LOOK_AGAIN);
                continue;
            }
            Err(error) => return Err(error.into()),
        };
        match cache.require(pid, &parse_maps(&maps), &command_name(pid)) {
            Ok(found) => return Ok((maps, found)),
            Err(_) if loading() => std::thread::sleep(LOOK_AGAIN),
            Err(error) => return Err(error.into()),
        }
    }
}

/// How long a loading process is left before its maps are read again.
const LOOK_AGAIN: Duration = Duration::from_millis(10);

impl Session<'_> {
    /// Attaches to the checked targets; in launch mode starts the command
    /// once every probe is in place.
    pub(in crate::run) fn attach_targets(
        &mut self,
        checked: Checked,
    ) -> Result<Option<LaunchedCommand>> {
        match checked {
            Checked::Pids(initial) => {
                for (pid, maps, found) in initial {
                    self.track(pid, maps);
                    self.attach_found(pid, found)?;
                }
                Ok(None)
            }
            Checked::All => self.scan_all().map(|()| None),
            Checked::Launch(command, predicted) => {
                let child = launch::spawn_gated(&command)?;
                let pid = child.pid;
                self.track(pid, String::new());
                if let Some(t) = self.tracked.get_mut(&pid) {
                    t.command = launch::command_name(&command[0]);
                }
                for (file, allocators) in &predicted {
                    for allocator in allocators {
                        let path = file.path.to_string_lossy().into_owned();
                        self.attach_file(Scope::Process(pid), &path, &file.path, allocator)?;
                        if let Some(t) = self.tracked.get_mut(&pid) {
                            t.attached_files.insert((file.file, allocator.kind));
                        }
                    }
                }
                let paths: Vec<String> = (predicted.iter())
                    .map(|(file, _)| file.path.to_string_lossy().into_owned())
                    .collect();
                let paths: Vec<&str> = paths.iter().map(String::as_str).collect();
                self.probes.watch_mapping_files(pid, &paths);
                // Only now may the command run: every probe is in place.
                let (pid, exit) = child.release();
                // Its own maps from the start, once its loader mapped its
                // libraries: a command that exits before memprobe's next
                // look still has its frames named.
                let expected: Vec<FileId> = predicted.iter().map(|(f, _)| f.file).collect();
                let maps = launch::maps_once_loaded(pid, &expected);
                if let Some(t) = self.tracked.get_mut(&pid) {
                    t.set_maps(maps);
                }
                Ok(Some(LaunchedCommand {
                    pid,
                    exit: Some(exit),
                }))
            }
        }
    }
}
