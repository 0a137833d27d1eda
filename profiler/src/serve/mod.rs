//! `--listen ADDR:PORT`: what continuous-profiling systems and Prometheus
//! scrape, in their own conventions: Go's `/debug/pprof/heap` (gzipped
//! pprof), an index of the profiled processes, and `/metrics`.
//!
//! Requests never hold up the event intake: the run publishes each
//! process's figures once a tick, a profile is a copy of the estimates the
//! loop hands over on request, and naming and encoding run on blocking
//! threads. At most [`MAX_IN_FLIGHT`] requests are served at once; more get
//! a 503. Bad queries get a 4xx with a one-line reason. Who may ask is
//! settled in [`access`]; TLS connections are served in [`tls`].
mod access;
mod error;
mod index;
mod metrics;
mod pprof;
mod tls;

pub use access::{Access, AccessOptions};
pub use error::ServeError;

use std::{
    net::SocketAddr,
    sync::{Arc, Mutex},
};

use axum::{
    Router,
    http::{StatusCode, header},
    response::{IntoResponse, Response},
    routing::get,
};
use serde::Serialize;
use tokio::sync::{Semaphore, mpsc, oneshot};

use crate::profile::{HeapProfile, MemoryAccount};

/// Requests served at once; more are refused with 503.
pub const MAX_IN_FLIGHT: usize = 8;

/// Longest `?seconds=` a delta profile may take.
pub const MAX_DELTA_SECONDS: u64 = 3600;

/// One profiled process as the endpoints show it.
#[derive(Clone, Debug, Default, Serialize)]
pub struct ProcessStatus {
    pub pid: u32,
    pub command: String,
    /// The allocator files probed for it.
    pub allocators: Vec<String>,
    pub inuse_bytes: f64,
    pub allocated_bytes: f64,
    pub samples: u64,
    pub dropped_samples: u64,
    pub probe_hits: u64,
    /// Time the probes added to the process, estimated from per-hit costs.
    pub added_seconds: f64,
    pub exited: bool,
    /// Its resident memory accounted for, as last read.
    pub memory: Option<MemoryAccount>,
}

/// What the run publishes once a tick.
#[derive(Debug, Default)]
pub struct Published {
    pub processes: Vec<ProcessStatus>,
    /// Probe hits of system-wide probes (`--all`), not of one process.
    pub system_wide_hits: u64,
    /// Seconds a probe hit costs, by kind, as last measured on this host;
    /// empty where they could not be measured.
    pub hit_costs: Vec<(&'static str, f64)>,
}

/// A profile asked of the run: the current estimates of `pid`.
pub struct SnapshotRequest {
    pub pid: u32,
    /// For a delta (`?seconds=N`): follow the process's frees for this
    /// long from now, where only its allocations are tracked, so that the
    /// delta's in use is what stayed live; the profile is taken once they
    /// are followed.
    pub follow_frees: Option<std::time::Duration>,
    pub reply: oneshot::Sender<Option<HeapProfile>>,
}

/// The endpoints' side of the run.
#[derive(Clone)]
pub struct RunHandle {
    pub published: Arc<Mutex<Published>>,
    pub snapshots: mpsc::Sender<SnapshotRequest>,
}

/// A bound listener, made before anything is attached so that a bad
/// address is an error with nothing to undo.
pub struct Endpoints {
    listener: tokio::net::TcpListener,
    access: Access,
}

#[derive(Clone)]
struct AppState {
    run: RunHandle,
    in_flight: Arc<Semaphore>,
    access: Access,
}

impl Endpoints {
    /// Binds `address`, once `access` says it may be served so.
    pub fn bind(address: SocketAddr, access: &AccessOptions) -> Result<Self, ServeError> {
        let access = Access::settle(access, address)?;
        let bind_error = |cause| ServeError::Listen { address, cause };
        let listener = std::net::TcpListener::bind(address).map_err(bind_error)?;
        listener.set_nonblocking(true).map_err(bind_error)?;
        let listener = tokio::net::TcpListener::from_std(listener).map_err(bind_error)?;
        Ok(Self { listener, access })
    }

    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.listener.local_addr().ok()
    }

    /// `https` or `http`.
    pub fn scheme(&self) -> &'static str {
        if self.access.tls.is_some() {
            "https"
        } else {
            "http"
        }
    }

    /// What a client must show, for the line that says where memprobe serves.
    pub fn asks_for(&self) -> &'static str {
        match (self.access.token.is_some(), self.access.client_certificates) {
            (true, true) => " (bearer token and client certificate asked for)",
            (true, false) => " (bearer token asked for)",
            (false, true) => " (client certificate asked for)",
            (false, false) => "",
        }
    }

    /// Serves until the run ends (the task is dropped with the runtime).
    pub fn serve(self, run: RunHandle) {
        let state = AppState {
            run,
            in_flight: Arc::new(Semaphore::new(MAX_IN_FLIGHT)),
            access: self.access.clone(),
        };
        let router = Router::new()
            .route("/debug/pprof/heap", get(pprof::heap))
            .route("/debug/pprof/", get(index::index))
            .route("/debug/pprof", get(index::index))
            .route("/metrics", get(metrics::metrics))
            .fallback(not_found)
            .layer(axum::middleware::from_fn_with_state(state.clone(), admit))
            .layer(axum::middleware::from_fn_with_state(
                state.clone(),
                authorize,
            ))
            .with_state(state);
        match self.access.tls {
            Some(config) => {
                tokio::spawn(tls::serve(self.listener, config, router));
            }
            None => {
                tokio::spawn(async move {
                    let _ = axum::serve(self.listener, router).await;
                });
            }
        }
    }
}

async fn not_found() -> Response {
    refuse(
        StatusCode::NOT_FOUND,
        "no such endpoint: try /debug/pprof/, /debug/pprof/heap or /metrics",
    )
    .into_response()
}

/// A 4xx or 5xx with a one-line reason.
struct Refusal {
    status: StatusCode,
    reason: String,
}

fn refuse(status: StatusCode, reason: &str) -> Refusal {
    Refusal {
        status,
        reason: reason.to_owned(),
    }
}

impl IntoResponse for Refusal {
    fn into_response(self) -> Response {
        (
            self.status,
            [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
            format!("{}\n", self.reason),
        )
            .into_response()
    }
}

/// With a token asked for, a request without it gets a 401 (before it
/// takes a slot among those in flight).
async fn authorize(
    axum::extract::State(state): axum::extract::State<AppState>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let given = request.headers().get(header::AUTHORIZATION);
    if !state.access.admits(given.map(|value| value.as_bytes())) {
        let mut refusal = refuse(
            StatusCode::UNAUTHORIZED,
            "missing or wrong bearer token: send Authorization: Bearer <the token in --auth-token-file>",
        )
        .into_response();
        refusal.headers_mut().insert(
            header::WWW_AUTHENTICATE,
            header::HeaderValue::from_static("Bearer"),
        );
        return refusal;
    }
    next.run(request).await
}

/// Every request holds a slot among [`MAX_IN_FLIGHT`] while it is served;
/// without a free one it gets a 503.
async fn admit(
    axum::extract::State(state): axum::extract::State<AppState>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let Ok(_slot) = state.in_flight.clone().try_acquire_owned() else {
        return refuse(
            StatusCode::SERVICE_UNAVAILABLE,
            "too many requests in flight: retry shortly",
        )
        .into_response();
    };
    next.run(request).await
}

impl AppState {
    fn processes(&self) -> Vec<ProcessStatus> {
        self.run
            .published
            .lock()
            .map(|p| p.processes.clone())
            .unwrap_or_default()
    }
}
