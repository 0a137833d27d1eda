//! The memory account (#33): a process's resident memory split into the
//! heap in use, allocator footprint, direct mappings by site, thread
//! stacks, a JVM's own, file-backed, shared and unexplained memory, adding
//! up to what the kernel says is resident.
use std::{collections::HashMap, path::Path, process::Command, time::Duration};

use tests::*;

/// The `# memory:` parts of a `.heap` (bytes), and its `# memory_site:`
/// lines.
fn account(heap: &Path) -> (HashMap<String, f64>, Vec<String>) {
    let text = std::fs::read_to_string(heap).unwrap();
    let mut parts = HashMap::new();
    let mut sites = Vec::new();
    for line in text.lines().take_while(|l| !l.starts_with('@')) {
        if let Some(site) = line.strip_prefix("# memory_site: ") {
            sites.push(site.to_owned());
        } else if let Some(part) = line.strip_prefix("# memory: ") {
            let (name, value) = part.split_once(": ").unwrap();
            let bytes = value.split(' ').next().unwrap().parse::<f64>().unwrap();
            parts.insert(name.to_owned(), bytes);
        }
    }
    (parts, sites)
}

/// `VmRSS` of `pid`, in bytes.
fn resident(pid: u32) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    let kib: f64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    kib * 1024.0
}

/// What a snapshot taken while a launched fixture lived said of its
/// memory.
struct Accounted {
    /// The `.heap`'s `# memory:` parts.
    parts: HashMap<String, f64>,
    /// Its `# memory_site:` lines.
    sites: Vec<String>,
    /// The process's own `VmRSS`, read right after the snapshot.
    rss: f64,
    stderr: String,
    /// The snapshot's files but the extension: `OUT/memprobe.PID.0`.
    files: std::path::PathBuf,
}

/// Launches the memory fixture in `mode` under memprobe, lets it do its
/// work, and has a snapshot taken while it lives (SIGUSR1).
fn account_of(mode: &str, test: &str, formats: &str) -> Accounted {
    let mut fixture = Command::new(memory_account_fixture());
    fixture.env("FIXTURE_MODE", mode);
    account_of_command(&fixture, test, formats)
}

