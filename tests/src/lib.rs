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

/// Builds a fixture once per test run with `build(output path)`: rebuilding
/// a binary that another test is running would leave that process mapping a
/// deleted file, which jeprof cannot symbolize.
pub fn build_once(name: &str, build: impl FnOnce(&Path) -> Command) -> PathBuf {
    let mut built = BUILT.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, path)) = built.iter().find(|(n, _)| n == name) {
        return path.clone();
    }
    let out_dir = workspace_root().join("target/fixtures");
    std::fs::create_dir_all(&out_dir).unwrap();
    let output = out_dir.join(name);
    let mut command = build(&output);
    let status = command.status().expect("running a compiler");
    assert!(status.success(), "building {name} failed: {command:?}");
    built.push((name.to_owned(), output.clone()));
    output
}

pub fn fixture_source(name: &str) -> PathBuf {
    workspace_root().join("tests/fixtures").join(name)
}

/// Debug info and frame pointers, no inlining of the sites into callers.
pub const C_FLAGS: &[&str] = &[
    "-O1",
    "-g",
    "-fno-omit-frame-pointer",
    "-fno-optimize-sibling-calls",
];

pub const JEMALLOC_STATIC: &str = "/usr/lib/x86_64-linux-gnu/libjemalloc_pic.a";
pub const JAVA_HOME: &str = "/usr/lib/jvm/java-17-openjdk-amd64";

fn compile(compiler: &str, output: &Path, source: &str, extra: &[&str]) -> Command {
    let mut command = Command::new(compiler);
    command
        .args(C_FLAGS)
        .arg("-o")
        .arg(output)
        .arg(fixture_source(source))
        .args(extra);
    command
}

/// The C fixture with known sites, linked to libjemalloc.so.2.
pub fn sites_fixture() -> PathBuf {
    build_once("sites", |out| {
        compile("cc", out, "sites.c", &["-ljemalloc"])
    })
}

/// Sites through each entry-point shape (malloc, realloc(NULL), aligned,
/// calloc), built without an allocator: glibc's, or the one LD_PRELOAD puts
/// first.
pub fn allocators_fixture() -> PathBuf {
    build_once("allocators", |out| compile("cc", out, "allocators.c", &[]))
}

/// Two sites in a fixed 64-byte cycle (or irregular sizes), for
/// `--sampling slow-path`'s trial; linked to libjemalloc.so.2.
pub fn aliasing_fixture() -> PathBuf {
    build_once("aliasing", |out| {
        compile("cc", out, "aliasing.c", &["-ljemalloc"])
    })
}

/// A JVM's 64 direct buffers of 1 MiB (the DirectBuffers fixture), in use
/// under Unsafe_AllocateMemory0 -> os::malloc per jeprof, within 10%.
pub fn assert_direct_buffers_in_use(heap: &Path) {
    let java = format!("{JAVA_HOME}/bin/java");
    let inuse = jeprof_rows(Path::new(&java), heap, "--inuse_space");
    assert_within(
        "Unsafe_AllocateMemory0 in use",
        row(&inuse, "Unsafe_AllocateMemory0").cum * MIB,
        64.0 * MIB,
        0.10,
    );
}

/// A shared library with mimalloc linked in (local symbols, as in pyarrow's
/// libarrow), exporting `keep_blocks` for the dlopen host.
pub fn mimalloc_library() -> PathBuf {
    let target_dir = workspace_root().join("target/fixtures/rust-mimalloc");
    build_once("rust-mimalloc-lib", |_| {
        let mut command = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
        command
            .args(["build", "--release", "--quiet", "--manifest-path"])
            .arg(fixture_source("rust-mimalloc-lib/Cargo.toml"))
            .arg("--target-dir")
            .arg(&target_dir)
            .env("RUSTFLAGS", "-C force-frame-pointers=yes");
        command
    });
    target_dir.join("release/librust_mimalloc_lib.so")
}

/// The same sites, with jemalloc linked statically into the executable.
pub fn sites_static_fixture() -> PathBuf {
    build_once("sites_static", |out| {
        compile(
            "cc",
            out,
            "sites.c",
            &[JEMALLOC_STATIC, "-lpthread", "-lm", "-ldl", "-lstdc++"],
        )
    })
}

/// An allocation in an always-inlined function, -O2 with frame pointers.
pub fn inlined_fixture() -> PathBuf {
    build_once("inlined", |out| {
        let mut command = Command::new("cc");
        command
            .args(["-O2", "-g", "-fno-omit-frame-pointer", "-o"])
            .arg(out)
            .arg(fixture_source("inlined.c"))
            .arg("-ljemalloc");
        command
    })
}

/// A known call chain, -O2 without frame pointers (DWARF unwinding).
pub fn unwind_fixture() -> PathBuf {
    build_once("unwind", |out| {
        let mut command = Command::new("cc");
        command
            .args(["-O2", "-g", "-fomit-frame-pointer", "-o"])
            .arg(out)
            .arg(fixture_source("unwind.c"))
            .arg("-ljemalloc");
        command
    })
}

