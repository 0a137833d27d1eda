//! The fixtures: C, C++, Rust and Java programs with known allocation
//! sites, built once per test run.
use std::{
    path::{Path, PathBuf},
    process::Command,
    sync::Mutex,
};

use crate::*;

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

/// Memory beyond the heap: a buffer pool over its own mapping, glibc and
/// jemalloc allocations and threads, or jemalloc fragmented
/// (`FIXTURE_MODE=fragment`); linked to libjemalloc.so.2.
pub fn memory_account_fixture() -> PathBuf {
    build_once("memory_account", |out| {
        compile("cc", out, "memory_account.c", &["-ljemalloc", "-lpthread"])
    })
}

/// Two sites in a fixed 64-byte cycle (or irregular sizes), which
/// jemalloc's 64 KiB thread threshold aliases with, for sampling in
/// windows; linked to libjemalloc.so.2.
pub fn aliasing_fixture() -> PathBuf {
    build_once("aliasing", |out| {
        compile("cc", out, "aliasing.c", &["-ljemalloc"])
    })
}

/// A shared library with mimalloc linked in (local symbols, as in pyarrow's
/// libarrow), exporting `keep_blocks` for the dlopen host.
pub fn mimalloc_library() -> PathBuf {
    cargo_fixture(
        "rust-mimalloc-lib",
        "rust-mimalloc",
        "librust_mimalloc_lib.so",
    )
}