/// As [`account_of`], for any fixture `command`.
fn account_of_command(command: &Command, test: &str, formats: &str) -> Accounted {
    let out = output_dir(test);
    let args = [
        "--format",
        formats,
        "--sample-interval",
        "64KiB",
        "-o",
        out.to_str().unwrap(),
    ];
    let (memprobe, mut launched) = Memprobe::launch_command(&args, command);
    let ready = launched.read_line();
    let pid: u32 = ready.strip_prefix("ready ").unwrap().parse().unwrap();
    assert_eq!(launched.send("go"), "done");
    memprobe.signal(libc::SIGUSR1);
    let first = out.join(format!("memprobe.{pid}.0.heap"));
    let started = std::time::Instant::now();
    while !first.exists() && started.elapsed() < Duration::from_secs(30) {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(
        first.exists(),
        "no snapshot on SIGUSR1:\n{}",
        memprobe.stderr_text()
    );
    let rss = resident(pid);
    launched.close();
    let (status, stderr) = memprobe.wait();
    assert!(status.success(), "{stderr}");
    let (parts, sites) = account(&first);
    Accounted {
        parts,
        sites,
        rss,
        stderr,
        files: out.join(format!("memprobe.{pid}.0")),
    }
}

fn assert_adds_up(parts: &HashMap<String, f64>, rss: f64, stderr: &str) {
    assert_adds_up_to(parts, rss);
    assert!(
        parts["unexplained"] < 0.05 * parts["resident"],
        "launched, every mapping was seen: {parts:?}\n{stderr}"
    );
}

/// The parts add up to the total, which is the process's `VmRSS` within
/// 5%.
fn assert_adds_up_to(parts: &HashMap<String, f64>, rss: f64) {
    let total = parts["resident"];
    let sum: f64 = parts
        .iter()
        .filter(|(name, _)| *name != "resident")
        .map(|(_, bytes)| bytes)
        .sum();
    assert_eq!(sum, total, "the parts add up to the total: {parts:?}");
    assert_within(
        "the account's resident total against VmRSS",
        total,
        rss,
        0.05,
    );
}

#[test]
fn a_buffer_pool_over_its_own_mapping_is_named_with_its_resident_bytes() {
    let _guard = shared();
    let all = "heap,pb.gz,folded,svg";
    let Accounted {
        parts,
        sites,
        rss,
        stderr,
        files,
    } = account_of("pool", "memory_pool", all);
    assert_adds_up(&parts, rss, &stderr);
    let pool = sites
        .iter()
        .find(|s| s.starts_with("pool_reserve: "))
        .unwrap_or_else(|| panic!("no pool_reserve site: {sites:?}\n{stderr}"));
    let resident: f64 = pool["pool_reserve: ".len()..]
        .split(' ')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert_within("the pool's resident bytes", resident, 64.0 * MIB, 0.05);
    assert!(
        pool.contains(&format!("of {} mapped", 1u64 << 30)),
        "{pool}"
    );
    // 16 MiB of glibc chunks and 8 MiB of jemalloc's: the heap, not sites.
    assert_within("the heap in use", parts["heap in use"], 24.0 * MIB, 0.25);
    assert!(
        parts["direct mappings"] < 66.0 * MIB,
        "glibc's and jemalloc's mappings are theirs: {parts:?}"
    );
    assert!(parts["thread stacks"] > 0.0, "{parts:?}");
    assert!(
        stderr.contains("memory:   direct mapping by pool_reserve"),
        "{stderr}"
    );
    // The mappings' profiles: pprof by owner, folded stacks, a flame graph.
    let pprof = files.with_extension("0.mappings.pb.gz");
    let resident = pprof_top(&pprof, "resident_space", &["-tagfocus=owner=direct"]);
    let in_pprof = pprof_flat(&resident, "pool_reserve");
    assert_within("pool_reserve's resident_space", in_pprof, 64.0 * MIB, 0.05);
    let mapped = pprof_top(&pprof, "mapped_space", &[]);
    let mapped = pprof_flat(&mapped, "pool_reserve");
    assert_within("its mapped_space", mapped, 1024.0 * MIB, 0.01);
    let folded = std::fs::read_to_string(files.with_extension("0.mappings.folded")).unwrap();
    assert!(
        folded
            .lines()
            .any(|l| l.starts_with("[direct];") && l.contains(";pool_reserve ")),
        "{folded}"
    );
    assert!(
        folded.lines().any(|l| l.starts_with("[glibc];")),
        "{folded}"
    );
    let svg = std::fs::read_to_string(files.with_extension("0.mappings.svg")).unwrap();
    assert!(svg.contains("pool_reserve"), "the flame graph names it");
    // jeprof reads the .heap as ever: the account is in comments it skips.
    let heap = files.with_extension("0.heap");
    let jeprof = jeprof_text(&memory_account_fixture(), &heap, "--inuse_space");
    let pool_mode = jeprof.get("pool_mode").copied().unwrap_or(0.0);
    assert_within("jeprof: pool_mode's MB in use", pool_mode, 24.0, 0.25);
    // memprobe report: the account under the sites, a pmap-like table.
    let (status, report) = memprobe_stdout(&["report", heap.to_str().unwrap()]);
    assert!(status.success(), "{report}");
    let row = report
        .lines()
        .find(|l| l.contains("pool_reserve < "))
        .unwrap_or_else(|| panic!("{report}"));
    let numbers: Vec<f64> = row
        .split_whitespace()
        .take(3)
        .map(|n| n.parse().unwrap())
        .collect();
    assert_within("report: the pool's resident MB", numbers[0], 64.0, 0.05);
    assert_eq!(numbers[1..], [1024.0, 1.0], "{row}");
    assert!(
        report.contains("% heap in use") || report.contains("%  heap in use"),
        "{report}"
    );
}

#[test]
fn fragmentation_shows_as_allocator_footprint_not_heap() {
    let _guard = shared();
    let Accounted {
        parts, rss, stderr, ..
    } = account_of("fragment", "memory_fragment", "heap");
    assert_adds_up(&parts, rss, &stderr);
    // 131072 objects of 256 B left of twice as many.
    let in_use = 32.0 * MIB;
    assert_within("the heap in use", parts["heap in use"], in_use, 0.15);
    assert!(
        parts["allocator footprint"] > 0.8 * in_use,
        "the freed half stays jemalloc's: {parts:?}\n{stderr}"
    );
    assert!(parts["direct mappings"] < MIB, "{parts:?}");
    assert!(
        parts["static data"] >= 2.0 * MIB,
        "its 2 MiB array of pointers: {parts:?}"
    );
}

#[test]
fn a_jvms_heap_is_named_as_the_jvms() {
    let _guard = shared();
    let java = java_command_with("DirectBuffers", &["-Xms64m", "-XX:+AlwaysPreTouch"]);
    let Accounted {
        parts, rss, stderr, ..
    } = account_of_command(&java, "memory_jvm", "heap");
    assert_adds_up(&parts, rss, &stderr);
    // Its 64 MiB heap, touched at start, and its code cache and metaspace.
    assert!(parts["JVM"] >= 64.0 * MIB, "{parts:?}\n{stderr}");
    // 64 direct buffers of 1 MiB, through glibc's malloc.
    assert_within("the heap in use", parts["heap in use"], 64.0 * MIB, 0.25);
    assert!(parts["thread stacks"] > 0.0, "{parts:?}");
}

#[test]
fn a_real_prometheus_scrapes_the_memory_account_by_part() {
    let _guard = shared();
    let out = output_dir("memory_metrics");
    let args = ["--listen", "127.0.0.1:0", "-o", out.to_str().unwrap()];
    let mut fixture = Command::new(memory_account_fixture());
    fixture.env("FIXTURE_MODE", "pool");
    let (memprobe, mut launched) = Memprobe::launch_command(&args, &fixture);
    let pid: u32 = launched.read_line()["ready ".len()..].parse().unwrap();
    let address = memprobe.listening_on();
    assert_eq!(launched.send("go"), "done");
    let direct = format!("memprobe_memory_bytes{{pid=\"{pid}\",part=\"direct mappings\"}}");
    // The account is read every few seconds: wait for one after the work.
    let started = std::time::Instant::now();
    let series = format!(
        "memprobe_memory_bytes{{pid=\"{pid}\",comm=\"memory_account\",part=\"direct mappings\"}} "
    );
    let served = |metrics: &str| -> Option<f64> {
        let line = metrics.lines().find(|l| l.starts_with(&series))?;
        line.rsplit(' ').next()?.parse().ok()
    };
    while served(&http_get(&address, "/metrics").1).is_none_or(|b| b < 32.0 * MIB) {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "{}",
            memprobe.stderr_text()
        );
        std::thread::sleep(Duration::from_millis(250));
    }
    let scraped = scraped_series(&out, &address, &direct, "");
    assert_within(
        "the pool's direct mappings, scraped",
        scraped,
        64.0 * MIB,
        0.1,
    );
    let (status, metrics) = http_get(&address, "/metrics");
    assert_eq!(status, 200);
    let total = format!("memprobe_resident_bytes{{pid=\"{pid}\",comm=\"memory_account\"}} ");
    let resident: f64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix(&total)?.parse().ok())
        .unwrap_or_else(|| panic!("{metrics}"));
    let parts: f64 = metrics
        .lines()
        .filter(|l| l.starts_with("memprobe_memory_bytes{") && l.contains(&format!("\"{pid}\"")))
        .map(|l| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap())
        .sum();
    assert_eq!(parts, resident, "the parts add up: {metrics}");
    launched.close();
    let (status, stderr) = memprobe.wait();
    assert!(status.success(), "{stderr}");
}

