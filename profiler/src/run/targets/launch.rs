//! Launch mode: start a command with the probes already in place.
//!
//! The child is forked and waits on a pipe before `exec`; memprobe predicts
//! the files it will map (the executable, and what its dynamic loader will
//! load, LD_PRELOAD included, per `ld.so --list`), attaches pid-scoped
//! probes to the jemalloc among them (the kernel installs them when the
//! process maps the file), then lets the child `exec`. The process is never
//! stopped by a signal or a debugger.
use std::{
    ffi::OsString,
    fs::File,
    io::{Read, Write},
    os::{
        fd::{AsRawFd, FromRawFd, OwnedFd},
        unix::{ffi::OsStrExt, fs::MetadataExt, process::CommandExt},
    },
    path::{Path, PathBuf},
    process::{Command, ExitStatus},
};

use object::read::elf::ElfFile64;
use tokio::sync::oneshot;

use crate::{
    error::{Error, Result},
    proc::{FileId, parse_maps, read_maps},
};

/// A forked child waiting to `exec`.
pub struct Launched {
    pub pid: u32,
    /// Writing a byte (or dropping without writing) releases the child.
    gate: File,
    /// The child's exit status, once it has exited and been reaped.
    pub exit: oneshot::Receiver<std::io::Result<ExitStatus>>,
    /// Told once the child has exec'd (dropped unsent if it could not).
    execd: std::sync::mpsc::Receiver<()>,
}

impl Launched {
    /// Lets the child `exec` the command, and returns once it has (or
    /// failed to): until then its maps are memprobe's own, which a read
    /// would keep for a command that exits before its next read (a
    /// profile then named no frame).
    pub fn release(mut self) -> (u32, oneshot::Receiver<std::io::Result<ExitStatus>>) {
        let _ = self.gate.write_all(b"x");
        let _ = self.execd.recv();
        (self.pid, self.exit)
    }
}

/// How long a launched command's loader is given to map the files it was
/// predicted to: a few milliseconds as a rule.
const LOADER_WAIT: std::time::Duration = std::time::Duration::from_millis(200);

/// `pid`'s maps once every file in `expected` is mapped, read every
/// millisecond until then; as they are after [`LOADER_WAIT`] (a predicted
/// file that is not loaded), or the last read if it exits. Right after its
/// `exec` they hold its program and loader alone: a command that exits
/// before memprobe's next look would have its libraries' frames unnamed.
pub fn maps_once_loaded(pid: u32, expected: &[FileId]) -> Option<String> {
    let until = std::time::Instant::now() + LOADER_WAIT;
    let mut last = None;
    while let Ok(maps) = read_maps(pid) {
        let mapped: std::collections::HashSet<FileId> =
            parse_maps(&maps).iter().map(|m| m.file).collect();
        let loaded = expected.iter().all(|f| mapped.contains(f));
        last = Some(maps);
        if loaded || std::time::Instant::now() >= until {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    last
}

/// The command's name as `ps` would show it: its program's file name.
pub fn command_name(program: &OsString) -> String {
    program
        .to_string_lossy()
        .rsplit('/')
        .next()
        .unwrap_or("?")
        .to_owned()
}

fn pipe() -> std::io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0; 2];
    // SAFETY: fds has room for two descriptors.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: pipe2 returned two new descriptors that nobody else owns.
    unsafe { Ok((OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1]))) }
}

/// Forks `command`; the child waits before `exec` until released. If the
/// returned value is dropped unreleased, the child exits without running.
pub fn spawn_gated(command: &[OsString]) -> Result<Launched> {
    let (program, args) = command.split_first().ok_or(Error::NoCommand)?;
    let launch_error = |cause| Error::Launch {
        program: program.into(),
        cause,
    };
    let (pid_read, pid_write) = pipe().map_err(launch_error)?;
    let (gate_read, gate_write) = pipe().map_err(launch_error)?;
    let mut cmd = Command::new(program);
    cmd.args(args);
    let (pid_fd, gate_fd) = (pid_write.as_raw_fd(), gate_read.as_raw_fd());
    // SAFETY: the closure runs in the forked child and only makes
    // async-signal-safe calls (getpid, write, read).
    unsafe {
        cmd.pre_exec(move || {
            let pid = libc::getpid().to_ne_bytes();
            libc::write(pid_fd, pid.as_ptr().cast(), pid.len());
            let mut byte = 0u8;
            if libc::read(gate_fd, (&raw mut byte).cast(), 1) != 1 {
                // memprobe gave up: do not run the command unprofiled.
                return Err(std::io::Error::from_raw_os_error(libc::ECANCELED));
            }
            Ok(())
        });
    }
    let (exit_tx, exit) = oneshot::channel();
    let (execd_tx, execd) = std::sync::mpsc::channel();
    // `spawn` returns only once the child has exec'd, so it runs on a thread
    // of its own while this one attaches; the thread then reaps the child.
    std::thread::spawn(move || {
        let spawned = cmd.spawn();
        drop((pid_write, gate_read));
        if spawned.is_ok() {
            let _ = execd_tx.send(());
        }
        drop(execd_tx);
        let status = spawned.and_then(|mut child| child.wait());
        let _ = exit_tx.send(status);
    });
    let mut pid = [0u8; 4];
    File::from(pid_read)
        .read_exact(&mut pid)
        .map_err(launch_error)?;
    Ok(Launched {
        pid: i32::from_ne_bytes(pid) as u32,
        gate: File::from(gate_write),
        exit,
        execd,
    })
}

/// A file the launched command will map, as the host sees it.
#[derive(Clone, Debug)]
pub struct PredictedFile {
    pub path: PathBuf,
    pub file: FileId,
}