/// A shared library with jemalloc inside, its TLS reached through
/// `__tls_get_addr` (as polars' runtime's), exporting `run_cycle` for the
/// dlopen host.
pub fn jemalloc_library() -> PathBuf {
    cargo_fixture(
        "rust-jemalloc-lib",
        "rust-jemalloc-lib",
        "librust_jemalloc_lib.so",
    )
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

/// jemalloc as a shared library, built from Debian's libjemalloc_pic.a:
/// like Debian's libjemalloc.so.2 (the same build, `config.prof` on), but
/// with its symbol table, so that a test can strip it into a debug file.
pub fn shared_jemalloc_fixture() -> PathBuf {
    build_once("libjemalloc_from_pic.so", |out| {
        let mut command = Command::new("cc");
        command
            .args(["-shared", "-Wl,-soname,libjemalloc_from_pic.so", "-o"])
            .arg(out)
            .args([
                "-Wl,--whole-archive",
                JEMALLOC_STATIC,
                "-Wl,--no-whole-archive",
            ])
            .args(["-lpthread", "-lm", "-ldl", "-lstdc++"]);
        command
    })
}

/// The sites fixture on [`shared_jemalloc_fixture`], which it loads from
/// its own folder (`$ORIGIN`): a copy elsewhere takes the library there.
pub fn sites_on_shared_jemalloc_fixture() -> PathBuf {
    let library = shared_jemalloc_fixture();
    let folder = library.parent().unwrap().to_str().unwrap().to_owned();
    build_once("sites_on_shared_jemalloc", |out| {
        let link = [
            "-L",
            &folder,
            "-l:libjemalloc_from_pic.so",
            "-Wl,-rpath,$ORIGIN",
        ];
        compile("cc", out, "sites.c", &link)
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

/// Three sites with different trends over 6 seconds.
/// A server-shaped program (`server.c`) that runs on its own for
/// FIXTURE_SECONDS: the process the docs' commands profile.
pub fn server_fixture() -> PathBuf {
    build_once("server", |out| {
        compile("cc", out, "server.c", &["-ljemalloc"])
    })
}

pub fn trends_fixture() -> PathBuf {
    build_once("trends", |out| {
        compile("cc", out, "trends.c", &["-ljemalloc"])
    })
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

/// A C++ shared library with its own static jemalloc hidden from its
/// dynamic symbols (`--exclude-libs`), exporting `keep_blocks` for the
/// dlopen host; with its symbol table, for a test to strip.
pub fn hidden_jemalloc_cxx_library() -> PathBuf {
    build_once("libhiddenje.so", |out| {
        compile(
            "g++",
            out,
            "hidden_je_lib.cpp",
            &[
                "-shared",
                "-fPIC",
                JEMALLOC_STATIC,
                "-Wl,--exclude-libs,ALL",
                "-Wl,-Bsymbolic",
                "-lpthread",
            ],
        )
    })
}

/// A program with jemalloc's strings and a malloc-shaped function, but no
/// jemalloc: what memprobe must refuse to probe once it is stripped.
pub fn near_miss_fixture() -> PathBuf {
    build_once("near_miss", |out| compile("cc", out, "near_miss.c", &[]))
}

/// The ruff release the tests download from PyPI.
pub const RUFF_VERSION: &str = "0.17.6";

/// ruff's executable from its PyPI wheel, as users install it: a stripped
/// Rust binary with tikv-jemallocator linked in, with no debug file
/// published.
pub fn ruff_from_pypi() -> PathBuf {
    build_once("ruff", |out| {
        let script = format!(
            r#"
import glob, os, subprocess, sys, tempfile, zipfile
out = sys.argv[1]
with tempfile.TemporaryDirectory() as d:
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                    "--only-binary=:all:", "-d", d, "ruff=={RUFF_VERSION}"], check=True)
    wheel = glob.glob(os.path.join(d, "*.whl"))[0]
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith("/scripts/ruff"))
        with z.open(name) as src, open(out, "wb") as dst:
            dst.write(src.read())
os.chmod(out, 0o755)
"#
        );
        let mut command = Command::new("python3");
        command.arg("-c").arg(script).arg(out);
        command
    })
}

/// The near miss as a shared library, for the dlopen host to load.
pub fn near_miss_library() -> PathBuf {
    build_once("libnearmiss.so", |out| {
        compile(
            "cc",
            out,
            "near_miss.c",
            &["-shared", "-fPIC", "-Dmain=near_miss_main"],
        )
    })
}

/// A stripped copy of `unstripped` in `dir`, its debug file in `dir/debug`
/// linked by name. Returns (binary, debug folder).
pub fn strip_keeping_debug(unstripped: &Path, dir: &Path, name: &str) -> (PathBuf, PathBuf) {
    let debug_dir = dir.join("debug");
    std::fs::create_dir_all(&debug_dir).unwrap();
    let binary = dir.join(name);
    std::fs::copy(unstripped, &binary).unwrap();
    let debug = debug_dir.join(format!("{name}.debug"));
    let link = format!("--add-gnu-debuglink={name}.debug");
    let (binary_arg, debug_arg) = (binary.to_str().unwrap(), debug.to_str().unwrap());
    for args in [
        vec!["--only-keep-debug", binary_arg, debug_arg],
        vec!["--strip-all", binary_arg],
        // Run in the debug folder: objcopy reads the file to sign the link.
        vec![link.as_str(), binary_arg],
    ] {
        let status = Command::new("objcopy")
            .args(&args)
            .current_dir(&debug_dir)
            .status()
            .unwrap();
        assert!(status.success(), "objcopy {args:?}");
    }
    (binary, debug_dir)
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

/// The same malloc/free loop on glibc's malloc (built without an
/// allocator): every call traps, glibc having no windows.
pub fn glibc_loop_fixture() -> PathBuf {
    build_once("glibc_loop", |out| compile("cc", out, "malloc_loop.c", &[]))
}

/// A process with no allocator mapped (no libc) for 300 ms, which then
/// execs its arguments: one met before its program is loaded.
pub fn exec_later_fixture() -> PathBuf {
    build_once("exec_later", |out| {
        let no_libc = ["-nostdlib", "-static", "-no-pie", "-fno-stack-protector"];
        compile("cc", out, "exec_later.c", &no_libc)
    })
}

/// Two processes passing a byte over pipes, no allocator call (glibc's
/// mapped, never called).
pub fn ping_pong_fixture() -> PathBuf {
    build_once("ping_pong", |out| compile("cc", out, "ping_pong.c", &[]))
}

/// The Rust fixture on tikv-jemallocator (builds jemalloc from source).
pub fn rust_fixture() -> PathBuf {
    cargo_fixture("rust-jemalloc", "rust", "rust-jemalloc-fixture")
}

/// The same Rust program with jemalloc's heap profiler built in (run it
/// with `_RJEM_MALLOC_CONF=prof:true`).
pub fn rust_prof_fixture() -> PathBuf {
    let target_dir = workspace_root().join("target/fixtures/rust-prof");
    build_once("rust-prof-jemalloc-fixture", |_| {
        let mut command = cargo_build("rust-jemalloc", &target_dir);
        command.args(["--features", "profiling"]);
        command
    });
    target_dir.join("release/rust-jemalloc-fixture")
}

/// The same Rust program on tikv-jemallocator 0.4: jemalloc 5.2.1, which
/// has no slow path to sample on (5.3's thread events).
pub fn rust_jemalloc_5_2_fixture() -> PathBuf {
    cargo_fixture("rust-jemalloc-5.2", "rust-5.2", "rust-jemalloc-5-2-fixture")
}

/// A Rust fixture built by cargo from `tests/fixtures/<folder>`.
fn cargo_fixture(folder: &str, target: &str, binary: &str) -> PathBuf {
    let target_dir = workspace_root().join("target/fixtures").join(target);
    build_once(binary, |_| cargo_build(folder, &target_dir));
    target_dir.join("release").join(binary)
}

/// `cargo build --release` of `tests/fixtures/<folder>` into `target_dir`.
fn cargo_build(folder: &str, target_dir: &Path) -> Command {
    let mut command = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    command
        .args(["build", "--release", "--quiet", "--manifest-path"])
        .arg(fixture_source(&format!("{folder}/Cargo.toml")))
        .arg("--target-dir")
        .arg(target_dir)
        .env("RUSTFLAGS", "-C force-frame-pointers=yes");
    command
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
            .arg(fixture_source("java/HotAlloc.java"))
            .arg(fixture_source("java/Server.java"));
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

/// Debian 12's CPython, which the Python fixture runs.
pub const PYTHON: &str = "/usr/bin/python3.11";

/// A virtualenv (seeing Debian's numpy) with the fixture's C extension
/// built into its site-packages, as `pip install` would put it.
pub fn python_venv() -> PathBuf {
    build_once("python-venv", |venv| {
        let made = Command::new(PYTHON)
            .args(["-m", "venv", "--system-site-packages", "--without-pip"])
            .arg(venv)
            .status()
            .expect("running python3.11 -m venv");
        assert!(made.success(), "making the virtualenv failed");
        let site = venv.join("lib/python3.11/site-packages");
        for wheel in wheels() {
            install_wheel(&wheel, &site);
        }
        let suffix = Command::new(PYTHON)
            .args([
                "-c",
                "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))",
            ])
            .output()
            .expect("asking python3.11 for its extension suffix");
        let suffix = String::from_utf8_lossy(&suffix.stdout).trim().to_owned();
        let mut command = Command::new("cc");
        command
            .args(C_FLAGS)
            .args(["-shared", "-fPIC", "-I/usr/include/python3.11", "-o"])
            .arg(site.join(format!("alloc_ext{suffix}")))
            .arg(fixture_source("python/alloc_ext.c"))
            .arg("-lpthread");
        command
    })
}

/// The wheels the virtualenv loads (pyarrow, polars), downloaded by
/// `cargo xtask test` into the folder it gives as `MEMPROBE_WHEELS`.
fn wheels() -> Vec<PathBuf> {
    let dir = std::env::var_os("MEMPROBE_WHEELS")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join("target/wheels"));
    let wheels: Vec<PathBuf> = (std::fs::read_dir(&dir).into_iter().flatten().flatten())
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "whl"))
        .collect();
    assert!(
        !wheels.is_empty(),
        "no wheels in {}: `cargo xtask test` downloads them",
        dir.display()
    );
    wheels
}

/// Unpacks `wheel` into `site` (what pip does for a wheel with no scripts),
/// once.
fn install_wheel(wheel: &Path, site: &Path) {
    let name = wheel.file_name().unwrap().to_string_lossy();
    let dist_info = name.split('-').take(2).collect::<Vec<_>>().join("-") + ".dist-info";
    if site.join(dist_info).exists() {
        return;
    }
    let status = Command::new(PYTHON)
        .args(["-m", "zipfile", "-e"])
        .arg(wheel)
        .arg(site)
        .status()
        .expect("running python3.11 -m zipfile");
    assert!(status.success(), "unpacking {} failed", wheel.display());
}

/// The Python fixture, run by the virtualenv's interpreter.
pub fn python_fixture() -> Command {
    let mut command = Command::new(python_venv().join("bin/python"));
    command.arg(fixture_source("python/fixture.py"));
    command
}

/// The line of `site` in the Python fixture (its `# site: NAME` comment).
pub fn python_site_line(site: &str) -> usize {
    let source = std::fs::read_to_string(fixture_source("python/fixture.py")).unwrap();
    let marker = format!("# site: {site}");
    source
        .lines()
        .position(|l| l.ends_with(&marker))
        .unwrap_or_else(|| panic!("no {marker:?} in fixture.py"))
        + 1
}

/// A Python of another Debian suite, unpacked by `cargo xtask test`
/// (given as `MEMPROBE_PYTHON_3_13`...): its root.
pub fn other_python_root(version: &str) -> PathBuf {
    let variable = format!("MEMPROBE_PYTHON_{}", version.replace('.', "_"));
    let root = std::env::var_os(&variable)
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join(format!("target/python{version}/root")));
    let interpreter = root.join(format!("usr/bin/python{version}"));
    assert!(
        interpreter.exists(),
        "no {}: `cargo xtask test` unpacks it",
        interpreter.display()
    );
    root
}