/// Functions in [`big_binary`].
pub const BIG_BINARY_FUNCTIONS: usize = 20_000;

/// A generated binary with many functions and their debug info
/// (`f0`..`f19999`, each with a type of its own), for symbolizing at scale.
pub fn big_binary() -> PathBuf {
    build_once("big", |out| {
        let source = out.with_extension("c");
        let mut text = String::from("#include <stdlib.h>\n#include <string.h>\n");
        for i in 0..BIG_BINARY_FUNCTIONS {
            text.push_str(&format!(
                "struct s{i} {{ int a; long b; char name[{}]; }};\n\
                 void *f{i}(int x) {{ struct s{i} *p = malloc(sizeof(struct s{i}) + x); \
                 if (p) {{ p->a = x; p->b = {i}; memset(p->name, {}, sizeof p->name); }} \
                 return p; }}\n",
                i % 32 + 1,
                i % 256
            ));
        }
        text.push_str("int main(void) { return f0(1) == 0; }\n");
        std::fs::write(&source, text).unwrap();
        let mut command = Command::new("cc");
        command.args(["-O0", "-g", "-o"]).arg(out).arg(source);
        command
    })
}

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

/// Three sites with different trends over 6 seconds.
pub fn trends_fixture() -> PathBuf {
    build_once("trends", |out| {
        compile("cc", out, "trends.c", &["-ljemalloc"])
    })
}

