//! What memprobe does when the kernel refuses something: the feature named
//! in one line with the first Linux that has it, nothing left attached.
//! Older kernels themselves are booted by `cargo xtask test`'s kernels
//! suite (xtask/src/kernels), which checks the sessions fallback there.
use std::process::Command;

use tests::*;

/// bpf links and perf events memprobe holds open: one or two per probe.
fn probe_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .filter_map(|entry| std::fs::read_link(entry.ok()?.path()).ok())
        .filter(|target| {
            let target = target.to_string_lossy();
            target == "anon_inode:bpf_link" || target == "anon_inode:[perf_event]"
        })
        .count()
}

fn open_fds(pid: u32) -> u64 {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .count() as u64
}

/// Lowers `pid`'s soft limit of open files.
fn limit_open_files(pid: u32, soft: u64) {
    let mut old = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: reading our child's limits into a valid struct.
    assert_eq!(
        unsafe { libc::prlimit(pid as i32, libc::RLIMIT_NOFILE, std::ptr::null(), &mut old) },
        0
    );
    let new = libc::rlimit {
        rlim_cur: soft,
        rlim_max: old.rlim_max,
    };
    // SAFETY: setting our child's limits from a valid struct.
    assert_eq!(
        unsafe { libc::prlimit(pid as i32, libc::RLIMIT_NOFILE, &new, std::ptr::null_mut()) },
        0
    );
}

#[test]
fn missing_kernel_feature_is_one_line_with_the_first_linux_that_has_it() {
    let _guard = shared();
    let mut fixture = Fixture::start(&sites_fixture(), &[]);
    let pid = fixture.pid.to_string();
    for (lacks, needle) in [
        ("ring-buffer", "BPF ring buffers (Linux 5.8+)"),
        (
            "attach-cookie",
            "BPF attach cookies for uprobes (Linux 5.15+)",
        ),
    ] {
        let (status, stderr) = run_memprobe(
            &["--pid", &pid, "--duration", "1s"],
            &[("MEMPROBE_KERNEL_LACKS", lacks)],
        );
        assert!(!status.success(), "{stderr}");
        let lines: Vec<&str> = stderr.lines().collect();
        assert_eq!(lines.len(), 1, "{stderr}");
        assert!(
            lines[0].starts_with("memprobe: error: this kernel lacks "),
            "{stderr}"
        );
        assert!(lines[0].contains(needle), "{stderr}");
        assert!(!stderr.contains("attached"), "{stderr}");
    }
    fixture.run_workload();
}

/// A library loaded later whose attach fails half-way (here: memprobe runs
/// out of file descriptors, as a big `--all` run can) keeps none of its
/// probes; the run goes on and still writes its profile.
#[test]
fn attach_failing_half_way_detaches_the_copys_probes_and_the_run_goes_on() {
    let _guard = shared();
    let library = static_jemalloc_library();
    let out = output_dir("attach_half_way");
    let mut command = Command::new(dlopen_host_fixture());
    command
        .arg(&library)
        .env(STATIC_TLS_TUNABLE.0, STATIC_TLS_TUNABLE.1);
    let mut fixture = Fixture::start_command(command);
    // At entry: windows attach and detach malloc's links, which would
    // change the count of probe fds under the test.
    let args = ["--sample-interval", "4096", "--sampling", "entry"];
    let memprobe = Memprobe::attach(&fixture, &out, &args);
    let before = probe_fds(memprobe.pid());
    assert!(before > 0, "no probe fds found");
    // Room to find the library and attach a few of its probes, not all.
    limit_open_files(memprobe.pid(), open_fds(memprobe.pid()) + 8);
    fixture.send_and_expect("load", "loaded");
    memprobe.wait_for_stderr(
        "warning: attaching",
        std::time::Duration::from_secs(5),
        "no warning",
    );
    let stderr = memprobe.stderr_text();
    assert!(stderr.contains(&library.display().to_string()), "{stderr}");
    // Half-way: some of the copy's probes were in place, and went again.
    let detached: usize = stderr
        .split("(the ")
        .nth(1)
        .and_then(|rest| rest.split(' ').next()?.parse().ok())
        .unwrap_or_else(|| panic!("no count of detached probes:\n{stderr}"));
    assert!(detached > 0, "{stderr}");
    assert!(
        stderr.contains("attached before it were detached"),
        "{stderr}"
    );
    assert_eq!(probe_fds(memprobe.pid()), before, "{stderr}");
    fixture.run_workload();
    memprobe.stop();
    assert_eq!(heap_files(&out).len(), 1);
}
