//! Helpers for the integration tests: build fixtures, run them and the real
//! `memprobe` binary, read the results with the real `jeprof`.
use std::{
    collections::HashMap,
    io::{BufRead, BufReader, Write},
    path::{Path, PathBuf},
    process::{Child, ChildStdin, ChildStdout, Command, ExitStatus, Stdio},
    sync::{Arc, Mutex, mpsc},
    time::Duration,
};

pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_owned()
}

/// The binary under test: `MEMPROBE_BIN` (set by `cargo xtask test`), else
/// the release build.
pub fn memprobe_bin() -> PathBuf {
    let path = std::env::var_os("MEMPROBE_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join("target/release/memprobe"));
    assert!(
        path.exists(),
        "{} missing: run `cargo xtask test` (or `cargo build --release`)",
        path.display()
    );
    path
}

static BUILT: Mutex<Vec<(String, PathBuf)>> = Mutex::new(Vec::new());

/// Compiles `tests/fixtures/<source>` into `target/fixtures/<name>`, once per
/// test run: rebuilding a binary that another test is running would leave
/// that process mapping a deleted file, which jeprof cannot symbolize.
pub fn build_c(source: &str, name: &str, flags: &[&str]) -> PathBuf {
    let mut built = BUILT.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, path)) = built.iter().find(|(n, _)| n == name) {
        return path.clone();
    }
    let root = workspace_root();
    let out_dir = root.join("target/fixtures");
    std::fs::create_dir_all(&out_dir).unwrap();
    let output = out_dir.join(name);
    let status = Command::new("cc")
        .args(flags)
        .arg("-o")
        .arg(&output)
        .arg(root.join("tests/fixtures").join(source))
        .arg("-ljemalloc")
        .status()
        .expect("running cc");
    assert!(status.success(), "building {source} failed");
    built.push((name.to_owned(), output.clone()));
    output
}

/// The C fixture with known sites, built with frame pointers.
pub fn sites_fixture() -> PathBuf {
    build_c(
        "sites.c",
        "sites",
        &[
            "-O1",
            "-g",
            "-fno-omit-frame-pointer",
            "-fno-optimize-sibling-calls",
        ],
    )
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
        let mut child = Command::new(binary)
            .envs(env.iter().copied())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("starting {}: {e}", binary.display()));
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
        writeln!(self.stdin.as_mut().unwrap(), "go").unwrap();
        let mut line = String::new();
        self.stdout.read_line(&mut line).unwrap();
        assert_eq!(line.trim(), "done", "fixture did not finish its workload");
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

impl Memprobe {
    pub fn start(args: &[&str]) -> Self {
        let mut child = Command::new(memprobe_bin())
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
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

    pub fn signal(&self, signal: i32) {
        // SAFETY: sending a signal to our own child.
        unsafe { libc::kill(self.child.id() as i32, signal) };
    }

    pub fn stderr_text(&self) -> String {
        self.stderr.lock().unwrap().join("\n")
    }

    /// Waits for memprobe to exit (at most 60 s); its status and stderr.
    pub fn wait(mut self) -> (ExitStatus, String) {
        for _ in 0..600 {
            if let Some(status) = self.child.try_wait().unwrap() {
                // Let the reader thread take the last lines.
                std::thread::sleep(Duration::from_millis(200));
                return (status, self.stderr_text());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = self.child.kill();
        panic!("memprobe did not exit within 60 s:\n{}", self.stderr_text());
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

/// `jeprof --text <flag>`: flat megabytes per function.
pub fn jeprof_text(binary: &Path, heap: &Path, flag: &str) -> HashMap<String, f64> {
    let out = Command::new("jeprof")
        .args(["--text", flag])
        .arg(binary)
        .arg(heap)
        .output()
        .expect("running jeprof");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "jeprof failed: {}\n{text}",
        String::from_utf8_lossy(&out.stderr)
    );
    parse_jeprof_text(&text)
}

/// Rows like `   16.0  67.1%  67.1%     16.0  67.1% keep_1m`.
pub fn parse_jeprof_text(text: &str) -> HashMap<String, f64> {
    text.lines()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            if fields.len() < 6 || !fields[1].ends_with('%') {
                return None;
            }
            let flat: f64 = fields[0].parse().ok()?;
            Some((fields[5..].join(" "), flat))
        })
        .collect()
}

/// The `.heap` files in `dir`, sorted.
pub fn heap_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "heap"))
        .collect();
    files.sort();
    files
}

pub const MIB: f64 = 1024.0 * 1024.0;

/// Asserts `actual` is within `fraction` of `expected`.
pub fn assert_within(what: &str, actual: f64, expected: f64, fraction: f64) {
    let error = (actual - expected).abs() / expected;
    assert!(
        error <= fraction,
        "{what}: {actual:.3} vs expected {expected:.3} ({:.1}% off, bound {:.0}%)",
        error * 100.0,
        fraction * 100.0
    );
}
