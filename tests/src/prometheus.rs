//! A real Prometheus scraping memprobe's `/metrics`.
use std::{
    path::Path,
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use crate::http_get;

/// Runs Prometheus scraping `target` every second with `scrape` added to
/// its job, and queries what it stored for `pid`'s memprobe_inuse_bytes.
pub fn scraped_by_prometheus(dir: &Path, target: &str, pid: u32, scrape: &str) -> f64 {
    let selector = format!("memprobe_inuse_bytes{{pid=\"{pid}\"}}");
    scraped_series(dir, target, &selector, scrape)
}

/// Runs Prometheus scraping `target` every second with `scrape` added to
/// its job, and queries the value it stored for the series `selector`.
pub fn scraped_series(dir: &Path, target: &str, selector: &str, scrape: &str) -> f64 {
    let web = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let web_address = web.local_addr().unwrap().to_string();
    drop(web);
    let config = dir.join("prometheus.yml");
    std::fs::write(
        &config,
        format!(
            "global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: memprobe\n{scrape}    \
             static_configs:\n      - targets: ['{target}']\n"
        ),
    )
    .unwrap();
    let mut prometheus = Command::new("prometheus")
        .arg(format!("--config.file={}", config.display()))
        .arg(format!(
            "--storage.tsdb.path={}",
            dir.join("tsdb").display()
        ))
        .arg(format!("--web.listen-address={web_address}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("starting prometheus");
    let encoded: String = selector
        .bytes()
        .map(|b| match b {
            b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'_' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect();
    let query = format!("/api/v1/query?query={encoded}");
    let started = Instant::now();
    let found = loop {
        let answer = std::net::TcpStream::connect(&web_address)
            .is_ok()
            .then(|| http_get(&web_address, &query).1);
        if let Some(value) = answer.as_deref().and_then(|a| {
            let at = a.find("\"value\":[")?;
            a[at..].split('"').nth(3)?.parse::<f64>().ok()
        }) {
            break Some(value);
        }
        if started.elapsed() > Duration::from_secs(30) {
            break None;
        }
        std::thread::sleep(Duration::from_millis(500));
    };
    let _ = prometheus.kill();
    let _ = prometheus.wait();
    found.unwrap_or_else(|| panic!("prometheus stored no {selector} within 30 s"))
}
