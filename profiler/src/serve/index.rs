//! `GET /debug/pprof/`: the profiled processes, as an HTML table for a
//! browser and as JSON for scripts (`?format=json`).
use std::{collections::HashMap, fmt::Write as _};

use axum::{
    extract::{Query, State},
    http::{StatusCode, header},
    response::{IntoResponse, Response},
};

use super::{AppState, ProcessStatus, refuse};
use crate::units;

pub(super) async fn index(
    State(state): State<AppState>,
    Query(query): Query<HashMap<String, String>>,
) -> Response {
    let processes = state.processes();
    match query.get("format").map(String::as_str) {
        None | Some("html") => (
            [(header::CONTENT_TYPE, "text/html; charset=utf-8")],
            html(&processes),
        )
            .into_response(),
        Some("json") => (
            [(header::CONTENT_TYPE, "application/json")],
            serde_json::to_string(&processes).unwrap_or_else(|_| "[]".into()),
        )
            .into_response(),
        Some(other) => refuse(
            StatusCode::BAD_REQUEST,
            &format!("unknown format '{other}': use html or json"),
        )
        .into_response(),
    }
}

fn html(processes: &[ProcessStatus]) -> String {
    let mut page = String::from(
        "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>memprobe</title></head><body>\n\
         <h1>memprobe: profiled processes</h1>\n<table border=\"1\" cellpadding=\"4\">\n\
         <tr><th>pid</th><th>command</th><th>allocator</th><th>in use (estimated)</th>\
         <th>samples</th><th>dropped</th><th>profile</th></tr>\n",
    );
    for p in processes {
        let _ = writeln!(
            page,
            "<tr><td>{pid}</td><td>{command}</td><td>{allocators}</td><td>{inuse}</td>\
             <td>{samples}</td><td>{dropped}</td>\
             <td><a href=\"heap?pid={pid}\">heap</a></td></tr>",
            pid = p.pid,
            command = escape(&p.command),
            allocators = escape(&p.allocators.join(", ")),
            inuse = units::bytes(p.inuse_bytes),
            samples = p.samples,
            dropped = p.dropped_samples,
        );
    }
    page.push_str("</table>\n<p>Metrics: <a href=\"/metrics\">/metrics</a></p>\n</body></html>\n");
    page
}

/// Text as HTML: a command name is the target's to choose.
fn escape(text: &str) -> String {
    text.chars()
        .map(|c| match c {
            '<' => "&lt;".into(),
            '>' => "&gt;".into(),
            '&' => "&amp;".into(),
            '"' => "&quot;".into(),
            c => c.to_string(),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_command_name_cannot_inject_markup() {
        let page = html(&[ProcessStatus {
            pid: 7,
            command: "<script>x</script>".into(),
            ..ProcessStatus::default()
        }]);
        assert!(!page.contains("<script>"));
        assert!(page.contains("&lt;script&gt;"));
        assert!(page.contains("heap?pid=7"));
    }
}
