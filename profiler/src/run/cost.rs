//! What memprobe costs the profiled processes: probe hits per entry point,
//! and the time they add, estimated from per-hit costs.
use std::{collections::HashMap, time::Duration};

use profiler_common::CallShape;

use crate::kernel::{AttachedProbe, KernelProbes, ReturnHalf, Scope};

/// Time one probe hit adds to the target, by kind: measured on this host
/// at start (`run::calibrate`), or, where that failed, defaults from
/// `cargo xtask bench` on this machine kind (a VM, where a single-step trap
/// is dear), which other hosts may differ from by 2x.
#[derive(Clone, Copy, Debug)]
pub struct CostModel {
    /// A probe on an instruction the kernel emulates.
    pub emulated: Duration,
    /// The same for a free's probe, whose program reads a slot of the
    /// sampled pointers' counts that no recent call warmed (and looks the
    /// pointer up where the slot counts any).
    pub free: Duration,
    /// A probe on an instruction the kernel single-steps.
    pub single_stepped: Duration,
    /// The return half of a call with a return probe.
    pub return_half: Duration,
    /// A return that another process's probe at the same place forces
    /// (`kernel::shared`): a trap with no program of memprobe's to run.
    pub forced_return: Duration,
    /// A probe on `endbr64`, where CET builds start each function: probes
    /// go past it where the placement rules allow (entry-only ones).
    pub endbr64: Duration,
    /// Whether these were measured on this host.
    pub measured: bool,
}

impl Default for CostModel {
    fn default() -> Self {
        Self {
            emulated: Duration::from_nanos(760),
            free: Duration::from_nanos(760),
            single_stepped: Duration::from_nanos(10_000),
            return_half: Duration::from_nanos(310),
            forced_return: Duration::from_nanos(310),
            endbr64: Duration::from_nanos(10_000),
            measured: false,
        }
    }
}

impl std::fmt::Display for CostModel {
    /// "per hit, measured here: 0.76 µs emulated (0.76 µs a free), 10.0 µs
    /// single-stepped, 0.31 µs return, 0.31 µs a forced return".
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let micros = |d: Duration| d.as_secs_f64() * 1e6;
        write!(
            f,
            "per hit, {}: {:.2} µs emulated ({:.2} µs a free), {:.1} µs single-stepped, \
             {:.2} µs return, {:.2} µs a forced return",
            if self.measured {
                "measured on this host"
            } else {
                "defaults (not measured)"
            },
            micros(self.emulated),
            micros(self.free),
            micros(self.single_stepped),
            micros(self.return_half),
            micros(self.forced_return)
        )
    }
}

/// Hits and estimated cost of one entry point.
#[derive(Clone, Debug)]
pub struct ProbeCost {
    pub scope: Scope,
    pub symbol: String,
    pub hits: u64,
    pub added: Duration,
}

impl CostModel {
    /// Each kind's cost in seconds, named for `/metrics`; none where not
    /// measured.
    pub fn measured_kinds(&self) -> Vec<(&'static str, f64)> {
        if !self.measured {
            return Vec::new();
        }
        [
            ("emulated", self.emulated),
            ("free", self.free),
            ("single_stepped", self.single_stepped),
            ("return", self.return_half),
            ("forced_return", self.forced_return),
            ("endbr64", self.endbr64),
        ]
        .into_iter()
        .map(|(kind, cost)| (kind, cost.as_secs_f64()))
        .collect()
    }

    /// Per-hit cost of `probe`. A probe kept at the entry for lack of an
    /// emulated instruction is counted as single-stepped; a probe whose
    /// calls all trap at their return for another process's probes
    /// (`forced_return`, see [`KernelProbes::forced_returns`]) pays such a
    /// return on each.
    pub fn per_hit(&self, probe: &AttachedProbe, forced_return: bool) -> Duration {
        let entry = if probe.placement.fallback.is_some() {
            self.single_stepped
        } else if matches!(probe.shape, CallShape::Free | CallShape::FreeInResize) {
            self.free
        } else {
            self.emulated
        };
        match probe.return_half {
            ReturnHalf::Uretprobe => entry + self.return_half,
            _ if forced_return => entry + self.forced_return,
            // Sampled calls only: one in thousands at the default interval.
            ReturnHalf::Session | ReturnHalf::None => entry,
        }
    }
}

