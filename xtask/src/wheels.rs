//! The wheels from PyPI that the Python tests load into their virtualenv:
//! pyarrow, whose `libarrow` carries its own jemalloc (prefixed
//! `je_arrow_`), and polars, whose runtime carries another (`_rjem_`),
//! each with its symbols local. Downloaded once, for Debian 12's Python
//! 3.11, by Debian's pip.
use std::{fs, path::PathBuf, process::Command};

use anyhow::{Result, bail};

use crate::{run_command, workspace_root};

/// Each wheel, pinned. pyarrow 17 is the last that runs with Debian 12's
/// numpy (1.24): later ones ask for numpy 2. polars' runtime is a wheel of
/// its own.
const WHEELS: [(&str, &str); 3] = [
    ("pyarrow", "17.0.0"),
    ("polars", "2.1.0"),
    ("polars-runtime-32", "2.1.0"),
];

/// The variable that gives the tests the folder of wheels, and the folder.
pub fn download_all() -> Result<(&'static str, PathBuf)> {
    let dir = workspace_root().join("target/wheels");
    if WHEELS.iter().any(|wheel| !present(&dir, wheel)) {
        crate::setup::install_packages(&["python3-pip"])?;
        fs::create_dir_all(&dir)?;
        run_command(
            Command::new("/usr/bin/python3")
                .args(["-m", "pip", "download", "--quiet", "--no-deps"])
                .args(["--only-binary=:all:", "--python-version", "3.11"])
                .args(["--platform", "manylinux_2_28_x86_64"])
                .args(["--platform", "manylinux_2_17_x86_64", "-d"])
                .arg(&dir)
                .args(WHEELS.map(|(name, version)| format!("{name}=={version}"))),
        )?;
    }
    if let Some((name, version)) = WHEELS.iter().find(|wheel| !present(&dir, wheel)) {
        bail!("pip left no {name} {version} wheel in {}", dir.display());
    }
    Ok(("MEMPROBE_WHEELS", dir))
}

/// Whether `dir` holds the wheel of `name` at `version` (its file name
/// spells the name with underscores).
fn present(dir: &std::path::Path, (name, version): &(&str, &str)) -> bool {
    let prefix = format!("{}-{version}-", name.replace('-', "_"));
    fs::read_dir(dir).is_ok_and(|entries| {
        entries.flatten().any(|e| {
            let file = e.file_name().to_string_lossy().into_owned();
            file.starts_with(&prefix) && file.ends_with(".whl")
        })
    })
}
