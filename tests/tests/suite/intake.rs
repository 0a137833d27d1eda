//! The event intake never waits for a snapshot: naming frames (here a
//! JVM's, whose perf map memprobe asks `jcmd` for, slow on a loaded host)
//! and writing files happen off the loop that drains the ring buffer.
use std::{os::unix::fs::PermissionsExt, process::Command};

use tests::*;

#[test]
fn slow_snapshots_do_not_stall_the_event_intake() {
    let _guard = exclusive();
    let out = output_dir("intake");
    // A JVM to name: every snapshot of it asks HotSpot for a perf map.
    let mut jvm = java_command("HotAlloc");
    jvm.env("LD_PRELOAD", "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2");
    let jvm = Fixture::start_command(jvm);
    // A busy allocator next to it: about 10^6 calls a second.
    let mut busy = Command::new(malloc_loop_fixture())
        .args(["0", "20"])
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let (jvm_pid, busy_pid) = (jvm.pid.to_string(), busy.id().to_string());
    // A jcmd that takes 3 s to answer, first on memprobe's PATH.
    let slow = out.join("slow-jcmd");
    std::fs::create_dir_all(&slow).unwrap();
    let jcmd = slow.join("jcmd");
    std::fs::write(
        &jcmd,
        format!("#!/bin/sh\nsleep 3\nexec {JAVA_HOME}/bin/jcmd \"$@\"\n"),
    )
    .unwrap();
    std::fs::set_permissions(&jcmd, std::fs::Permissions::from_mode(0o755)).unwrap();
    let path = format!(
        "{}:{}",
        slow.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let mut command = Command::new(memprobe_bin());
    command
        .env("PATH", path)
        .stdin(std::process::Stdio::null())
        .args([
            "--pid",
            &jvm_pid,
            "--pid",
            &busy_pid,
            "--sample-interval",
            "4096",
            "--unwind",
            "fp",
            "--interval",
            "1s",
            "--duration",
            "8s",
            "--output",
            out.to_str().unwrap(),
        ]);
    let (status, stderr) = Memprobe::start_command(command).wait();
    let _ = busy.kill();
    let _ = busy.wait();
    drop(jvm);
    assert!(status.success(), "{stderr}");
    let jvm_snapshots = std::fs::read_dir(&out)
        .unwrap()
        .filter(|e| {
            let name = e.as_ref().unwrap().file_name();
            let name = name.to_string_lossy();
            name.starts_with(&format!("memprobe.{jvm_pid}.")) && name.ends_with(".folded")
        })
        .count();
    // Snapshots of the JVM were taken, each asking for its perf map.
    assert!(
        jvm_snapshots >= 2,
        "{jvm_snapshots} JVM snapshots:\n{stderr}"
    );
    // Periodic snapshots do not pile up behind a slow one: they are skipped,
    // and the summary counts them.
    assert!(
        stderr.contains("interval snapshots skipped while earlier ones were written"),
        "{stderr}"
    );
    assert!(
        !stderr.contains("kernel drops:"),
        "events lost while snapshots were written:\n{stderr}"
    );
}