/// Probe hits and the time they added, per attached probe (in the order
/// of [`KernelProbes::attached`]), priced as they come: a probe's price
/// changes during a run (another process sharing its file is attached or
/// leaves), so each update prices only the hits since the one before.
#[derive(Clone, Debug, Default)]
pub struct CostLedger {
    hits: Vec<u64>,
    added: Vec<Duration>,
    /// Whether each probe's returns were forced at the last update: a
    /// probe detached since is priced as it was while attached.
    forced: Vec<bool>,
}

impl CostLedger {
    /// Prices the hits counted since the last update. Returns the probes
    /// whose returns another process's probes began to force since then.
    pub fn update(&mut self, model: &CostModel, probes: &KernelProbes) -> Vec<usize> {
        self.record(
            model,
            &probes.attached,
            &probes.probe_hits(),
            &probes.forced_returns(),
        )
    }

    fn record(
        &mut self,
        model: &CostModel,
        attached: &[AttachedProbe],
        hits: &[u64],
        forced: &[Option<bool>],
    ) -> Vec<usize> {
        let mut newly_forced = Vec::new();
        let count = attached.len();
        self.hits.resize(count, 0);
        self.added.resize(count, Duration::ZERO);
        self.forced.resize(count, false);
        for (index, probe) in attached.iter().enumerate() {
            let total = hits.get(index).copied().unwrap_or(0);
            let new = total.saturating_sub(self.hits[index]);
            let forced = match forced.get(index).copied().flatten() {
                Some(forced) => {
                    if forced && !self.forced[index] {
                        newly_forced.push(index);
                    }
                    forced
                }
                None => self.forced[index],
            };
            let per_hit = model.per_hit(probe, forced);
            self.added[index] += per_hit.saturating_mul(new.min(u32::MAX as u64) as u32);
            self.hits[index] = total;
            self.forced[index] = forced;
        }
        newly_forced
    }

    /// Each probe's hits as of the last update.
    pub fn hits(&self) -> &[u64] {
        &self.hits
    }

    /// The hits and added time since `earlier`, a copy of this ledger.
    pub fn since(&self, earlier: &CostLedger) -> CostLedger {
        let mut delta = self.clone();
        for (index, hits) in delta.hits.iter_mut().enumerate() {
            *hits -= earlier.hits.get(index).copied().unwrap_or(0).min(*hits);
        }
        for (index, added) in delta.added.iter_mut().enumerate() {
            *added = added.saturating_sub(earlier.added.get(index).copied().unwrap_or_default());
        }
        delta
    }

    /// Hits and added seconds of each process's own probes.
    pub fn per_process(&self, attached: &[AttachedProbe]) -> HashMap<u32, (u64, f64)> {
        let mut processes: HashMap<u32, (u64, f64)> = HashMap::new();
        for ((probe, hits), added) in attached.iter().zip(&self.hits).zip(&self.added) {
            if let Scope::Process(pid) = probe.scope {
                let process = processes.entry(pid).or_default();
                process.0 += hits;
                process.1 += added.as_secs_f64();
            }
        }
        processes
    }

    /// Hits and added time per entry point, busiest first; an entry point
    /// attached more than once (the slow path's trial swaps probes) counts
    /// once.
    pub fn costs(&self, attached: &[AttachedProbe]) -> Vec<ProbeCost> {
        let mut costs: Vec<ProbeCost> = Vec::new();
        let counted = attached.iter().zip(&self.hits).zip(&self.added);
        for ((probe, &hits), &added) in counted.filter(|((_, hits), _)| **hits > 0) {
            let same = |c: &&mut ProbeCost| c.scope == probe.scope && c.symbol == probe.symbol;
            match costs.iter_mut().find(same) {
                Some(cost) => {
                    cost.hits += hits;
                    cost.added += added;
                }
                None => costs.push(ProbeCost {
                    scope: probe.scope,
                    symbol: probe.symbol.clone(),
                    hits,
                    added,
                }),
            }
        }
        costs.sort_by_key(|c| std::cmp::Reverse(c.hits));
        costs
    }
}

/// "malloc 120.3k/s, free 118.0k/s, ..." for the busiest entry points.
pub fn rates(costs: &[ProbeCost], elapsed: Duration, most: usize) -> String {
    let seconds = elapsed.as_secs_f64().max(1e-3);
    costs
        .iter()
        .take(most)
        .map(|c| format!("{} {}/s", c.symbol, human_count(c.hits as f64 / seconds)))
        .collect::<Vec<_>>()
        .join(", ")
}

