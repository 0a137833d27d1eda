//! `--listen`: the pprof endpoint read by `go tool pprof` over HTTP, the
//! index, metrics checked by promtool and scraped by a real Prometheus,
//! one-line 4xx for bad queries, and `--keep` bounding the disk.
use std::{
    io::Write,
    path::Path,
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use tests::*;

/// memprobe on the sites fixture, serving on a free loopback port.
fn serving(out: &Path, extra: &[&str]) -> (Fixture, Memprobe, String) {
    let fixture = Fixture::start(&sites_fixture(), &[]);
    let mut args = vec!["--sample-interval", "4096", "--listen", "127.0.0.1:0"];
    args.extend_from_slice(extra);
    let memprobe = Memprobe::attach(&fixture, out, &args);
    let address = memprobe.listening_on();
    (fixture, memprobe, address)
}

#[test]
fn go_tool_pprof_reads_the_heap_endpoint_and_its_delta() {
    let _guard = shared();
    let out = output_dir("endpoint_pprof");
    let (mut fixture, memprobe, address) = serving(&out, &[]);
    // A 3 s delta taken across the workload holds its allocations.
    let delta_url = format!("http://{address}/debug/pprof/heap?seconds=3");
    let saved = out.clone();
    let delta = std::thread::spawn(move || pprof_url_top(&delta_url, "inuse_space", &saved));
    std::thread::sleep(Duration::from_millis(500));
    fixture.run_workload();
    let delta = delta.join().unwrap();
    assert_within(
        "delta keep_1m",
        pprof_flat(&delta, "keep_1m"),
        16.0 * MIB,
        0.1,
    );
    // The whole profile, with the pid given and left out (one process).
    for url in [
        format!("http://{address}/debug/pprof/heap"),
        format!("http://{address}/debug/pprof/heap?pid={}", fixture.pid),
    ] {
        let top = pprof_url_top(&url, "inuse_space", &out);
        // The kept sites, in order, with the fixture's numbers.
        let at = |site: &str| top.find(&format!(" {site}\n")).unwrap_or(usize::MAX);
        assert!(
            at("keep_1m") < at("keep_4k") && at("keep_4k") < usize::MAX,
            "{top}"
        );
        assert_within("keep_1m", pprof_flat(&top, "keep_1m"), 16.0 * MIB, 0.1);
        assert_within("keep_4k", pprof_flat(&top, "keep_4k"), 2000.0 * 4096.0, 0.1);
        let objects = pprof_url_top(&url, "inuse_objects", &out);
        assert_within(
            "keep_1m objects",
            pprof_flat(&objects, "keep_1m"),
            16.0,
            0.1,
        );
    }
    // A window in which nothing was allocated shows nothing that grew.
    let quiet = pprof_url_top(
        &format!("http://{address}/debug/pprof/heap?seconds=1"),
        "inuse_space",
        &out,
    );
    assert!(
        !quiet.contains("keep_1m") && !quiet.contains("keep_4k"),
        "{quiet}"
    );
    memprobe.stop();
}

/// The host agent's setup, `--track allocations` (no free probed), asked
/// for a delta: the process's frees are followed for its span, so its in
/// use is what stayed live (the trends fixture: its leak, the working set
/// it replaced, none of the burst it freed, which allocations alone would
/// count 16 MiB), then no longer, and the profile says when they were.
#[test]
fn a_delta_follows_frees_for_its_span_under_track_allocations() {
    let _guard = shared();
    let out = output_dir("endpoint_frees_on_request");
    let mut fixture = Fixture::start(&trends_fixture(), &[]);
    let flags = [
        "--track",
        "allocations",
        "--sample-interval",
        "16384",
        "--listen",
        "127.0.0.1:0",
        "--format",
        "heap",
    ];
    let memprobe = Memprobe::attach(&fixture, &out, &flags);
    let address = memprobe.listening_on();
    let url = format!("http://{address}/debug/pprof/heap?seconds=9");
    let saved = out.clone();
    let delta = std::thread::spawn(move || pprof_url_top(&url, "inuse_space", &saved));
    let within = Duration::from_secs(10);
    memprobe.wait_for_stderr("frees followed for 11 s", within, "no frees followed");
    fixture.run_workload();
    let delta = delta.join().unwrap();
    let flat = |site: &str| {
        let listed = (delta.lines()).any(|l| l.split_whitespace().nth(5) == Some(site));
        if listed {
            pprof_flat(&delta, site)
        } else {
            0.0
        }
    };
    // 60 blocks of 256 KiB kept; 128 of 64 KiB live at the end, each
    // replaced within the span; 16 MiB allocated and freed.
    assert_within("leak_steadily", flat("leak_steadily"), 15.0 * MIB, 0.1);
    assert_within("working_set", flat("working_set"), 8.0 * MIB, 0.15);
    assert!(flat("burst") < 0.5 * MIB, "{delta}");
    memprobe.wait_for_stderr("frees no longer followed", within, "frees still followed");
    let stderr = memprobe.stop();
    assert!(fixture.finish().success());
    let heap = &heap_files(&out)[0];
    let tracking = heap_notes(heap).remove("tracking").unwrap_or_default();
    assert!(
        tracking.contains("but for what was freed while frees were followed on request"),
        "{tracking}\n{stderr}"
    );
}

/// The same span asked by resident growth (`--dump-on-growth rss:`, the
/// trends fixture writing its blocks whole): its frees are followed for
/// `--follow-on-growth`, then the delta over that span is written as a
/// snapshot: the working set it replaced in that time, its leak at its
/// rate over the span, none of the burst (allocated before the span or
/// inside it, and freed inside it).
#[test]
fn resident_growth_follows_frees_and_writes_what_grew() {
    let _guard = shared();
    let out = output_dir("growth_follows_frees");
    let mut fixture = Fixture::start(&trends_fixture(), &[("FIXTURE_TOUCH", "1")]);
    let flags = [
        "--track",
        "allocations",
        "--sample-interval",
        "16384",
        "--dump-on-growth",
        "rss:4MiB/1m",
        "--follow-on-growth",
        "4s",
        "--format",
        "heap",
    ];
    let memprobe = Memprobe::attach(&fixture, &out, &flags);
    let pid = fixture.pid;
    fixture.run_workload();
    let within = Duration::from_secs(10);
    memprobe.wait_for_stderr("frees no longer followed", within, "frees still followed");
    let stderr = memprobe.stop();
    assert!(fixture.finish().success());
    let followed = format!("pid {pid}: frees followed for 4 s, after its resident");
    assert!(stderr.contains(&followed), "{stderr}");
    let delta = heap_files(&out)
        .into_iter()
        .find(|h| {
            let reason = heap_notes(h).remove("reason").unwrap_or_default();
            reason.starts_with("allocated in the") && reason.contains("after resident growth")
        })
        .unwrap_or_else(|| panic!("no delta written: {stderr}"));
    let seconds: f64 = heap_notes(&delta)
        .remove("delta_seconds")
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no span: {stderr}"));
    let inuse = jeprof_rows(&trends_fixture(), &delta, "--inuse_space");
    let flat = |site: &str| {
        inuse
            .iter()
            .find(|r| r.name == site)
            .map_or(0.0, |r| r.flat * MIB)
    };
    // 16 of 128 blocks of 64 KiB replaced every 100 ms: all live ones.
    assert_within("working_set", flat("working_set"), 8.0 * MIB, 0.15);
    // 256 KiB every 100 ms, over a span of whole seconds give or take one.
    let leak = flat("leak_steadily");
    let rate = 2.5 * MIB;
    assert!(
        leak > rate * (seconds - 1.5) && leak < rate * (seconds + 1.5),
        "leak {leak} over {seconds} s\n{stderr}"
    );
    assert!(flat("burst") < 0.5 * MIB, "burst {}", flat("burst"));
}

/// Scrapers hammering the endpoints while a busy process allocates a
/// million times a second: the event intake loses nothing.
#[test]
fn concurrent_requests_during_a_busy_run_drop_no_events() {
    let _guard = exclusive();
    let out = output_dir("endpoint_busy");
    let mut busy = Command::new(malloc_loop_fixture())
        .args(["0", "30"])
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let pid = busy.id().to_string();
    let memprobe = Memprobe::start(&[
        "--pid",
        &pid,
        "--sample-interval",
        "4096",
        "--unwind",
        "fp",
        "--listen",
        "127.0.0.1:0",
        "--duration",
        "8s",
        "--output",
        out.to_str().unwrap(),
    ]);
    let address = memprobe.listening_on();
    let scrapers: Vec<_> = (0..6)
        .map(|i| {
            let address = address.clone();
            std::thread::spawn(move || {
                let paths = ["/debug/pprof/heap", "/metrics", "/debug/pprof/?format=json"];
                let (mut served, mut refused) = (0, 0);
                let started = Instant::now();
                while started.elapsed() < Duration::from_secs(6) {
                    match http_get(&address, paths[i % paths.len()]).0 {
                        200 => served += 1,
                        503 => refused += 1,
                        other => panic!("status {other}"),
                    }
                }
                (served, refused)
            })
        })
        .collect();
    let served: u32 = scrapers.into_iter().map(|s| s.join().unwrap().0).sum();
    let (status, stderr) = memprobe.wait();
    let _ = busy.kill();
    let _ = busy.wait();
    assert!(status.success(), "{stderr}");
    assert!(served > 20, "{served} requests served");
    assert!(!stderr.contains("kernel drops:"), "{stderr}");
    assert!(stderr.contains(" 0 dropped"), "{stderr}");
}

/// `go tool pprof -top` of a profile fetched over HTTP; pprof keeps its copy
/// of what it fetched in `saved_in`, the test's own directory.
fn pprof_url_top(url: &str, sample_type: &str, saved_in: &Path) -> String {
    let out = Command::new("go")
        .args(["tool", "pprof", "-top"])
        .arg(format!("-sample_index={sample_type}"))
        .arg(url)
        .env("PPROF_TMPDIR", saved_in)
        .output()
        .expect("running go tool pprof");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{url}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    text
}

#[test]
fn index_lists_the_processes_and_bad_queries_get_one_line_4xx() {
    let _guard = shared();
    let out = output_dir("endpoint_index");
    let (mut fixture, memprobe, address) = serving(&out, &[]);
    fixture.run_workload();
    let pid = fixture.pid;
    let (status, json) = http_get(&address, "/debug/pprof/?format=json");
    assert_eq!(status, 200, "{json}");
    assert!(json.contains(&format!("\"pid\":{pid}")), "{json}");
    assert!(json.contains("\"command\":\"sites\""), "{json}");
    assert!(json.contains("libjemalloc.so.2"), "{json}");
    let (status, html) = http_get(&address, "/debug/pprof/");
    assert_eq!(status, 200);
    assert!(html.contains(&format!("heap?pid={pid}")), "{html}");
    for (path, expected) in [
        ("/debug/pprof/heap?pid=abc", 400),
        ("/debug/pprof/heap?pid=999999999", 404),
        ("/debug/pprof/heap?seconds=0", 400),
        ("/debug/pprof/heap?seconds=soon", 400),
        ("/debug/pprof/heap?what=1", 400),
        ("/debug/pprof/?format=xml", 400),
        ("/nowhere", 404),
    ] {
        let (status, body) = http_get(&address, path);
        assert_eq!(status, expected, "{path}: {body}");
        assert_eq!(body.trim_end().lines().count(), 1, "{path}: {body}");
    }
    memprobe.stop();
}

#[test]
fn metrics_pass_promtool_and_a_real_prometheus_scrapes_them() {
    let _guard = shared();
    let out = output_dir("endpoint_metrics");
    let (mut fixture, memprobe, address) = serving(&out, &[]);
    fixture.run_workload();
    // Published once a tick.
    std::thread::sleep(Duration::from_millis(1500));
    let (status, metrics) = http_get(&address, "/metrics");
    assert_eq!(status, 200);
    let pid = fixture.pid;
    let inuse = metrics
        .lines()
        .find_map(|l| {
            l.strip_prefix(&format!(
                "memprobe_inuse_bytes{{pid=\"{pid}\",comm=\"sites\"}} "
            ))
        })
        .unwrap_or_else(|| panic!("{metrics}"));
    let expected = 2000.0 * 4096.0 + 16.0 * MIB;
    assert_within(
        "memprobe_inuse_bytes",
        inuse.parse().unwrap(),
        expected,
        0.1,
    );
    // What a hit costs here, as measured at start: under a microsecond or
    // so for an emulated probe, ten for a single-stepped one.
    let cost = |kind: &str| -> f64 {
        let series = format!("memprobe_probe_hit_cost_seconds{{kind=\"{kind}\"}} ");
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(&series)?.parse().ok())
            .unwrap_or_else(|| panic!("no {series} in {metrics}"))
    };
    assert!((1e-8..1e-5).contains(&cost("emulated")), "{metrics}");
    assert!(cost("single_stepped") > cost("emulated"), "{metrics}");
    let mut promtool = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("running promtool");
    promtool
        .stdin
        .take()
        .unwrap()
        .write_all(metrics.as_bytes())
        .unwrap();
    let checked = promtool.wait_with_output().unwrap();
    assert!(
        checked.status.success(),
        "{}{}",
        String::from_utf8_lossy(&checked.stdout),
        String::from_utf8_lossy(&checked.stderr)
    );
    let value = scraped_by_prometheus(&out, &address, pid, "");
    assert_within("scraped memprobe_inuse_bytes", value, expected, 0.1);
    memprobe.stop();
}