#[test]
fn resident_growth_under_a_flat_heap_triggers_a_snapshot_and_is_ranked() {
    let _guard = shared();
    let out = output_dir("memory_growth");
    let args = [
        "--format",
        "heap",
        "--interval",
        "500ms",
        "--dump-on-growth",
        "rss:32MiB/10s",
        "--min-dump-gap",
        "1s",
        "-o",
        out.to_str().unwrap(),
    ];
    let mut fixture = Command::new(memory_account_fixture());
    fixture.env("FIXTURE_MODE", "grow");
    let (memprobe, mut launched) = Memprobe::launch_command(&args, &fixture);
    let pid: u32 = launched.read_line()["ready ".len()..].parse().unwrap();
    assert_eq!(launched.send("go"), "done");
    std::thread::sleep(Duration::from_millis(1500));
    launched.close();
    let (status, stderr) = memprobe.wait();
    assert!(status.success(), "{stderr}");
    assert!(
        stderr.contains(&format!("pid {pid}: resident growth: +")),
        "{stderr}"
    );
    let (status, leaks) = memprobe_stdout(&["leaks", out.to_str().unwrap()]);
    assert!(status.success(), "{leaks}");
    assert!(
        leaks.contains("finding: the heap stays flat while resident memory climbs"),
        "{leaks}"
    );
    assert!(leaks.contains("most of it direct mappings"), "{leaks}");
    let site = leaks
        .lines()
        .skip_while(|l| !l.contains("direct mapping site"))
        .nth(1)
        .unwrap_or_else(|| panic!("{leaks}"));
    assert!(site.contains("pool_reserve"), "{leaks}");
    assert!(site.trim_start().starts_with('+'), "{site}");
}

#[test]
fn attached_later_what_was_mapped_before_is_said_and_threads_stacks_found() {
    let _guard = shared();
    let out = output_dir("memory_attached");
    let mut fixture = Fixture::start(&memory_account_fixture(), &[("FIXTURE_MODE", "pool")]);
    fixture.run_workload();
    let memprobe = Memprobe::attach(&fixture, &out, &["--format", "heap"]);
    let pid = fixture.pid;
    // Read at least once after the attach before the snapshot.
    std::thread::sleep(Duration::from_millis(1500));
    memprobe.signal(libc::SIGUSR1);
    let first = out.join(format!("memprobe.{pid}.0.heap"));
    let started = std::time::Instant::now();
    while !first.exists() && started.elapsed() < Duration::from_secs(30) {
        std::thread::sleep(Duration::from_millis(50));
    }
    let rss = resident(pid);
    let stderr = memprobe.stop();
    let (parts, _) = account(&first);
    assert_adds_up_to(&parts, rss);
    // The pool and glibc's chunks were mapped before memprobe came.
    assert!(
        parts["mapped before attach"] >= 60.0 * MIB,
        "{parts:?}\n{stderr}"
    );
    // Four idle threads, each blocked in pause(): their stacks are found
    // by where they stand.
    assert!(parts["thread stacks"] >= 4.0 * 4096.0, "{parts:?}");
}
