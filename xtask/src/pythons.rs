//! Other CPythons for the Python tests, from other Debian suites: 3.13
//! from Debian 13 (trixie), 3.14 from forky and 3.15 from sid, which
//! memprobe reads, and 3.9 from Debian 11 (bullseye, as old as RHEL 9's),
//! which it does not. Their packages are unpacked, not installed,
//! under `target/python3.X/root`, with their suite's glibc beside them
//! (older or newer than Debian 12's), and run through that glibc's loader.
//! Unpacked once.
use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context, Result, bail};

use crate::{run_command, workspace_root};

const MIRROR: &str = "http://deb.debian.org/debian";

/// (version, suite): each Python and the suite it comes from.
pub const PYTHONS: [(&str, &str); 4] = [
    ("3.9", "bullseye"),
    ("3.13", "trixie"),
    ("3.14", "forky"),
    ("3.15", "sid"),
];

/// The interpreter, the part of its library it starts with, its headers
/// (for the test extension), and what the interpreter links to.
fn packages(version: &str) -> Vec<String> {
    let mut packages: Vec<String> = ["python{}-minimal", "libpython{}-minimal", "libpython{}-dev"]
        .iter()
        .map(|p| p.replace("{}", version))
        .collect();
    packages.extend(["libc6", "libexpat1", "zlib1g"].map(String::from));
    packages
}

/// Unpacks each of [`PYTHONS`]: the variable that gives the tests each
/// root (`MEMPROBE_PYTHON_3_13`...), and the root.
pub fn unpack_all() -> Result<Vec<(String, PathBuf)>> {
    PYTHONS
        .iter()
        .map(|(version, suite)| {
            let variable = format!("MEMPROBE_PYTHON_{}", version.replace('.', "_"));
            Ok((variable, unpack(version, suite)?))
        })
        .collect()
}

/// Unpacks Python `version` from `suite` (once); the folder it went into.
fn unpack(version: &str, suite: &str) -> Result<PathBuf> {
    let root = workspace_root().join(format!("target/python{version}/root"));
    if root.join(format!("usr/bin/python{version}")).exists() {
        return Ok(root);
    }
    crate::setup::install_packages(&["curl", "xz-utils"])?;
    let dir = root.parent().context("no parent")?.to_owned();
    fs::create_dir_all(&dir)?;
    let index = dir.join("Packages");
    fetch(
        &format!("{MIRROR}/dists/{suite}/main/binary-amd64/Packages.xz"),
        &dir.join("Packages.xz"),
    )?;
    run_command(
        Command::new("xz")
            .args(["-d", "-f"])
            .arg(dir.join("Packages.xz")),
    )?;
    let index = fs::read_to_string(&index)?;
    let unpacking = dir.join("unpacking");
    let _ = fs::remove_dir_all(&unpacking);
    for package in packages(version) {
        let file = pool_file(&index, &package)
            .with_context(|| format!("{package} is not in {suite}'s index"))?;
        let deb = dir.join(format!("{package}.deb"));
        fetch(&format!("{MIRROR}/{file}"), &deb)?;
        run_command(Command::new("dpkg-deb").arg("-x").arg(&deb).arg(&unpacking))?;
        fs::remove_file(&deb)?;
    }
    // Renamed into place last: a run cut short unpacks again.
    fs::rename(&unpacking, &root)?;
    Ok(root)
}

/// The pool path of `package` in a `Packages` index.
fn pool_file<'a>(index: &'a str, package: &str) -> Option<&'a str> {
    index
        .split("\n\n")
        .find(|stanza| stanza.lines().next() == Some(&format!("Package: {package}")))?
        .lines()
        .find_map(|line| line.strip_prefix("Filename: "))
}

fn fetch(url: &str, to: &Path) -> Result<()> {
    eprintln!("xtask: fetching {url}");
    let status = Command::new("curl")
        .args(["-fsSL", "-o"])
        .arg(to)
        .arg(url)
        .status()
        .context("running curl")?;
    if !status.success() {
        bail!("fetching {url} failed with {status}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_a_package_s_file_in_the_index() {
        let index = "Package: libc6-dev\nFilename: pool/main/g/glibc/libc6-dev.deb\n\n\
                     Package: libc6\nVersion: 2.41\nFilename: pool/main/g/glibc/libc6.deb\n";
        assert_eq!(
            pool_file(index, "libc6"),
            Some("pool/main/g/glibc/libc6.deb")
        );
        assert_eq!(pool_file(index, "zlib1g"), None);
    }
}