#[test]
fn keep_bounds_the_snapshots_on_disk() {
    let _guard = shared();
    let out = output_dir("keep");
    let mut fixture = Fixture::start(&sites_fixture(), &[]);
    let memprobe = Memprobe::attach(&fixture, &out, &["--interval", "1s", "--keep", "2"]);
    fixture.run_workload();
    std::thread::sleep(Duration::from_millis(4500));
    let stderr = memprobe.stop();
    let heaps = heap_files(&out);
    assert_eq!(heaps.len(), 2, "{heaps:?}\n{stderr}");
    assert!(
        stderr.contains("older ones (--keep, --max-disk)"),
        "{stderr}"
    );
    // The newest is the end of run's.
    assert_eq!(heap_notes(heaps.last().unwrap())["reason"], "end of run");
}

/// The command lines of the systemd unit and the container recipe, as
/// shipped, run and serve (on a free port, writing under the test folder).
#[test]
fn the_shipped_agent_command_lines_run() {
    let _guard = exclusive();
    let root = workspace_root().join("deploy");
    let unit = std::fs::read_to_string(root.join("memprobe.service")).unwrap();
    let exec = unit
        .lines()
        .find_map(|l| l.strip_prefix("ExecStart="))
        .expect("ExecStart");
    let unit_args: Vec<String> = exec.split_whitespace().skip(1).map(str::to_owned).collect();
    let recipe = std::fs::read_to_string(root.join("Containerfile")).unwrap();
    let entry = recipe
        .lines()
        .find_map(|l| l.strip_prefix("ENTRYPOINT "))
        .expect("ENTRYPOINT");
    let entry_args: Vec<String> = entry
        .trim_matches(|c| c == '[' || c == ']')
        .split(", ")
        .skip(1)
        .map(|a| a.trim_matches('"').to_owned())
        .collect();
    for (name, args) in [("unit", unit_args), ("container", entry_args)] {
        let out = output_dir(&format!("agent_{name}"));
        let args: Vec<String> = args
            .iter()
            .map(|a| {
                if a.ends_with(":6060") {
                    "127.0.0.1:0".to_owned()
                } else if a == "/var/lib/memprobe" {
                    out.to_string_lossy().into_owned()
                } else {
                    a.clone()
                }
            })
            .collect();
        let mut all: Vec<&str> = args.iter().map(String::as_str).collect();
        all.extend(["--duration", "3s"]);
        let memprobe = Memprobe::start(&all);
        let address = memprobe.listening_on();
        let (status, json) = http_get(&address, "/debug/pprof/?format=json");
        assert_eq!(status, 200, "{name}: {json}");
        let (status, stderr) = memprobe.wait();
        assert!(status.success(), "{name}: {stderr}");
        assert!(stderr.contains("each its own"), "{name}: {stderr}");
    }
}
