//! `cargo xtask dist`: a .deb of the release binary, its man page, its
//! shell completions and the agent's systemd unit, for `dpkg -i`. The man
//! page and completions come from the binary itself (`memprobe --generate`),
//! so that they describe the flags it has.
use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context, Result, bail};

use crate::{release_binary, run_command, workspace_root};

/// Where each generated file goes in the package, and what makes it.
const GENERATED: [(&str, &str); 4] = [
    ("man", "usr/share/man/man1/memprobe.1"),
    ("bash", "usr/share/bash-completion/completions/memprobe"),
    ("zsh", "usr/share/zsh/vendor-completions/_memprobe"),
    ("fish", "usr/share/fish/vendor_completions.d/memprobe.fish"),
];

/// Builds `target/dist/memprobe_VERSION_amd64.deb` from the release binary
/// (built already); returns its path.
pub fn deb() -> Result<PathBuf> {
    let binary = release_binary();
    let version = version(&binary)?;
    let dist = workspace_root().join("target/dist");
    let root = dist.join(format!("memprobe_{version}_amd64"));
    let _ = fs::remove_dir_all(&root);
    install_file(&binary, &root.join("usr/bin/memprobe"), 0o755)?;
    for (what, path) in GENERATED {
        let out = Command::new(&binary).args(["--generate", what]).output()?;
        if !out.status.success() {
            bail!("memprobe --generate {what} failed");
        }
        write_file(&root.join(path), &out.stdout, 0o644)?;
    }
    run_command(
        Command::new("gzip")
            .args(["-9n"])
            .arg(root.join(GENERATED[0].1)),
    )?;
    let unit = workspace_root().join("deploy/memprobe.service");
    install_file(
        &unit,
        &root.join("lib/systemd/system/memprobe.service"),
        0o644,
    )?;
    let control = control(&version, installed_kib(&root)?);
    write_file(&root.join("DEBIAN/control"), control.as_bytes(), 0o644)?;
    let deb = dist.join(format!("memprobe_{version}_amd64.deb"));
    run_command(
        Command::new("dpkg-deb")
            .args(["--root-owner-group", "-Zxz", "--build"])
            .arg(&root)
            .arg(&deb),
    )?;
    eprintln!("xtask: {}", deb.display());
    Ok(deb)
}

/// "0.1.0" from `memprobe --version`.
fn version(binary: &Path) -> Result<String> {
    let out = Command::new(binary).arg("--version").output()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let version = text
        .split_whitespace()
        .nth(1)
        .with_context(|| format!("no version in {text:?}"))?;
    Ok(version.to_owned())
}

fn control(version: &str, installed_kib: u64) -> String {
    format!(
        "Package: memprobe\n\
         Version: {version}\n\
         Architecture: amd64\n\
         Maintainer: memprobe developers <memprobe@users.noreply.github.com>\n\
         Installed-Size: {installed_kib}\n\
         Depends: libc6 (>= 2.36)\n\
         Recommends: libjemalloc2\n\
         Suggests: golang-go, libjemalloc-dev\n\
         Section: devel\n\
         Priority: optional\n\
         Description: heap allocation profiler for running processes (eBPF)\n \
         memprobe attaches uprobes to the allocators of a running process\n \
         (jemalloc, glibc malloc, mimalloc, tcmalloc) without a restart and\n \
         writes heap profiles that jeprof and go tool pprof read, flame\n \
         graphs, leak rankings, and an account of all its resident memory.\n \
         It can run as a host agent serving pprof and Prometheus endpoints\n \
         (memprobe.service).\n"
    )
}

/// The package's files' total size, in KiB, as dpkg wants it.
fn installed_kib(root: &Path) -> Result<u64> {
    fn walk(dir: &Path) -> Result<u64> {
        let mut bytes = 0;
        for entry in fs::read_dir(dir)? {
            let entry = entry?;
            let kind = entry.file_type()?;
            bytes += if kind.is_dir() {
                walk(&entry.path())?
            } else {
                entry.metadata()?.len()
            };
        }
        Ok(bytes)
    }
    Ok(walk(root)?.div_ceil(1024))
}

fn install_file(from: &Path, to: &Path, mode: u32) -> Result<()> {
    fs::create_dir_all(to.parent().context("no parent")?)?;
    fs::copy(from, to).with_context(|| format!("copying {}", from.display()))?;
    set_mode(to, mode)
}

fn write_file(path: &Path, bytes: &[u8], mode: u32) -> Result<()> {
    fs::create_dir_all(path.parent().context("no parent")?)?;
    fs::write(path, bytes).with_context(|| format!("writing {}", path.display()))?;
    set_mode(path, mode)
}

fn set_mode(path: &Path, mode: u32) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    Ok(fs::set_permissions(path, fs::Permissions::from_mode(mode))?)
}