/// The `# key: value` notes of a `.heap` file.
pub fn heap_notes(heap: &Path) -> HashMap<String, String> {
    std::fs::read_to_string(heap)
        .unwrap()
        .lines()
        .take_while(|l| !l.starts_with('@'))
        .filter_map(|l| l.strip_prefix("# ")?.split_once(": "))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
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

/// C++ new/delete sites against libjemalloc.so.2's operators.
pub fn new_delete_fixture() -> PathBuf {
    build_once("new_delete", |out| {
        compile("g++", out, "new_delete.cpp", &["-ljemalloc"])
    })
}

/// A shared library with its own static jemalloc and a JNI entry point.
pub fn static_jemalloc_library() -> PathBuf {
    let include = format!("-I{JAVA_HOME}/include");
    let include_linux = format!("-I{JAVA_HOME}/include/linux");
    build_once("libstaticje.so", |out| {
        compile(
            "cc",
            out,
            "static_je_lib.c",
            &[
                "-shared",
                "-fPIC",
                &include,
                &include_linux,
                JEMALLOC_STATIC,
                "-Wl,-Bsymbolic",
                "-lpthread",
                "-lstdc++",
            ],
        )
    })
}

/// Linked to libjemalloc.so.2 even though the compiler may drop its only
/// malloc call (Debian links --as-needed).
pub fn dlopen_host_fixture() -> PathBuf {
    build_once("dlopen_host", |out| {
        compile(
            "cc",
            out,
            "dlopen_host.c",
            &["-Wl,--no-as-needed", "-ljemalloc", "-ldl"],
        )
    })
}

/// jemalloc linked statically uses initial-exec TLS; a library holding it
/// needs room in glibc's static TLS block when loaded with dlopen, as in
/// production (ClickHouse's libch.so is loaded the same way).
pub const STATIC_TLS_TUNABLE: (&str, &str) =
    ("GLIBC_TUNABLES", "glibc.rtld.optional_static_tls=65536");

pub fn malloc_loop_fixture() -> PathBuf {
    build_once("malloc_loop", |out| {
        let mut command = Command::new("cc");
        command
            .args(["-O2", "-o"])
            .arg(out)
            .arg(fixture_source("malloc_loop.c"))
            .arg("-ljemalloc");
        command
    })
}

/// The Rust fixture on tikv-jemallocator (builds jemalloc from source).
pub fn rust_fixture() -> PathBuf {
    cargo_fixture("rust-jemalloc", "rust", "rust-jemalloc-fixture")
}

/// The same Rust program on tikv-jemallocator 0.4: jemalloc 5.2.1, whose
/// malloc fast path memprobe does not recognise.
pub fn rust_jemalloc_5_2_fixture() -> PathBuf {
    cargo_fixture("rust-jemalloc-5.2", "rust-5.2", "rust-jemalloc-5-2-fixture")
}

/// A Rust fixture built by cargo from `tests/fixtures/<folder>`.
fn cargo_fixture(folder: &str, target: &str, binary: &str) -> PathBuf {
    let target_dir = workspace_root().join("target/fixtures").join(target);
    build_once(binary, |_| {
        let mut command = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
        command
            .args(["build", "--release", "--quiet", "--manifest-path"])
            .arg(fixture_source(&format!("{folder}/Cargo.toml")))
            .arg("--target-dir")
            .arg(&target_dir)
            .env("RUSTFLAGS", "-C force-frame-pointers=yes");
        command
    });
    target_dir.join("release").join(binary)
}

/// The Java fixtures' classes, compiled into one folder.
pub fn java_classes() -> PathBuf {
    build_once("java", |out| {
        std::fs::create_dir_all(out).unwrap();
        let mut command = Command::new(format!("{JAVA_HOME}/bin/javac"));
        command
            .arg("-d")
            .arg(out)
            .arg(fixture_source("java/DirectBuffers.java"))
            .arg(fixture_source("java/JniAlloc.java"))
            .arg(fixture_source("java/HotAlloc.java"));
        command
    })
}

pub fn java_command(main_class: &str) -> Command {
    java_command_with(main_class, &[])
}

/// `java` with extra JVM flags (before the main class).
pub fn java_command_with(main_class: &str, flags: &[&str]) -> Command {
    let mut command = Command::new(format!("{JAVA_HOME}/bin/java"));
    command
        .args([
            "-Xmx64m",
            "-XX:MaxDirectMemorySize=256m",
            "-XX:+UseSerialGC",
        ])
        .args(flags)
        .arg("-cp")
        .arg(java_classes())
        .arg(main_class);
    command
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
    pub fn start_command(mut command: Command) -> Self {
        let mut child = command
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("starting {command:?}: {e}"));
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

impl Memprobe {
    pub fn start(args: &[&str]) -> Self {
        let mut command = Command::new(memprobe_bin());
        command
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped());
        Self::start_command(command)
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

/// `go tool pprof -top -sample_index=SAMPLE_TYPE OPTIONS FILE`, which must
/// succeed: its table.
pub fn pprof_top(file: &Path, sample_type: &str, options: &[&str]) -> String {
    let out = Command::new("go")
        .args(["tool", "pprof", "-top"])
        .arg(format!("-sample_index={sample_type}"))
        .args(options)
        .arg(file)
        .output()
        .expect("running go tool pprof");
    assert!(
        out.status.success(),
        "go tool pprof {sample_type}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The flat value of `name` in `go tool pprof -top` output, in bytes or
/// objects ("16MB" is 16 MiB, as pprof counts).
pub fn pprof_flat(top: &str, name: &str) -> f64 {
    let row = top
        .lines()
        .find(|l| l.split_whitespace().nth(5) == Some(name))
        .unwrap_or_else(|| panic!("{name} not in:\n{top}"));
    let flat = row.split_whitespace().next().unwrap();
    let split = flat
        .find(|c: char| c.is_ascii_alphabetic())
        .unwrap_or(flat.len());
    let (number, unit) = flat.split_at(split);
    let scale = match unit {
        "" | "B" => 1.0,
        "kB" => 1024.0,
        "MB" => 1048576.0,
        "GB" => 1073741824.0,
        other => panic!("unit {other:?} in {row}"),
    };
    number.parse::<f64>().unwrap() * scale
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

/// `jeprof --text <flag>`: flat megabytes per function.
pub fn jeprof_text(binary: &Path, heap: &Path, flag: &str) -> HashMap<String, f64> {
    jeprof_rows(binary, heap, flag)
        .into_iter()
        .map(|r| (r.name, r.flat))
        .collect()
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

/// One row of `jeprof --text`, in megabytes.
#[derive(Clone, Debug)]
pub struct JeprofRow {
    pub name: String,
    pub flat: f64,
    pub cum: f64,
}

/// `jeprof --text <flag>` rows, with the cumulative column.
pub fn jeprof_rows(binary: &Path, heap: &Path, flag: &str) -> Vec<JeprofRow> {
    let out = Command::new("jeprof")
        .args(["--text", flag])
        .arg(binary)
        .arg(heap)
        .output()
        .expect("running jeprof");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "jeprof failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    parse_jeprof_rows(&text)
}

/// Rows of `jeprof --text` output.
pub fn parse_jeprof_rows(text: &str) -> Vec<JeprofRow> {
    text.lines()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            if fields.len() < 6 || !fields[1].ends_with('%') {
                return None;
            }
            Some(JeprofRow {
                name: fields[5..].join(" "),
                flat: fields[0].parse().ok()?,
                cum: fields[3].parse().ok()?,
            })
        })
        .collect()
}

/// Flat megabytes by function name, from `jeprof --text` output.
pub fn parse_jeprof_text(text: &str) -> HashMap<String, f64> {
    parse_jeprof_rows(text)
        .into_iter()
        .map(|r| (r.name, r.flat))
        .collect()
}

/// The row whose function name contains `needle`, with the largest cum.
pub fn row<'a>(rows: &'a [JeprofRow], needle: &str) -> &'a JeprofRow {
    rows.iter()
        .filter(|r| r.name.contains(needle))
        .max_by(|a, b| a.cum.total_cmp(&b.cum))
        .unwrap_or_else(|| panic!("no {needle} in jeprof's output: {rows:#?}"))
}

/// The `heap_v2` files in `dir` (not the self-symbolized `.sym.heap`), sorted.
pub fn heap_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "heap"))
        .filter(|p| !p.to_string_lossy().ends_with(".sym.heap"))
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
                let rest = l.strip_prefix("memprobe: serving http://")?;
                Some(rest.split('/').next()?.to_owned())
            }) {
                return address;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("memprobe said nowhere it serves:\n{}", self.stderr_text());
    }
}
