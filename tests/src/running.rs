//! Running fixtures and memprobe: processes, their lifetimes, and the
//! locks that keep system-wide tests apart.
use std::{
    io::{BufRead, BufReader, Write},
    path::{Path, PathBuf},
    process::{Child, ChildStdin, ChildStdout, Command, ExitStatus, Stdio},
    sync::{Arc, Mutex, mpsc},
    time::Duration,
};

use crate::*;

/// Peak resident memory in KiB of a command run to completion, and its
/// output.
pub fn run_measuring_memory(command: &mut Command) -> (ExitStatus, String, u64) {
    let child = command
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("starting a command");
    let pid = child.id() as i32;
    let output = std::thread::spawn(move || {
        use std::io::Read;
        let mut child = child;
        let mut text = String::new();
        let _ = child.stdout.take().unwrap().read_to_string(&mut text);
        let mut errors = String::new();
        let _ = child.stderr.take().unwrap().read_to_string(&mut errors);
        text + &errors
    })
    .join()
    .unwrap();
    let mut status = 0;
    // SAFETY: zeroed rusage is valid; wait4 on our own child.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    let waited = unsafe { libc::wait4(pid, &mut status, 0, &mut usage) };
    assert_eq!(waited, pid);
    (
        std::os::unix::process::ExitStatusExt::from_raw(status),
        output,
        usage.ru_maxrss as u64,
    )
}

/// Peak resident memory of a live process, in KiB.
pub fn peak_rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap()
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        .unwrap()
}

static SYSTEM: std::sync::RwLock<()> = std::sync::RwLock::new(());

/// Held by ordinary tests: they may run side by side.
pub fn shared() -> std::sync::RwLockReadGuard<'static, ()> {
    SYSTEM.read().unwrap_or_else(|e| e.into_inner())
}

/// Held by tests that probe system-wide or time things: they run alone.
pub fn exclusive() -> std::sync::RwLockWriteGuard<'static, ()> {
    SYSTEM.write().unwrap_or_else(|e| e.into_inner())
}

