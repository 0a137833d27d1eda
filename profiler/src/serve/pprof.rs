//! `GET /debug/pprof/heap?pid=PID[&seconds=N]`, as Go's `net/http/pprof`
//! serves heap profiles: gzipped pprof with alloc_objects, alloc_space,
//! inuse_objects and inuse_space; with `seconds`, the difference over the
//! next N seconds.
use std::{collections::HashMap, time::Duration};

use axum::{
    extract::{Query, State},
    http::{StatusCode, header},
    response::{IntoResponse, Response},
};
use tokio::sync::oneshot;

use super::{AppState, MAX_DELTA_SECONDS, Refusal, SnapshotRequest, refuse};
use crate::{output, profile::HeapProfile, symbolize::Namer};

/// How much longer than a delta's span frees are followed: its second
/// profile is taken inside.
const FOLLOW_GRACE: Duration = Duration::from_secs(2);

pub(super) async fn heap(
    State(state): State<AppState>,
    Query(query): Query<HashMap<String, String>>,
) -> Response {
    match profile_of(&state, &query).await {
        Ok(bytes) => (
            [
                (header::CONTENT_TYPE, "application/octet-stream"),
                (header::CONTENT_DISPOSITION, "attachment; filename=\"heap\""),
            ],
            bytes,
        )
            .into_response(),
        Err(refused) => refused.into_response(),
    }
}

async fn profile_of(state: &AppState, query: &HashMap<String, String>) -> Result<Vec<u8>, Refusal> {
    if let Some(unknown) = query
        .keys()
        .find(|k| !matches!(k.as_str(), "pid" | "seconds" | "gc"))
    {
        let reason = format!("unknown parameter '{unknown}': use pid and seconds");
        return Err(refuse(StatusCode::BAD_REQUEST, &reason));
    }
    let pid = pid_of(state, query.get("pid"))?;
    let seconds = match query.get("seconds") {
        None => None,
        Some(text) => Some(
            text.parse::<u64>()
                .ok()
                .filter(|s| (1..=MAX_DELTA_SECONDS).contains(s))
                .ok_or_else(|| {
                    let reason = format!("seconds must be 1 to {MAX_DELTA_SECONDS}, not '{text}'");
                    refuse(StatusCode::BAD_REQUEST, &reason)
                })?,
        ),
    };
    // A delta follows the frees of a process tracked for its allocations
    // only over its span (and the time to take its second profile).
    let follow = seconds.map(|s| Duration::from_secs(s) + FOLLOW_GRACE);
    let mut profile = snapshot(state, pid, follow).await?;
    if let Some(seconds) = seconds {
        tokio::time::sleep(Duration::from_secs(seconds)).await;
        let after = snapshot(state, pid, None).await?;
        profile = after.since(&profile, seconds);
    }
    let encoded = tokio::task::spawn_blocking(move || {
        let mut namer = Namer::for_process(pid, &profile.mapped_libraries);
        let mut bytes = Vec::new();
        output::pprof::write(&profile, &mut namer, &mut bytes).map(|()| bytes)
    })
    .await;
    match encoded {
        Ok(Ok(bytes)) => Ok(bytes),
        _ => Err(refuse(
            StatusCode::INTERNAL_SERVER_ERROR,
            "encoding the profile failed",
        )),
    }
}

/// The pid asked for; may be left out when one process is profiled.
fn pid_of(state: &AppState, pid: Option<&String>) -> Result<u32, Refusal> {
    let processes = state.processes();
    let Some(text) = pid else {
        return match processes.as_slice() {
            [only] => Ok(only.pid),
            _ => {
                let reason = format!(
                    "{} processes are profiled: say which with ?pid= (see /debug/pprof/)",
                    processes.len()
                );
                Err(refuse(StatusCode::BAD_REQUEST, &reason))
            }
        };
    };
    let pid: u32 = text.parse().map_err(|_| {
        refuse(
            StatusCode::BAD_REQUEST,
            &format!("pid must be a number, not '{text}'"),
        )
    })?;
    if !processes.iter().any(|p| p.pid == pid) {
        let reason = format!("pid {pid} is not profiled (see /debug/pprof/)");
        return Err(refuse(StatusCode::NOT_FOUND, &reason));
    }
    Ok(pid)
}

/// The run's current estimates of `pid`.
async fn snapshot(
    state: &AppState,
    pid: u32,
    follow_frees: Option<Duration>,
) -> Result<HeapProfile, Refusal> {
    let (reply, answer) = oneshot::channel();
    let gone = || {
        let reason = format!("pid {pid} is no longer profiled");
        refuse(StatusCode::NOT_FOUND, &reason)
    };
    let unavailable = || refuse(StatusCode::SERVICE_UNAVAILABLE, "the run is ending");
    state
        .run
        .snapshots
        .send(SnapshotRequest {
            pid,
            follow_frees,
            reply,
        })
        .await
        .map_err(|_| unavailable())?;
    answer.await.map_err(|_| unavailable())?.ok_or_else(gone)
}
