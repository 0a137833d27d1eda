//! The initramfs each kernel boots: busybox, the release memprobe, the
//! sites fixture, bpftool, the libraries `ldd` lists for them at their
//! `/usr/lib` paths, the smoke suite, and an `/init` that runs it and
//! powers off.
use std::{
    fs,
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use anyhow::{Context, Result, bail};

use crate::run_command;

/// The suite's script, also run as it is on the host's own kernel.
pub const SMOKE_SCRIPT: &str = include_str!("../../vm/smoke.sh");

/// Runs as PID 1: mounts what memprobe reads, says which kernel this is,
/// runs the suite, and powers the VM off (qemu exits: `-no-reboot`).
const INIT: &str = r#"#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/bin:/usr/sbin:/usr/bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
mount -t tmpfs tmpfs /tmp
echo "@@ kernel"; uname -r; echo "@@ end"
SMOKE_BIN=/smoke SMOKE_OUT=/tmp/smoke sh /smoke/smoke.sh 2>&1
poweroff -f
"#;

/// The programs the suite runs, by their paths on this machine.
pub struct Programs {
    pub memprobe: PathBuf,
    pub sites: PathBuf,
}

/// Builds the sites fixture as the test suite does (debug info, frame
/// pointers, linked to libjemalloc.so.2).
pub fn build_sites(out: &Path) -> Result<PathBuf> {
    let root = crate::workspace_root();
    let binary = out.join("sites");
    run_command(
        Command::new("cc")
            .args([
                "-O1",
                "-g",
                "-fno-omit-frame-pointer",
                "-fno-optimize-sibling-calls",
            ])
            .arg("-o")
            .arg(&binary)
            .arg(root.join("tests/fixtures/sites.c"))
            .arg("-ljemalloc"),
    )?;
    Ok(binary)
}

/// Writes `target/vm/initramfs.cpio` and returns its path.
pub fn build(programs: &Programs, dir: &Path) -> Result<PathBuf> {
    let root = dir.join("initramfs");
    let _ = fs::remove_dir_all(&root);
    for folder in [
        "bin",
        "smoke",
        "proc",
        "sys",
        "dev",
        "tmp",
        "usr/sbin",
        "usr/lib64",
    ] {
        fs::create_dir_all(root.join(folder))?;
    }
    // Debian's merged /usr: /lib and /lib64 are links into /usr.
    std::os::unix::fs::symlink("usr/lib", root.join("lib"))?;
    std::os::unix::fs::symlink("usr/lib64", root.join("lib64"))?;
    copy_executable(Path::new("/bin/busybox"), &root.join("bin/busybox"))?;
    write_executable(&root.join("init"), INIT)?;
    write_executable(&root.join("smoke/smoke.sh"), SMOKE_SCRIPT)?;
    copy_executable(&programs.memprobe, &root.join("smoke/memprobe"))?;
    copy_executable(&programs.sites, &root.join("smoke/sites"))?;
    let bpftool = Path::new("/usr/sbin/bpftool");
    copy_executable(bpftool, &root.join("usr/sbin/bpftool"))?;
    for binary in [&programs.memprobe, &programs.sites, &bpftool.to_owned()] {
        for library in shared_libraries(binary)? {
            let inside = root.join(usr_path(&library).strip_prefix("/")?);
            fs::create_dir_all(inside.parent().context("library path")?)?;
            fs::copy(&library, &inside)
                .with_context(|| format!("copying {}", library.display()))?;
        }
    }
    let archive = dir.join("initramfs.cpio");
    pack(&root, &archive)?;
    Ok(archive)
}

/// `/lib/x86_64-linux-gnu/libc.so.6` as `/usr/lib/...`: where Debian keeps it.
fn usr_path(path: &Path) -> PathBuf {
    match path.strip_prefix("/usr") {
        Ok(_) => path.to_owned(),
        Err(_) => Path::new("/usr").join(path.strip_prefix("/").unwrap_or(path)),
    }
}

/// The files `ldd` resolves for `binary`, the loader included.
fn shared_libraries(binary: &Path) -> Result<Vec<PathBuf>> {
    let output = Command::new("ldd")
        .arg(binary)
        .output()
        .context("running ldd")?;
    if !output.status.success() {
        bail!("ldd {} failed", binary.display());
    }
    Ok(String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter_map(|line| {
            // "libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x...)" or
            // "/lib64/ld-linux-x86-64.so.2 (0x...)"
            let line = line.trim();
            let path = line.split_once("=> ").map_or(line, |(_, path)| path);
            let path = path.split(" (").next()?;
            path.starts_with('/').then(|| PathBuf::from(path))
        })
        .collect())
}

fn copy_executable(from: &Path, to: &Path) -> Result<()> {
    fs::copy(from, to).with_context(|| format!("copying {}", from.display()))?;
    Ok(())
}

fn write_executable(path: &Path, text: &str) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    fs::write(path, text)?;
    fs::set_permissions(path, fs::Permissions::from_mode(0o755))?;
    Ok(())
}

/// `find . | cpio -o -H newc`, uncompressed: the kernel unpacks it faster
/// than it would gunzip it under emulation.
fn pack(root: &Path, archive: &Path) -> Result<()> {
    let files = Command::new("find")
        .arg(".")
        .current_dir(root)
        .output()
        .context("running find")?;
    let mut cpio = Command::new("cpio")
        .args(["--quiet", "-o", "-H", "newc"])
        .current_dir(root)
        .stdin(Stdio::piped())
        .stdout(fs::File::create(archive)?)
        .spawn()
        .context("running cpio (apt-get install cpio)")?;
    use std::io::Write;
    cpio.stdin
        .take()
        .context("cpio's stdin")?
        .write_all(&files.stdout)?;
    if !cpio.wait()?.success() {
        bail!("cpio failed");
    }
    Ok(())
}