/// A folder for one test's outputs, emptied first.
pub fn output_dir(test: &str) -> PathBuf {
    let dir = workspace_root().join("target/test-output").join(test);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A running fixture that says "ready <pid>", then waits for a line on stdin.
pub struct Fixture {
    child: Child,
    stdin: Option<ChildStdin>,
    stdout: BufReader<ChildStdout>,
    pub pid: u32,
}

impl Fixture {
    pub fn start(binary: &Path, env: &[(&str, &str)]) -> Self {
        let mut command = Command::new(binary);
        command.envs(env.iter().copied());
        Self::start_command(command)
    }

    /// Starts `command`, which must print "ready <pid>" first.
    pub fn start_command(command: Command) -> Self {
        Self::start_command_with(command, |_| ())
    }

    /// As [`Self::start_command`], calling `at_spawn` with the pid of the
    /// process spawned before it says it is ready.
    pub fn start_command_with(mut command: Command, at_spawn: impl FnOnce(u32)) -> Self {
        let mut child = command
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("starting {command:?}: {e}"));
        at_spawn(child.id());
        let stdin = child.stdin.take();
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        stdout.read_line(&mut line).unwrap();
        let pid = line
            .trim()
            .strip_prefix("ready ")
            .unwrap_or_else(|| panic!("fixture said {line:?}"))
            .parse()
            .unwrap();
        Self {
            child,
            stdin,
            stdout,
            pid,
        }
    }

    /// Tells the fixture to do its allocations and waits until it has.
    pub fn run_workload(&mut self) {
        self.send_and_expect("go", "done");
    }

    /// As [`Self::run_workload`]; the lines the fixture printed before "done".
    pub fn run_workload_reporting(&mut self) -> Vec<String> {
        self.start_workload();
        self.finish_workload()
    }

    /// Tells the fixture to do its allocations, without waiting.
    pub fn start_workload(&mut self) {
        writeln!(self.stdin.as_mut().unwrap(), "go").unwrap();
    }

    /// Waits for a started workload; the lines printed before "done".
    pub fn finish_workload(&mut self) -> Vec<String> {
        let mut lines = Vec::new();
        loop {
            let mut line = String::new();
            assert!(
                self.stdout.read_line(&mut line).unwrap() > 0,
                "no done: {lines:?}"
            );
            if line.trim() == "done" {
                return lines;
            }
            lines.push(line.trim().to_owned());
        }
    }

    /// Sends a line and waits for the fixture's answer.
    pub fn send_and_expect(&mut self, line: &str, answer: &str) {
        writeln!(self.stdin.as_mut().unwrap(), "{line}").unwrap();
        let mut got = String::new();
        self.stdout.read_line(&mut got).unwrap();
        assert_eq!(got.trim(), answer, "fixture answered {got:?} to {line:?}");
    }

    /// Lets the fixture exit and waits for it.
    pub fn finish(mut self) -> ExitStatus {
        drop(self.stdin.take());
        self.child.wait().unwrap()
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The real memprobe binary, running.
pub struct Memprobe {
    child: Child,
    stderr: Arc<Mutex<Vec<String>>>,
    attached: mpsc::Receiver<()>,
}

/// A fixture launched by memprobe, spoken to through memprobe's stdin and
/// stdout.
pub struct Launched {
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl Launched {
    /// The next line the fixture prints, trimmed.
    pub fn read_line(&mut self) -> String {
        let mut line = String::new();
        self.stdout.read_line(&mut line).unwrap();
        line.trim().to_owned()
    }

    /// Sends `line` and returns the fixture's answer.
    pub fn send(&mut self, line: &str) -> String {
        writeln!(self.stdin, "{line}").unwrap();
        self.read_line()
    }

    /// Closes the fixture's input: it exits.
    pub fn close(self) {}
}

impl Memprobe {
    pub fn start(args: &[&str]) -> Self {
        let mut command = Command::new(memprobe_bin());
        command
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped());
        Self::start_command(command)
    }

    /// Starts memprobe on `program` (launch mode) with `args`, both with
    /// `env`; the program's stdin and stdout, which are memprobe's.
    pub fn launch(args: &[&str], program: &Path, env: &[(&str, &str)]) -> (Self, Launched) {
        let mut command = Command::new(program);
        command.envs(env.iter().copied());
        Self::launch_command(args, &command)
    }

    /// Starts memprobe on `program` (launch mode) as `program` says: its
    /// arguments and environment.
    pub fn launch_command(args: &[&str], program: &Command) -> (Self, Launched) {
        let mut command = Command::new(memprobe_bin());
        command
            .args(args)
            .arg("--")
            .arg(program.get_program())
            .args(program.get_args())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped());
        for (key, value) in program.get_envs() {
            match value {
                Some(value) => command.env(key, value),
                None => command.env_remove(key),
            };
        }
        let mut memprobe = Self::start_command(command);
        let stdin = memprobe.child.stdin.take().unwrap();
        let stdout = BufReader::new(memprobe.child.stdout.take().unwrap());
        (memprobe, Launched { stdin, stdout })
    }

    /// Starts memprobe as `command` says (stderr is always captured).
    pub fn start_command(mut command: Command) -> Self {
        let mut child = command
            .stderr(Stdio::piped())
            .spawn()
            .expect("starting memprobe");
        let stderr = Arc::new(Mutex::new(Vec::new()));
        let (tx, attached) = mpsc::channel();
        let lines = BufReader::new(child.stderr.take().unwrap());
        let sink = stderr.clone();
        std::thread::spawn(move || {
            for line in lines.lines().map_while(Result::ok) {
                if line.contains("memprobe: attached") {
                    let _ = tx.send(());
                }
                sink.lock().unwrap().push(line);
            }
        });
        Self {
            child,
            stderr,
            attached,
        }
    }

    /// Waits for the "attached" line; panics with memprobe's stderr if it
    /// exits first.
    pub fn wait_attached(&mut self) {
        for _ in 0..600 {
            if self
                .attached
                .recv_timeout(Duration::from_millis(100))
                .is_ok()
            {
                return;
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                std::thread::sleep(Duration::from_millis(100));
                panic!(
                    "memprobe exited ({status}) before attaching:\n{}",
                    self.stderr_text()
                );
            }
        }
        panic!(
            "memprobe did not attach within 60 s:\n{}",
            self.stderr_text()
        );
    }

    /// memprobe on `fixture`'s pid writing to `out`, with more `args`;
    /// returns once the probes are attached.
    pub fn attach(fixture: &Fixture, out: &Path, args: &[&str]) -> Self {
        let pid = fixture.pid.to_string();
        let mut all = vec!["--pid", pid.as_str(), "--output", out.to_str().unwrap()];
        all.extend_from_slice(args);
        let mut memprobe = Self::start(&all);
        memprobe.wait_attached();
        memprobe
    }

    /// Stops memprobe with SIGINT, asserts it exited 0; its stderr.
    pub fn stop(self) -> String {
        self.signal(libc::SIGINT);
        let (status, stderr) = self.wait();
        assert!(status.success(), "memprobe failed: {stderr}");
        stderr
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn child(&mut self) -> &mut Child {
        &mut self.child
    }

    pub fn signal(&self, signal: i32) {
        // SAFETY: sending a signal to our own child.
        unsafe { libc::kill(self.child.id() as i32, signal) };
    }

    pub fn stderr_text(&self) -> String {
        self.stderr.lock().unwrap().join("\n")
    }

    /// Waits until memprobe's stderr contains `needle`, failing with
    /// `what` and the stderr if it does not within `within`.
    pub fn wait_for_stderr(&self, needle: &str, within: Duration, what: &str) {
        let started = std::time::Instant::now();
        while !self.stderr_text().contains(needle) {
            assert!(
                started.elapsed() < within,
                "{what}:\n{}",
                self.stderr_text()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Waits for memprobe to exit (at most 60 s); its status and stderr.
    pub fn wait(self) -> (ExitStatus, String) {
        let mut this = self;
        for _ in 0..600 {
            if let Some(status) = this.child.try_wait().unwrap() {
                // Let the reader thread take the last lines.
                std::thread::sleep(Duration::from_millis(200));
                return (status, this.stderr_text());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        panic!("memprobe did not exit within 60 s:\n{}", this.stderr_text());
    }
}

/// A test that fails must not leave memprobe, and its probes, running into
/// the next tests.
impl Drop for Memprobe {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Runs memprobe to completion; its status and stderr.
pub fn run_memprobe(args: &[&str], env: &[(&str, &str)]) -> (ExitStatus, String) {
    let out = Command::new(memprobe_bin())
        .args(args)
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .output()
        .expect("running memprobe");
    (
        out.status,
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Profiles `pid` for one second into `out` with `extra` options; memprobe
/// must succeed. Its stderr.
pub fn profile_for_a_second(pid: u32, out: &Path, extra: &[&str]) -> String {
    let pid = pid.to_string();
    let mut args = vec![
        "--pid",
        &pid,
        "--duration",
        "1s",
        "-o",
        out.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    let (status, stderr) = run_memprobe(&args, &[]);
    assert!(status.success(), "{stderr}");
    stderr
}

/// Runs memprobe; its status and stdout (offline commands).
pub fn memprobe_stdout(args: &[&str]) -> (ExitStatus, String) {
    let out = Command::new(memprobe_bin())
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("running memprobe");
    let mut text = String::from_utf8_lossy(&out.stdout).into_owned();
    text.push_str(&String::from_utf8_lossy(&out.stderr));
    (out.status, text)
}

/// Profiles a running fixture at a 4 KiB interval from attach until its
/// workload is done, stops memprobe with SIGINT; the profile and stderr.
pub fn profile_workload(fixture: &mut Fixture, out: &Path, extra: &[&str]) -> (PathBuf, String) {
    let mut args = vec!["--sample-interval", "4096"];
    args.extend_from_slice(extra);
    let memprobe = Memprobe::attach(fixture, out, &args);
    fixture.run_workload();
    let stderr = memprobe.stop();
    let heaps = heap_files(out);
    assert_eq!(heaps.len(), 1, "{heaps:?}\n{stderr}");
    (heaps[0].clone(), stderr)
}

/// Starts the dlopen host (with `env`), attaches memprobe at a 4 KiB
/// interval, has the host load `library` (jemalloc inside) and waits until
/// memprobe says it probed it, within `within`; runs the library's
/// workload. The profile and memprobe's stderr.
pub fn profile_library_loaded_after_attach(
    library: &Path,
    out: &Path,
    within: Duration,
    env: &[(&str, &str)],
) -> (PathBuf, String) {
    let mut command = Command::new(dlopen_host_fixture());
    command
        .arg(library)
        .env(STATIC_TLS_TUNABLE.0, STATIC_TLS_TUNABLE.1)
        .envs(env.iter().copied());
    let mut fixture = Fixture::start_command(command);
    let pid = fixture.pid.to_string();
    let memprobe = Memprobe::attach(&fixture, out, &["--sample-interval", "4096"]);
    fixture.send_and_expect("load", "loaded");
    let needle = format!("pid {pid} loaded jemalloc in {}", library.display());
    memprobe.wait_for_stderr(&needle, within, "not probed in time");
    fixture.run_workload();
    let stderr = memprobe.stop();
    (heap_files(out).swap_remove(0), stderr)
}

/// The host pid of the process whose executable is `path` (in its own view).
pub fn host_pid_of(path: &std::path::Path) -> u32 {
    for _ in 0..100 {
        for entry in std::fs::read_dir("/proc").unwrap().flatten() {
            let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
                continue;
            };
            let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap_or_default();
            if maps.contains(&path.display().to_string()) {
                return pid;
            }
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    panic!("no process maps {}", path.display());
}

/// Starts `files[0]` in a container of its own (new mount and pid
/// namespaces): the files are copied onto a private tmpfs mounted on `dir`,
/// invisible from the host, and the first one runs from there. Returns the
/// fixture, with its host pid, and the executable's path as it sees it.
pub fn start_in_container(files: &[&Path], dir: &Path) -> (Fixture, PathBuf) {
    let names: Vec<String> = files.iter().map(|f| f.display().to_string()).collect();
    let executable = dir.join(files[0].file_name().unwrap());
    let script = format!(
        "mount -t tmpfs none {dir} && cp {files} {dir}/ && exec {exe}",
        dir = dir.display(),
        files = names.join(" "),
        exe = executable.display()
    );
    let mut command = Command::new("unshare");
    command.args([
        "--mount",
        "--pid",
        "--fork",
        "--mount-proc",
        "sh",
        "-c",
        &script,
    ]);
    let mut fixture = Fixture::start_command(command);
    // The fixture says "ready 1": its pid in its namespace. Find ours.
    assert_eq!(fixture.pid, 1);
    assert!(
        !executable.exists(),
        "the fixture must not be visible from the host"
    );
    fixture.pid = host_pid_of(&executable);
    (fixture, executable)
}

/// `GET path` from `address` over plain HTTP/1.1; the status code and body.
pub fn http_get(address: &str, path: &str) -> (u16, String) {
    use std::io::Read;
    let mut stream = std::net::TcpStream::connect(address).expect("connecting");
    stream
        .set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut response = Vec::new();
    stream.read_to_end(&mut response).unwrap();
    let text = String::from_utf8_lossy(&response).into_owned();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    (status, body)
}

impl Memprobe {
    /// The `ADDR:PORT` memprobe said it serves on (`--listen`).
    pub fn listening_on(&self) -> String {
        for _ in 0..100 {
            if let Some(address) = self.stderr_text().lines().find_map(|l| {
                let rest = l.strip_prefix("memprobe: serving ")?;
                let rest = rest.split_once("://")?.1;
                Some(rest.split('/').next()?.to_owned())
            }) {
                return address;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("memprobe said nowhere it serves:\n{}", self.stderr_text());
    }
}

/// The pids of the processes running `executable`.
pub fn processes_running(executable: &Path) -> Vec<u32> {
    let wanted = std::fs::canonicalize(executable).unwrap_or_else(|_| executable.to_owned());
    all_pids()
        .into_iter()
        .filter(|pid| std::fs::read_link(format!("/proc/{pid}/exe")).is_ok_and(|exe| exe == wanted))
        .collect()
}

/// Every process's pid, as /proc lists them now.
pub fn all_pids() -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|entry| entry.file_name().to_str()?.parse::<u32>().ok())
        .collect()
}

/// The fields of `/proc/PID/stat` after the command's name (which may hold
/// spaces and parentheses): `[0]` is the state, the line's 3rd field, so
/// proc(5)'s field N is at `N - 3`. `None` once the process is gone.
pub fn stat_fields(pid: u32) -> Option<Vec<String>> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (_, fields) = stat.rsplit_once(')')?;
    Some(fields.split_whitespace().map(str::to_owned).collect())
}

/// Waits (up to 5 s) until process `pid` maps a file whose path contains
/// `name`: a process just started has not loaded its libraries yet.
pub fn wait_until_mapped(pid: u32, name: &str) {
    for _ in 0..250 {
        let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap_or_default();
        if maps.contains(name) {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!("process {pid} did not map {name} within 5 s");
}