/// The Python fixture run by Python `version` of another suite, through
/// that suite's loader and glibc; with the C extension built against its
/// headers where `with_extension`.
pub fn other_python_fixture(version: &str, with_extension: bool) -> Command {
    let root = other_python_root(version);
    // Suites before Debian 12 keep glibc under /lib, not /usr/lib.
    let libraries = ["usr/lib/x86_64-linux-gnu", "lib/x86_64-linux-gnu"].map(|d| root.join(d));
    let loader = (libraries.iter())
        .map(|d| d.join("ld-linux-x86-64.so.2"))
        .find(|l| l.exists())
        .unwrap_or_else(|| panic!("no loader under {}", root.display()));
    let mut command = Command::new(loader);
    command
        .arg("--library-path")
        .arg(std::env::join_paths(&libraries).unwrap())
        .arg(root.join(format!("usr/bin/python{version}")))
        .arg(fixture_source("python/fixture.py"));
    if with_extension {
        let extension = build_once(&format!("python{version}-extension"), |dir| {
            std::fs::create_dir_all(dir).unwrap();
            let mut command = Command::new("cc");
            command
                .args(C_FLAGS)
                .args(["-shared", "-fPIC", "-I"])
                .arg(root.join(format!("usr/include/python{version}")))
                // pyconfig.h, behind Debian 12's own system headers.
                .arg("-idirafter")
                .arg(root.join("usr/include"))
                .arg("-o")
                .arg(dir.join("alloc_ext.so"))
                .arg(fixture_source("python/alloc_ext.c"))
                .arg("-lpthread");
            command
        });
        command.env("PYTHONPATH", extension);
    }
    command
}
