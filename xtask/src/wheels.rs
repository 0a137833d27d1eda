//! The wheels from PyPI that the Python tests load into their virtualenv:
//! pyarrow, whose `libarrow` carries its own jemalloc (prefixed
//! `je_arrow_`, its symbols local) and hands Python buffers from it.
//! Downloaded once, for Debian 12's Python 3.11, by Debian's pip.
use std::{fs, path::PathBuf, process::Command};

use anyhow::{Context, Result};

use crate::{run_command, workspace_root};

/// The last pyarrow that runs with Debian 12's numpy (1.24): later ones
/// ask for numpy 2.
const PYARROW: (&str, &str) = ("pyarrow", "17.0.0");

/// The variable that gives the tests the wheel, and the wheel.
pub fn pyarrow() -> Result<(&'static str, PathBuf)> {
    let (name, version) = PYARROW;
    let dir = workspace_root().join("target/wheels");
    let prefix = format!("{name}-{version}-cp311-");
    let found = || -> Result<Option<PathBuf>> {
        if !dir.exists() {
            return Ok(None);
        }
        Ok(fs::read_dir(&dir)?.flatten().map(|e| e.path()).find(|p| {
            let file = p.file_name().and_then(|n| n.to_str()).unwrap_or_default();
            file.starts_with(&prefix) && file.ends_with(".whl")
        }))
    };
    if let Some(wheel) = found()? {
        return Ok(("MEMPROBE_PYARROW_WHEEL", wheel));
    }
    crate::setup::install_packages(&["python3-pip"])?;
    fs::create_dir_all(&dir)?;
    run_command(
        Command::new("/usr/bin/python3")
            .args(["-m", "pip", "download", "--quiet", "--no-deps"])
            .args(["--only-binary=:all:", "--python-version", "3.11"])
            .args(["--platform", "manylinux_2_28_x86_64", "-d"])
            .arg(&dir)
            .arg(format!("{name}=={version}")),
    )?;
    let wheel =
        found()?.with_context(|| format!("pip left no {prefix}*.whl in {}", dir.display()))?;
    Ok(("MEMPROBE_PYARROW_WHEEL", wheel))
}
