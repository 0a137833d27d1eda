//! The figures the endpoints show (`--listen`), published once a tick, and
//! the profiles they ask for, answered from the loop with a copy.
use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
};

use tokio::sync::mpsc;

use crate::{
    kernel::Scope,
    run::{Session, notice::FollowCause},
    serve::{Endpoints, MAX_IN_FLIGHT, ProcessStatus, Published, RunHandle, SnapshotRequest},
};

/// `--listen`'s side of the run: what its endpoints show, and their
/// requests for profiles.
pub(super) struct Publishing {
    published: Arc<Mutex<Published>>,
    requests: mpsc::Receiver<SnapshotRequest>,
}

impl Publishing {
    /// The endpoints' next request for a profile.
    pub async fn next_request(publishing: Option<&mut Self>) -> Option<SnapshotRequest> {
        match publishing {
            Some(publishing) => publishing.requests.recv().await,
            None => std::future::pending().await,
        }
    }
}

impl Session<'_> {
    /// Starts serving the endpoints from this run.
    pub(super) fn serve(&mut self, endpoints: Endpoints) {
        let published = Arc::new(Mutex::new(Published::default()));
        let (snapshots, requests) = mpsc::channel(MAX_IN_FLIGHT);
        if let Some(address) = endpoints.local_addr() {
            let _ = writeln!(
                self.status,
                "memprobe: serving {}://{address}/debug/pprof/ and /metrics{}",
                endpoints.scheme(),
                endpoints.asks_for()
            );
        }
        endpoints.serve(RunHandle {
            published: published.clone(),
            snapshots,
        });
        self.publishing = Some(Publishing {
            published,
            requests,
        });
        self.publish();
    }

    /// Refreshes what the endpoints show. Cheap: sums, no profile copies.
    pub(super) fn publish(&mut self) {
        let Some(Publishing { published, .. }) = &self.publishing else {
            return;
        };
        let mut per_pid = self.costs.ledger.per_process(&self.probes.attached);
        let mut files: HashMap<u32, Vec<String>> = HashMap::new();
        let mut system_wide_hits = 0;
        let hits = self.costs.ledger.hits();
        for (index, probe) in self.probes.attached.iter().enumerate() {
            match probe.scope {
                Scope::Process(pid) => {
                    let paths = files.entry(pid).or_default();
                    if !paths.contains(&probe.path) {
                        paths.push(probe.path.clone());
                    }
                }
                Scope::AllProcesses => system_wide_hits += hits.get(index).copied().unwrap_or(0),
            }
        }
        let processes = self
            .tracked
            .values()
            .map(|t| {
                let (probe_hits, added_seconds) = per_pid.remove(&t.pid).unwrap_or_default();
                let allocators = files.remove(&t.pid).unwrap_or_default();
                let d = t.heap.drops;
                ProcessStatus {
                    pid: t.pid,
                    command: t.command.clone(),
                    allocators,
                    inuse_bytes: t.heap.inuse_bytes(),
                    allocated_bytes: t.heap.alloc_bytes(),
                    samples: t.heap.samples,
                    dropped_samples: d.live_table_full + d.untracked_in_kernel + d.stack_table_full,
                    probe_hits,
                    added_seconds,
                    exited: t.exited,
                    memory: self.snapshots.of(t.pid).and_then(|s| s.account.clone()),
                }
            })
            .collect();
        if let Ok(mut published) = published.lock() {
            *published = Published {
                processes,
                system_wide_hits,
                hit_costs: self.costs.model.measured_kinds(),
            };
        }
    }

    /// A profile an endpoint asked for: the current estimates, copied (for
    /// a delta, once the process's frees are followed).
    pub(super) fn answer(&mut self, request: SnapshotRequest) {
        if let Some(wanted) = request.follow_frees {
            self.follow_frees_for(request.pid, wanted, FollowCause::Request);
        }
        let profile = self.tracked.get(&request.pid).map(|t| t.profile());
        let _ = request.reply.send(profile);
    }
}
