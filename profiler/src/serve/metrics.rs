//! `GET /metrics`: Prometheus' text exposition, one series per profiled
//! process (labels `pid`, `comm`), what a probe hit costs on this host
//! (label `kind`), and memprobe's own resident memory.
use std::fmt::Write as _;

use axum::{extract::State, http::header, response::IntoResponse, response::Response};

use super::{AppState, Published};

pub(super) async fn metrics(State(state): State<AppState>) -> Response {
    let text = {
        let published = state.run.published.lock();
        match published {
            Ok(published) => {
                exposition(&published, crate::proc::resident_bytes(std::process::id()))
            }
            Err(_) => String::new(),
        }
    };
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response()
}

/// The metrics of one process, by name, type and help text.
const PER_PROCESS: [(&str, &str, &str); 6] = [
    (
        "memprobe_inuse_bytes",
        "gauge",
        "Estimated bytes the process has allocated and not freed.",
    ),
    (
        "memprobe_allocated_bytes_total",
        "counter",
        "Estimated bytes the process allocated since memprobe attached.",
    ),
    (
        "memprobe_samples_total",
        "counter",
        "Allocations memprobe sampled in the process.",
    ),
    (
        "memprobe_dropped_samples_total",
        "counter",
        "Samples lost to a full table; estimates are short by them.",
    ),
    (
        "memprobe_probe_hits_total",
        "counter",
        "Allocator calls that trapped into memprobe's probes.",
    ),
    (
        "memprobe_added_seconds_total",
        "counter",
        "Time memprobe's probes added to the process, from per-hit costs.",
    ),
];

fn exposition(published: &Published, resident_bytes: Option<u64>) -> String {
    let mut text = String::new();
    for (index, (name, kind, help)) in PER_PROCESS.iter().enumerate() {
        let _ = writeln!(text, "# HELP {name} {help}\n# TYPE {name} {kind}");
        for p in &published.processes {
            // Bytes and counts are whole; seconds keep their milliseconds
            // (a scrape's rate over a minute would read 0 or 1 s otherwise).
            let value = match index {
                0 => p.inuse_bytes.round(),
                1 => p.allocated_bytes.round(),
                2 => p.samples as f64,
                3 => p.dropped_samples as f64,
                4 => p.probe_hits as f64,
                _ => (p.added_seconds * 1000.0).round() / 1000.0,
            };
            let _ = writeln!(
                text,
                "{name}{{pid=\"{}\",comm=\"{}\"}} {}",
                p.pid,
                label_value(&p.command),
                value.max(0.0)
            );
        }
    }
    memory_series(&mut text, published);
    let _ = writeln!(
        text,
        "# HELP memprobe_system_wide_probe_hits_total Calls that trapped into system-wide \
         probes (--all), of any process.\n# TYPE memprobe_system_wide_probe_hits_total counter\n\
         memprobe_system_wide_probe_hits_total {}",
        published.system_wide_hits
    );
    if !published.hit_costs.is_empty() {
        let _ = writeln!(
            text,
            "# HELP memprobe_probe_hit_cost_seconds Time one probe hit adds, by kind (for \
             switch_of_thread_with_perf_events, a context switch of a thread carrying any; \
             for switch_per_perf_event, the same more per event), as last measured on this \
             host.\n# TYPE memprobe_probe_hit_cost_seconds gauge"
        );
        for (kind, seconds) in &published.hit_costs {
            let _ = writeln!(
                text,
                "memprobe_probe_hit_cost_seconds{{kind=\"{kind}\"}} {seconds:e}"
            );
        }
    }
    if let Some(bytes) = resident_bytes {
        let _ = writeln!(
            text,
            "# HELP process_resident_memory_bytes Resident memory of memprobe itself.\n\
             # TYPE process_resident_memory_bytes gauge\nprocess_resident_memory_bytes {bytes}"
        );
    }
    text
}

/// Each process's memory account: its resident bytes, and one series per
/// part (label `part`), which add up to them.
fn memory_series(text: &mut String, published: &Published) {
    let accounted: Vec<_> = (published.processes.iter())
        .filter_map(|p| Some((p, p.memory.as_ref()?)))
        .collect();
    if accounted.is_empty() {
        return;
    }
    let _ = writeln!(
        text,
        "# HELP memprobe_resident_bytes The process's resident memory, as its memory account \
         last read it.\n# TYPE memprobe_resident_bytes gauge"
    );
    for (p, account) in &accounted {
        let labels = format!("pid=\"{}\",comm=\"{}\"", p.pid, label_value(&p.command));
        let _ = writeln!(
            text,
            "memprobe_resident_bytes{{{labels}}} {}",
            account.resident
        );
    }
    let _ = writeln!(
        text,
        "# HELP memprobe_memory_bytes The process's resident memory by part (heap in use, \
         allocator footprint, direct mappings, thread stacks, ...), adding up to \
         memprobe_resident_bytes.\n# TYPE memprobe_memory_bytes gauge"
    );
    for (p, account) in &accounted {
        let labels = format!("pid=\"{}\",comm=\"{}\"", p.pid, label_value(&p.command));
        for (part, bytes, _) in account.parts() {
            let _ = writeln!(
                text,
                "memprobe_memory_bytes{{{labels},part=\"{part}\"}} {bytes}"
            );
        }
    }
}

/// A label value with `\`, `"` and newlines escaped, as the format asks.
fn label_value(text: &str) -> String {
    text.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::serve::ProcessStatus;

    #[test]
    fn one_series_per_process_with_escaped_labels() {
        let published = Published {
            processes: vec![ProcessStatus {
                pid: 42,
                command: "we\"ird".into(),
                inuse_bytes: 1024.4,
                samples: 3,
                added_seconds: 2.4567,
                ..ProcessStatus::default()
            }],
            system_wide_hits: 0,
            hit_costs: vec![("emulated", 7.5e-7)],
        };
        let text = exposition(&published, Some(4096));
        assert!(text.contains("memprobe_probe_hit_cost_seconds{kind=\"emulated\"} 7.5e-7\n"));
        assert!(text.contains("memprobe_inuse_bytes{pid=\"42\",comm=\"we\\\"ird\"} 1024\n"));
        assert!(text.contains("# TYPE memprobe_samples_total counter\n"));
        assert!(text.contains("process_resident_memory_bytes 4096\n"));
        assert!(
            text.contains("memprobe_added_seconds_total{pid=\"42\",comm=\"we\\\"ird\"} 2.457\n")
        );
    }
}
