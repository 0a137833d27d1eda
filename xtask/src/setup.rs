//! Installing the build and test prerequisites, skipping what is there.
use std::{fs, path::PathBuf, process::Command};

use anyhow::{Context, Result, bail};

use crate::run_command;

/// Debian packages: jemalloc (library, headers, jeprof, static archive),
/// mimalloc and gperftools' tcmalloc for the other allocators' tests,
/// binutils for jeprof and strip, C and C++ compilers, Go (go tool pprof) and a JDK for the
/// fixtures, util-linux for setpriv and unshare, prometheus (and promtool) for
/// the metrics endpoint, man-db for the installed package's man page.
const PACKAGES: &[&str] = &[
    "libjemalloc2",
    "libjemalloc-dev",
    "libmimalloc2.0",
    "libgoogle-perftools4",
    "binutils",
    "bpftool",
    "bpftrace",
    "gcc",
    "g++",
    "golang-go",
    "libc6-dev",
    "man-db",
    "openjdk-17-jdk-headless",
    "perl",
    "prometheus",
    "python3-dev",
    "python3-numpy",
    "python3-venv",
    "util-linux",
];

/// bpf-linker's release that fits the nightly's LLVM (see shared docs).
const BPF_LINKER_VERSION: &str = "0.13.0";

pub fn install() -> Result<()> {
    apt_packages()?;
    nightly_rust_src()?;
    bpf_linker()?;
    Ok(())
}

/// cargo-fuzz, for the fuzz targets under fuzz/.
pub fn install_cargo_fuzz() -> Result<()> {
    let present = Command::new("cargo")
        .args(["fuzz", "--version"])
        .output()
        .is_ok_and(|out| out.status.success());
    if present {
        return Ok(());
    }
    eprintln!("xtask: installing cargo-fuzz");
    run_command(Command::new("cargo").args(["install", "--locked", "cargo-fuzz"]))
}

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

pub fn privileged(program: &str) -> Command {
    if is_root() {
        Command::new(program)
    } else {
        let mut command = Command::new("sudo");
        command.arg(program);
        command
    }
}

/// What `cargo xtask bench` runs besides memprobe.
const BENCH_PACKAGES: &[&str] = &["redis-server", "redis-tools"];

pub fn install_bench_tools() -> Result<()> {
    install_packages(BENCH_PACKAGES)?;
    mount_tracefs()
}

/// Where bpftrace finds the tracepoints' formats (the latency part's
/// window trace).
const TRACEFS: &str = "/sys/kernel/tracing";

/// Mounts tracefs where it is not: a freshly booted host of this kind has
/// none, bpftrace does not mount it, and without it no tracepoint is found.
fn mount_tracefs() -> Result<()> {
    if std::path::Path::new(TRACEFS).join("events").exists() {
        return Ok(());
    }
    eprintln!("xtask: mounting tracefs at {TRACEFS}");
    run_command(privileged("mount").args(["-t", "tracefs", "nodev", TRACEFS]))
}

fn apt_packages() -> Result<()> {
    install_packages(PACKAGES)
}

pub fn install_packages(packages: &[&str]) -> Result<()> {
    let missing: Vec<&str> = packages
        .iter()
        .copied()
        .filter(|package| {
            let status = Command::new("dpkg-query")
                .args(["-W", "-f=${Status}", package])
                .output();
            !matches!(status, Ok(out) if String::from_utf8_lossy(&out.stdout).contains("install ok installed"))
        })
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    eprintln!("xtask: installing Debian packages: {}", missing.join(" "));
    run_command(privileged("apt-get").args(["update", "-qq"]))?;
    run_command(
        privileged("apt-get")
            .env("DEBIAN_FRONTEND", "noninteractive")
            .args(["install", "-y", "-qq", "--no-install-recommends"])
            .args(&missing),
    )
}

fn nightly_rust_src() -> Result<()> {
    let installed = Command::new("rustup")
        .args(["component", "list", "--installed", "--toolchain", "nightly"])
        .output()
        .context("running rustup: is rustup installed?")?;
    if !installed.status.success() {
        eprintln!("xtask: installing the nightly toolchain");
        run_command(Command::new("rustup").args([
            "toolchain",
            "install",
            "nightly",
            "--profile",
            "minimal",
        ]))?;
    }
    if String::from_utf8_lossy(&installed.stdout).contains("rust-src") {
        return Ok(());
    }
    eprintln!("xtask: installing rust-src for the nightly toolchain");
    run_command(Command::new("rustup").args([
        "component",
        "add",
        "rust-src",
        "--toolchain",
        "nightly",
    ]))
}

/// The nightly ships its LLVM as a shared library; bpf-linker links against it.
fn nightly_llvm() -> Result<(PathBuf, String)> {
    let sysroot = Command::new("rustc")
        .args(["+nightly", "--print", "sysroot"])
        .output()
        .context("running rustc +nightly")?;
    let sysroot = PathBuf::from(String::from_utf8(sysroot.stdout)?.trim());
    let lib = sysroot.join("lib");
    for entry in fs::read_dir(&lib).with_context(|| format!("reading {}", lib.display()))? {
        let name = entry?.file_name().to_string_lossy().into_owned();
        // libLLVM.so.22.1-rust-1.97.0-nightly
        if let Some(version) = name.strip_prefix("libLLVM.so.") {
            let major = version.split('.').next().unwrap_or_default().to_owned();
            return Ok((lib.join(&name), major));
        }
    }
    bail!(
        "no libLLVM.so.* in {}: reinstall the nightly toolchain",
        lib.display()
    )
}

fn bpf_linker() -> Result<()> {
    let (llvm, major) = nightly_llvm()?;
    let cache = home().join(".cache/memprobe");
    let stamp = cache.join("bpf-linker.llvm");
    let wanted = format!("{BPF_LINKER_VERSION} {}", llvm.display());
    let works = Command::new("bpf-linker")
        .arg("--version")
        .output()
        .is_ok_and(|out| out.status.success());
    if works && fs::read_to_string(&stamp).is_ok_and(|s| s == wanted) {
        return Ok(());
    }
    eprintln!(
        "xtask: building bpf-linker {BPF_LINKER_VERSION} against {}",
        llvm.display()
    );
    // An LLVM prefix holding the library under both names it is looked up by.
    let prefix = cache.join("llvm");
    let prefix_lib = prefix.join("lib");
    fs::create_dir_all(&prefix_lib)?;
    let file_name = llvm.file_name().context("LLVM library name")?;
    for link in [prefix_lib.join("libLLVM.so"), prefix_lib.join(file_name)] {
        let _ = fs::remove_file(&link);
        std::os::unix::fs::symlink(&llvm, &link)
            .with_context(|| format!("linking {}", link.display()))?;
    }
    run_command(
        Command::new("cargo")
            .env("LLVM_PREFIX", &prefix)
            .args([
                "install",
                "--force",
                "bpf-linker",
                "--version",
                BPF_LINKER_VERSION,
            ])
            .args([
                "--no-default-features",
                "--features",
                &format!("llvm-{major}"),
            ]),
    )?;
    fs::write(&stamp, wanted)?;
    Ok(())
}

fn home() -> PathBuf {
    std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/root"))
}