pub fn human_count(value: f64) -> String {
    match value {
        v if v >= 1e6 => format!("{:.1}M", v / 1e6),
        v if v >= 1e3 => format!("{:.1}k", v / 1e3),
        v => format!("{v:.0}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::discover::placement::Placement;

    fn probe(symbol: &str, emulated: bool, return_half: ReturnHalf) -> AttachedProbe {
        let mut placement = Placement::entry("test");
        if emulated {
            placement.fallback = None;
        }
        AttachedProbe {
            scope: Scope::Process(1),
            symbol: symbol.into(),
            path: "/lib/libjemalloc.so.2".into(),
            file: None,
            file_offset: 0,
            placement,
            return_half,
            instance: 0,
            allocator: crate::discover::AllocatorKind::Jemalloc,
            shape: if symbol == "free" {
                CallShape::Free
            } else {
                CallShape::SizeArg0
            },
            own_code: None,
        }
    }

    const MODEL: CostModel = CostModel {
        emulated: Duration::from_nanos(409),
        free: Duration::from_nanos(371),
        single_stepped: Duration::from_nanos(10_000),
        return_half: Duration::from_nanos(263),
        forced_return: Duration::from_nanos(201),
        endbr64: Duration::from_nanos(9_000),
        measured: true,
    };

    #[test]
    fn costs_follow_placement_and_return_probes() {
        let model = MODEL;
        let probes = [
            probe("malloc", true, ReturnHalf::Uretprobe),
            probe("free", true, ReturnHalf::None),
            probe("calloc", false, ReturnHalf::Uretprobe),
            probe("mallocx", true, ReturnHalf::Session),
        ];
        let mut ledger = CostLedger::default();
        ledger.record(&model, &probes, &[1000, 2000, 0, 500], &[Some(false); 4]);
        let costs = ledger.costs(&probes);
        assert_eq!(costs.len(), 3);
        assert_eq!(costs[0].symbol, "free");
        assert_eq!(costs[0].added, Duration::from_nanos(371 * 2000));
        assert_eq!(costs[1].added, Duration::from_nanos((409 + 263) * 1000));
        assert_eq!(
            model.per_hit(&probes[2], false),
            Duration::from_nanos(10_000 + 263)
        );
        assert_eq!(costs[2].added, Duration::from_nanos(409 * 500));
        assert_eq!(rates(&costs, Duration::from_secs(2), 1), "free 1.0k/s");
        assert_eq!(
            model.to_string(),
            "per hit, measured on this host: 0.41 µs emulated (0.37 µs a free), 10.0 µs \
             single-stepped, 0.26 µs return, 0.20 µs a forced return"
        );
    }

    /// Hits are priced when counted: a session's hits while another
    /// process's probe forced its returns pay a return half each, and keep
    /// that price once it is detached.
    #[test]
    fn each_update_prices_the_new_hits_as_probes_are_then() {
        let probes = [
            probe("malloc", true, ReturnHalf::Session),
            probe("free", true, ReturnHalf::None),
        ];
        let mut ledger = CostLedger::default();
        ledger.record(&MODEL, &probes, &[100, 100], &[Some(false); 2]);
        let before = ledger.clone();
        let newly = ledger.record(&MODEL, &probes, &[300, 300], &[Some(true), Some(false)]);
        assert_eq!(newly, [0]);
        // Detached: its last hits at the price it had.
        let newly = ledger.record(&MODEL, &probes, &[310, 300], &[None, Some(false)]);
        assert!(newly.is_empty());
        let costs = ledger.costs(&probes);
        let malloc = costs.iter().find(|c| c.symbol == "malloc").unwrap();
        assert_eq!(malloc.hits, 310);
        assert_eq!(
            malloc.added,
            Duration::from_nanos(409 * 100 + (409 + 201) * 210)
        );
        let recent = ledger.since(&before).costs(&probes);
        assert_eq!(recent[0].hits, 210);
        assert_eq!(recent[0].added, Duration::from_nanos((409 + 201) * 210));
        assert_eq!(recent[1].hits, 200);
        let processes = ledger.per_process(&probes);
        assert_eq!(processes[&1].0, 610);
    }
}
