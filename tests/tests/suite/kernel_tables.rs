//! The kernel's bounded tables (BPF maps) that memprobe fills per process
//! and per thread are emptied of a process once it exits: an agent meets
//! thousands of processes over its life, and a table filled by the gone
//! ones would refuse the new.
use tests::*;

/// The pids in memprobe's BPF map `name` keyed by pid first (FAST_PATHS,
/// its table of jemalloc copies' counters; EXIT_COUNTERS, of the threads'
/// counters read at `_exit`): the first four bytes of each key.
fn pids_in_map(memprobe: u32, name: &str) -> Vec<u32> {
    keys_in_map(memprobe, name)
        .into_iter()
        .map(|key| key as u32)
        .collect()
}

/// The keys of memprobe's BPF map `name`, read with bpftool: their first
/// eight bytes or fewer, as a little-endian number.
fn keys_in_map(memprobe: u32, name: &str) -> Vec<u64> {
    let map_ids: Vec<String> = std::fs::read_dir(format!("/proc/{memprobe}/fdinfo"))
        .unwrap()
        .filter_map(|entry| std::fs::read_to_string(entry.ok()?.path()).ok())
        .filter_map(|info| {
            let line = info.lines().find(|l| l.starts_with("map_id:"))?;
            Some(line.split_whitespace().nth(1)?.to_owned())
        })
        .collect();
    let bpftool = |args: &[&str]| {
        let out = std::process::Command::new("bpftool")
            .args(args)
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let id = map_ids
        .iter()
        .find(|id| bpftool(&["map", "show", "id", id]).contains(&format!("name {name} ")))
        .expect("memprobe's map");
    let dump = bpftool(&["-j", "map", "dump", "id", id]);
    dump.split("\"key\":[")
        .skip(1)
        .map(|rest| {
            let bytes: Vec<u8> = rest
                .split(']')
                .next()
                .unwrap()
                .split(',')
                .take(8)
                .map(|b| {
                    u8::from_str_radix(b.trim().trim_matches('"').trim_start_matches("0x"), 16)
                        .unwrap()
                })
                .collect();
            bytes
                .iter()
                .rev()
                .fold(0, |key, &b| key << 8 | u64::from(b))
        })
        .collect()
}

/// An agent meets thousands of processes over its life: one that exits
/// leaves nothing in the kernel's bounded table of jemalloc copies (4,096
/// entries, after which windows would be refused) or in its list of the
/// threads' counters read at `_exit` (1,024) or in the table of threads'
/// ends (16,384), while one still running keeps its entry.
#[test]
fn a_process_that_exits_leaves_no_entry_in_the_kernel_tables() {
    let _guard = exclusive();
    let out = output_dir("windows_forget_exited");
    let mut memprobe = Memprobe::start(&[
        "--all",
        "--allocator",
        "jemalloc",
        "--track",
        "allocations",
        "--format",
        "heap",
        "-o",
        out.to_str().unwrap(),
    ]);
    memprobe.wait_attached();
    let env = [("FIXTURE_SECONDS", "3")];
    let mut staying = Fixture::start(&aliasing_fixture(), &env);
    let mut leaving = Fixture::start(&aliasing_fixture(), &env);
    // Found by the next scan, and probed in windows.
    std::thread::sleep(std::time::Duration::from_secs(3));
    let pids = pids_in_map(memprobe.pid(), "FAST_PATHS");
    assert!(
        pids.contains(&staying.pid) && pids.contains(&leaving.pid),
        "{pids:?}"
    );
    leaving.run_workload();
    let leaving_pid = leaving.pid;
    // Listed once a window of its busy stretch closed.
    let started = std::time::Instant::now();
    while !pids_in_map(memprobe.pid(), "EXIT_COUNTERS").contains(&leaving_pid) {
        assert!(
            started.elapsed() < std::time::Duration::from_secs(15),
            "its threads' counters never listed:\n{}",
            memprobe.stderr_text()
        );
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    assert!(leaving.finish().success());
    memprobe.wait_for_stderr(
        &format!("process {leaving_pid} exited"),
        std::time::Duration::from_secs(10),
        "its exit not seen",
    );
    let pids = pids_in_map(memprobe.pid(), "FAST_PATHS");
    assert!(!pids.contains(&leaving_pid), "{pids:?}");
    assert!(pids.contains(&staying.pid), "{pids:?}");
    let listed = pids_in_map(memprobe.pid(), "EXIT_COUNTERS");
    assert!(!listed.contains(&leaving_pid), "{listed:?}");
    // Its threads' ends, noted as it exited, were taken before it was
    // let go: none is left to fill the table (16,384 entries).
    let ended = keys_in_map(memprobe.pid(), "THREAD_EXITS");
    assert!(
        ended.iter().all(|id| (id >> 32) as u32 != leaving_pid),
        "{ended:x?}"
    );
    staying.run_workload();
    memprobe.stop();
    assert!(staying.finish().success());
}