/// The executable `program` names: a path, or a name looked up in PATH.
pub fn resolve_program(program: &OsString) -> Result<PathBuf> {
    let path = Path::new(program);
    if program.as_bytes().contains(&b'/') {
        return Ok(path.to_owned());
    }
    let search = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&search)
        .map(|dir| dir.join(path))
        .find(|candidate| {
            candidate
                .metadata()
                .is_ok_and(|m| m.is_file() && m.mode() & 0o111 != 0)
        })
        .ok_or_else(|| Error::CommandNotFound(path.to_owned()))
}

/// The executable and the libraries its loader will map at start.
pub fn predict_files(executable: &Path) -> Result<Vec<PredictedFile>> {
    let read_error = |cause| Error::Read {
        path: executable.to_owned(),
        cause,
    };
    let file = std::fs::File::open(executable).map_err(read_error)?;
    // SAFETY: a read-only private mapping, of which only the headers are
    // read: the program's file may be hundreds of megabytes.
    let data = unsafe { memmap2::Mmap::map(&file) }.map_err(read_error)?;
    let interpreter = ElfFile64::<object::Endianness>::parse(&*data)
        .ok()
        .and_then(|elf| interpreter_of(&elf));
    let mut paths = vec![executable.to_owned()];
    if let Some(interpreter) = interpreter {
        // Trace mode maps the libraries and prints them; no code of the
        // program or its libraries runs.
        let output = Command::new(&interpreter)
            .arg("--list")
            .arg(executable)
            .output()
            .map_err(|cause| Error::Launch {
                program: interpreter.clone(),
                cause,
            })?;
        paths.extend(parse_loader_list(&String::from_utf8_lossy(&output.stdout)));
    }
    Ok(paths
        .into_iter()
        .filter_map(|path| {
            let meta = std::fs::metadata(&path).ok()?;
            Some(PredictedFile {
                path,
                file: FileId::of(&meta),
            })
        })
        .collect())
}

fn interpreter_of(elf: &ElfFile64<object::Endianness>) -> Option<PathBuf> {
    use object::read::elf::ProgramHeader;
    let endian = elf.endian();
    let data = elf.data();
    elf.elf_program_headers()
        .iter()
        .find(|header| header.p_type(endian) == object::elf::PT_INTERP)
        .and_then(|header| header.data(endian, data).ok())
        .map(|bytes| {
            let bytes = bytes.split(|&b| b == 0).next().unwrap_or_default();
            PathBuf::from(std::ffi::OsStr::from_bytes(bytes))
        })
}

/// Paths in `ld.so --list` output: `name => /path (0x...)` or `/path (0x...)`.
pub fn parse_loader_list(text: &str) -> Vec<PathBuf> {
    text.lines()
        .filter_map(|line| {
            let line = line.trim();
            let target = line.split_once("=>").map_or(line, |(_, t)| t.trim());
            let path = target.rsplit_once(" (").map_or(target, |(p, _)| p).trim();
            path.starts_with('/').then(|| PathBuf::from(path))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_loader_list_output() {
        let text = "\tlinux-vdso.so.1 (0x00007ffd)\n\
                    \t/usr/lib/x86_64-linux-gnu/libjemalloc.so.2 (0x00007f01)\n\
                    \tlibc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x00007f02)\n\
                    \tlibfoo.so => not found\n\
                    \t/lib64/ld-linux-x86-64.so.2 (0x00007f03)\n";
        let paths = parse_loader_list(text);
        assert_eq!(
            paths,
            [
                PathBuf::from("/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"),
                PathBuf::from("/lib/x86_64-linux-gnu/libc.so.6"),
                PathBuf::from("/lib64/ld-linux-x86-64.so.2"),
            ]
        );
    }

    #[test]
    fn predicts_libraries_of_a_dynamic_program() {
        let sh = resolve_program(&OsString::from("sh")).unwrap();
        let files = predict_files(&sh).unwrap();
        assert!(files.len() >= 3, "{files:?}");
        assert!(
            files
                .iter()
                .any(|f| f.path.to_string_lossy().contains("libc.so"))
        );
    }

    /// Its maps are read once its loader has mapped its libraries, not
    /// just after its `exec`, when they hold its program and loader alone.
    #[test]
    fn a_launched_commands_maps_hold_its_libraries() {
        let sleep = resolve_program(&OsString::from("sleep")).unwrap();
        let expected: Vec<FileId> = predict_files(&sleep)
            .unwrap()
            .iter()
            .map(|f| f.file)
            .collect();
        let command = [sleep.clone().into_os_string(), OsString::from("5")];
        for _ in 0..5 {
            let (pid, _) = spawn_gated(&command).unwrap().release();
            let maps = maps_once_loaded(pid, &expected);
            // SAFETY: signalling the child this test started.
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
            let maps = maps.unwrap();
            assert!(maps.contains("libc.so"), "{maps}");
        }
    }

    /// Once released, the child is the command: a look at its maps then
    /// never finds memprobe's own (the kernels suite's launch check once
    /// named no frame: the first tick read the fork's maps, and the
    /// command exited before any later look).
    #[test]
    fn a_released_child_has_execd() {
        let sleep = resolve_program(&OsString::from("sleep")).unwrap();
        let command = [sleep.clone().into_os_string(), OsString::from("5")];
        for _ in 0..5 {
            let child = spawn_gated(&command).unwrap();
            let (pid, _) = child.release();
            let exe = std::fs::read_link(format!("/proc/{pid}/exe"));
            // SAFETY: signalling the child this test started.
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
            assert_eq!(exe.unwrap(), sleep.canonicalize().unwrap());
        }
    }
}
