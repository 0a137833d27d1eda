//! What booting other kernels needs, cached under `target/vm/`: qemu taken
//! out of Debian's packages (installing qemu-system-x86 would remove the
//! backported qemu-utils this machine image has), its firmware, and the
//! newest Debian kernels of each series.
use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context, Result, bail};

use crate::{run_command, setup};

/// Debian kernel packages booted by the suite: one per series production
/// runs, the newest the configured suites have of each.
pub const KERNEL_SERIES: &[(&str, &str)] = &[
    ("6.1", r"^linux-image-6\.1\.0-[0-9]+-cloud-amd64$"),
    (
        "6.12",
        r"^linux-image-6\.12\.[0-9]+\+deb[0-9]+-cloud-amd64$",
    ),
];

/// Packages installed normally: firmware, busybox for the initramfs, cpio.
const PACKAGES: &[&str] = &[
    "seabios",
    "ipxe-qemu",
    "qemu-system-data",
    "busybox-static",
    "cpio",
];

/// Packages unpacked rather than installed.
const UNPACKED: &[&str] = &["qemu-system-x86", "qemu-system-common"];

pub struct Vm {
    pub qemu: PathBuf,
    pub firmware: PathBuf,
}

pub fn vm_dir() -> PathBuf {
    crate::workspace_root().join("target/vm")
}

/// qemu and its firmware, installed once.
pub fn qemu() -> Result<Vm> {
    let dir = vm_dir();
    let root = dir.join("qemu");
    let qemu = root.join("usr/bin/qemu-system-x86_64");
    setup::install_packages(PACKAGES)?;
    if !qemu.exists() {
        eprintln!("xtask: unpacking qemu into {}", root.display());
        let debs = dir.join("debs");
        download(&debs, UNPACKED)?;
        for package in UNPACKED {
            unpack(&find_deb(&debs, package)?, &root)?;
        }
        fs::remove_dir_all(&debs)?;
    }
    // Cheap when present; a cached qemu may come from another machine.
    setup::install_packages(&qemu_libraries()?)?;
    let firmware = dir.join("firmware");
    fs::create_dir_all(&firmware)?;
    for folder in ["/usr/share/qemu", "/usr/share/seabios"] {
        for entry in fs::read_dir(folder).with_context(|| format!("reading {folder}"))? {
            let entry = entry?;
            let link = firmware.join(entry.file_name());
            if fs::symlink_metadata(&link).is_err() {
                std::os::unix::fs::symlink(entry.path(), &link)?;
            }
        }
    }
    Ok(Vm { qemu, firmware })
}

/// The libraries qemu-system-x86 depends on (its Depends: lines, less the
/// qemu packages themselves).
fn qemu_libraries() -> Result<Vec<&'static str>> {
    let output = Command::new("apt-cache")
        .args([
            "depends",
            "--no-recommends",
            "--no-suggests",
            "qemu-system-x86",
        ])
        .output()
        .context("running apt-cache")?;
    let text = String::from_utf8_lossy(&output.stdout);
    Ok(text
        .lines()
        .filter_map(|line| line.trim().strip_prefix("Depends: "))
        .filter(|name| !name.starts_with('<') && !name.starts_with("qemu-system-common"))
        .map(|name| &*Box::leak(name.to_owned().into_boxed_str()))
        .collect())
}

/// A booted kernel: the package it came from and its image.
pub struct Kernel {
    pub series: &'static str,
    pub package: String,
    pub vmlinuz: PathBuf,
}

/// The newest kernel of each series, downloaded once per package.
pub fn kernels() -> Result<Vec<Kernel>> {
    let dir = vm_dir().join("kernels");
    fs::create_dir_all(&dir)?;
    let mut kernels = Vec::new();
    for &(series, pattern) in KERNEL_SERIES {
        let package = newest_package(pattern)?
            .with_context(|| format!("no Debian package matches {pattern}: run apt-get update"))?;
        let vmlinuz = dir.join(format!("{package}.vmlinuz"));
        if !vmlinuz.exists() {
            eprintln!("xtask: downloading {package}");
            let scratch = dir.join("scratch");
            let _ = fs::remove_dir_all(&scratch);
            download(&scratch, &[&package])?;
            let unpacked = scratch.join("root");
            unpack(&find_deb(&scratch, &package)?, &unpacked)?;
            let image = fs::read_dir(unpacked.join("boot"))?
                .filter_map(|e| e.ok())
                .find(|e| e.file_name().to_string_lossy().starts_with("vmlinuz-"))
                .context("no vmlinuz in the kernel package")?;
            fs::copy(image.path(), &vmlinuz)?;
            fs::remove_dir_all(&scratch)?;
        }
        kernels.push(Kernel {
            series,
            package,
            vmlinuz,
        });
    }
    Ok(kernels)
}

fn newest_package(pattern: &str) -> Result<Option<String>> {
    let search = || -> Result<Vec<String>> {
        let output = Command::new("apt-cache")
            .args(["search", "--names-only", pattern])
            .output()
            .context("running apt-cache")?;
        Ok(String::from_utf8_lossy(&output.stdout)
            .lines()
            .filter_map(|line| line.split(" - ").next())
            .map(str::to_owned)
            .collect())
    };
    let mut names = search()?;
    if names.is_empty() {
        run_command(setup::privileged("apt-get").args(["update", "-qq"]))?;
        names = search()?;
    }
    Ok(names.into_iter().max_by_key(|name| version_key(name)))
}

/// The numbers in a package name, in order: "6.1.0-56" sorts after "6.1.0-9".
fn version_key(name: &str) -> Vec<u64> {
    name.split(|c: char| !c.is_ascii_digit())
        .filter_map(|part| part.parse().ok())
        .collect()
}

/// `apt-get download` into `dir` (not through `run_command`, which runs in
/// the workspace root).
fn download(dir: &Path, packages: &[&str]) -> Result<()> {
    fs::create_dir_all(dir)?;
    let status = Command::new("apt-get")
        .arg("download")
        .args(packages)
        .current_dir(dir)
        .status()
        .context("running apt-get download")?;
    if !status.success() {
        bail!("apt-get download {packages:?} failed with {status}");
    }
    Ok(())
}

fn find_deb(dir: &Path, package: &str) -> Result<PathBuf> {
    let prefix = format!("{package}_");
    fs::read_dir(dir)?
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .find(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with(&prefix))
        })
        .with_context(|| format!("{package}: no .deb downloaded into {}", dir.display()))
}

fn unpack(deb: &Path, into: &Path) -> Result<()> {
    fs::create_dir_all(into)?;
    run_command(Command::new("dpkg-deb").arg("-x").arg(deb).arg(into))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_versions_sort_by_number() {
        let names = [
            "linux-image-6.1.0-9-cloud-amd64",
            "linux-image-6.1.0-56-cloud-amd64",
            "linux-image-6.1.0-55-cloud-amd64",
        ];
        let newest = names.iter().max_by_key(|n| version_key(n)).unwrap();
        assert_eq!(*newest, "linux-image-6.1.0-56-cloud-amd64");
    }
}
