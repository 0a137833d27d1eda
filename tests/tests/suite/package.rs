//! The .deb `cargo xtask dist` builds (`cargo xtask test` builds it before
//! the tests and names it in MEMPROBE_DEB), installed with dpkg on this
//! machine, used, and purged again.
use std::{path::PathBuf, process::Command};

use tests::*;

fn deb() -> PathBuf {
    let path = std::env::var_os("MEMPROBE_DEB").map(PathBuf::from);
    let path = path.unwrap_or_else(|| {
        let version = env!("CARGO_PKG_VERSION");
        workspace_root().join(format!("target/dist/memprobe_{version}_amd64.deb"))
    });
    assert!(
        path.exists(),
        "{} missing: run `cargo xtask test` (or `cargo xtask dist`)",
        path.display()
    );
    path
}

fn run(program: &str, args: &[&str]) -> (bool, String) {
    let out = Command::new(program)
        .args(args)
        .env("MANPAGER", "cat")
        .env("MANWIDTH", "80")
        .output()
        .unwrap_or_else(|e| panic!("{program}: {e}"));
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text)
}

/// Purges the package when the test ends, passed or not.
struct Installed;

impl Drop for Installed {
    fn drop(&mut self) {
        let _ = run("dpkg", &["--purge", "memprobe"]);
    }
}

#[test]
fn the_deb_installs_runs_and_reads_with_man() {
    let _guard = shared();
    let deb = deb();
    let (installed_before, _) = run("dpkg", &["-s", "memprobe"]);
    assert!(!installed_before, "memprobe is installed here already");
    // A container's dpkg may leave man pages out (path-exclude): not ours.
    let include = "--path-include=/usr/share/man/man1/memprobe.1.gz";
    let (ok, text) = run("dpkg", &["-i", include, deb.to_str().unwrap()]);
    let _installed = Installed;
    assert!(ok, "dpkg -i: {text}");
    let (ok, listed) = run("dpkg", &["-L", "memprobe"]);
    assert!(ok, "{listed}");
    for path in [
        "/usr/bin/memprobe",
        "/usr/share/man/man1/memprobe.1.gz",
        "/usr/share/bash-completion/completions/memprobe",
        "/usr/share/zsh/vendor-completions/_memprobe",
        "/usr/share/fish/vendor_completions.d/memprobe.fish",
        "/lib/systemd/system/memprobe.service",
    ] {
        assert!(listed.lines().any(|l| l == path), "{path} not in\n{listed}");
    }
    let (ok, version) = run("memprobe", &["--version"]);
    assert!(ok, "{version}");
    assert_eq!(
        version.trim(),
        format!("memprobe {}", env!("CARGO_PKG_VERSION"))
    );
    let (ok, page) = run("man", &["memprobe"]);
    assert!(ok, "{page}");
    for section in ["NAME", "SYNOPSIS", "OPTIONS", "COMMANDS", "EXAMPLES"] {
        assert!(page.contains(section), "no {section} in\n{page}");
    }
    assert!(page.contains("--max-overhead"), "{page}");
    assert!(
        page.contains("sudo memprobe --pid 1234 --duration 10m"),
        "{page}"
    );
    // Bash completes the flags from the installed script.
    let script = "source /usr/share/bash-completion/completions/memprobe; \
                  COMP_WORDS=(memprobe --max-ov); COMP_CWORD=1; \
                  _memprobe memprobe --max-ov memprobe; echo \"${COMPREPLY[@]}\"";
    let (ok, completed) = run("bash", &["-c", script]);
    assert!(ok && completed.contains("--max-overhead"), "{completed}");
    // The unit runs the binary the package installed.
    let unit = std::fs::read_to_string("/lib/systemd/system/memprobe.service").unwrap();
    assert!(unit.contains("ExecStart=/usr/bin/memprobe "), "{unit}");
}
