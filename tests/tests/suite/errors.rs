//! Bad input: one clear line on stderr, a non-zero exit, nothing attached.
use std::process::Command;

use tests::*;

fn assert_one_line_error(stderr: &str, status: std::process::ExitStatus, needles: &[&str]) {
    assert!(!status.success(), "exit status {status}: {stderr}");
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 1, "expected one line, got:\n{stderr}");
    assert!(lines[0].starts_with("memprobe: error: "), "{stderr}");
    for needle in needles {
        assert!(stderr.contains(needle), "{needle:?} not in {stderr:?}");
    }
    assert!(!stderr.contains("attached"));
}

#[test]
fn unknown_pid() {
    // A pid that just ended and was reaped.
    let mut child = Command::new("true").spawn().unwrap();
    let pid = child.id().to_string();
    child.wait().unwrap();
    let (status, stderr) = run_memprobe(&["--pid", &pid, "--duration", "1s"], &[]);
    assert_one_line_error(
        &stderr,
        status,
        &[&format!("no process with pid {pid}"), "ps"],
    );
}

#[test]
fn process_without_a_chosen_allocator() {
    let mut sleeper = Command::new("sleep").arg("30").spawn().unwrap();
    // Met as it starts: memprobe looks again until its loader has mapped
    // libc, and names it.
    let pid = sleeper.id().to_string();
    let (status, stderr) = run_memprobe(
        &["--pid", &pid, "--duration", "1s", "--allocator", "jemalloc"],
        &[],
    );
    let _ = sleeper.kill();
    let _ = sleeper.wait();
    assert_one_line_error(
        &stderr,
        status,
        &[
            "no allocator to probe",
            "libc.so.6",
            "--allocator jemalloc leaves out",
        ],
    );
}

#[test]
fn not_root() {
    // A copy everyone can run, wherever the checkout lives.
    let dir = std::env::temp_dir().join(format!("memprobe-notroot-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let copy = dir.join("memprobe");
    std::fs::copy(memprobe_bin(), &copy).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::set_permissions(&copy, std::fs::Permissions::from_mode(0o755)).unwrap();
    let out = Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
        .arg(&copy)
        .args(["--pid", "1", "--duration", "1s"])
        .output()
        .expect("running setpriv");
    let _ = std::fs::remove_dir_all(&dir);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_one_line_error(&stderr, out.status, &["needs root", "sudo"]);
}

/// A sysfs tree with or without the uprobe PMU and BTF.
fn fake_sysfs(name: &str, uprobes: bool, btf: bool) -> std::path::PathBuf {
    let dir = output_dir(name);
    if uprobes {
        let pmu = dir.join("bus/event_source/devices/uprobe");
        std::fs::create_dir_all(&pmu).unwrap();
        std::fs::write(pmu.join("type"), "9\n").unwrap();
    }
    if btf {
        std::fs::create_dir_all(dir.join("kernel/btf")).unwrap();
        std::fs::write(dir.join("kernel/btf/vmlinux"), "").unwrap();
    }
    dir
}

#[test]
fn kernel_without_uprobes() {
    let sysfs = fake_sysfs("sysfs_no_uprobes", false, true);
    let (status, stderr) = run_memprobe(
        &["--pid", "1", "--duration", "1s"],
        &[("MEMPROBE_SYSFS", sysfs.to_str().unwrap())],
    );
    assert_one_line_error(&stderr, status, &["no uprobe support", "CONFIG_UPROBES"]);
}

#[test]
fn kernel_without_btf() {
    let sysfs = fake_sysfs("sysfs_no_btf", true, false);
    let (status, stderr) = run_memprobe(
        &["--pid", "1", "--duration", "1s"],
        &[("MEMPROBE_SYSFS", sysfs.to_str().unwrap())],
    );
    assert_one_line_error(&stderr, status, &["no BTF", "CONFIG_DEBUG_INFO_BTF"]);
}

#[test]
fn bad_flags() {
    for (args, needle) in [
        (
            vec!["--pid", "1", "--sample-interval", "banana"],
            "not a size",
        ),
        (vec!["--pid", "1", "--duration", "soon"], "duration"),
        (vec!["--pid", "zero"], "invalid value"),
        (vec!["--pid", "1", "--frobnicate"], "--frobnicate"),
        (vec!["--duration", "1s"], "--pid"),
    ] {
        let (status, stderr) = run_memprobe(&args, &[]);
        assert_eq!(status.code(), Some(2), "{args:?}: {stderr}");
        assert_one_line_error(&stderr, status, &[needle, "memprobe --help"]);
    }
}

#[test]
fn help_has_examples() {
    let (status, _) = run_memprobe(&["--help"], &[]);
    assert!(status.success());
    let out = Command::new(memprobe_bin()).arg("--help").output().unwrap();
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(
        help.contains("sudo memprobe --pid 1234 --duration 10m"),
        "{help}"
    );
    assert!(help.contains("jeprof --text"));
}

/// The binary's `-h` is a screenful of what `--help` gives in full.
#[test]
fn short_help_is_a_screen_of_the_long_one() {
    let help = |flag: &str| {
        let out = Command::new(memprobe_bin()).arg(flag).output().unwrap();
        assert!(out.status.success(), "{flag}");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let (short, long) = (help("-h"), help("--help"));
    assert!(short.lines().count() <= 40, "{short}");
    assert!(long.lines().count() > 3 * short.lines().count(), "{long}");
    assert!(short.contains("see more with '--help'"), "{short}");
    assert!(long.contains("Expert options:"), "{long}");
    for flag in ["--pid", "--duration", "--max-overhead", "--listen"] {
        assert!(short.contains(flag) && long.contains(flag), "{flag}");
    }
    assert!(!short.contains("--unwind") && long.contains("--unwind"));
}

#[test]
fn offline_commands_reject_bad_input_in_one_line() {
    let dir = output_dir("offline_errors");
    let garbage = dir.join("garbage.heap");
    std::fs::write(&garbage, "heap_v2/4096\n@ 0xnothex\n").unwrap();
    let g = garbage.to_str().unwrap();
    for (args, needle) in [
        (vec!["diff", g, g], "line 2: bad address"),
        (
            vec!["diff", "/nonexistent.heap", g],
            "cannot read /nonexistent.heap",
        ),
        (
            vec!["leaks", dir.to_str().unwrap()],
            "no memprobe.<pid>.<seq>.heap files",
        ),
    ] {
        let (status, stderr) = run_memprobe(&args, &[]);
        assert_one_line_error(&stderr, status, &[needle]);
    }
}

#[test]
fn launching_a_command_that_does_not_exist() {
    let (status, stderr) = run_memprobe(&["--", "memprobe-no-such-command"], &[]);
    assert_one_line_error(
        &stderr,
        status,
        &[
            "cannot launch memprobe-no-such-command",
            "not found in PATH",
        ],
    );
}

#[test]
fn listening_where_it_cannot_bind() {
    let _guard = shared();
    let fixture = Fixture::start(&sites_fixture(), &[]);
    let pid = fixture.pid.to_string();
    // An address of no interface here: nothing is attached.
    let (status, stderr) = run_memprobe(
        &[
            "--pid",
            &pid,
            "--duration",
            "1s",
            "--listen",
            "192.0.2.1:6060",
            "--listen-insecure",
        ],
        &[],
    );
    assert_one_line_error(
        &stderr,
        status,
        &["cannot listen on 192.0.2.1:6060", "127.0.0.1"],
    );
}
