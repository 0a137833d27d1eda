//! The probes' hits and samples, priced as they come (each tick's at the
//! costs of its time), per probe, per process and per task switch.
use std::{
    collections::HashMap,
    time::{Duration, Instant},
};

use crate::{
    kernel::{AttachedProbe, KernelProbes, ProbeSamples, Scope},
    run::cost::CostModel,
};

/// Hits and estimated cost of one entry point.
#[derive(Clone, Debug)]
pub struct ProbeCost {
    pub scope: Scope,
    pub symbol: String,
    pub hits: u64,
    pub added: Duration,
}

/// Probe hits and the time they added, per attached probe (in the order
/// of [`KernelProbes::attached`]), priced as they come: a probe's price
/// changes during a run (another process sharing its file is attached or
/// leaves), so each update prices only the hits since the one before.
#[derive(Clone, Debug, Default)]
pub struct CostLedger {
    hits: Vec<u64>,
    /// Each probe's samples when last read: their price is what the kernel
    /// timed, taken as it grows.
    samples: Vec<ProbeSamples>,
    added: Vec<Duration>,
    /// Whether each probe's returns were forced at the last update: a
    /// probe detached since is priced as it was while attached.
    forced: Vec<bool>,
    /// Per process with perf events on its main thread: that thread's
    /// context switches and the time they added.
    switches: HashMap<u32, TaskSwitches>,
}

/// A main thread's context switches while perf events were on it.
#[derive(Clone, Copy, Debug, Default)]
struct TaskSwitches {
    /// Its count of switches when last read, and when that was (none once
    /// its process ended).
    read: u64,
    at: Option<Instant>,
    /// Switches a second between the last two readings, and their price.
    rate: f64,
    per_switch: Duration,
    /// Switches since the events were first seen on it.
    counted: u64,
    added: Duration,
}

impl TaskSwitches {
    fn add(&mut self, switches: u64) {
        let times = u32::try_from(switches).unwrap_or(u32::MAX);
        self.added += self.per_switch.saturating_mul(times);
        self.counted += switches;
    }
}

impl CostLedger {
    /// Prices the hits counted since the last update. Returns the probes
    /// whose returns another process's probes began to force since then.
    pub fn update(&mut self, model: &CostModel, probes: &KernelProbes) -> Vec<usize> {
        let events = probes.task_events();
        let read_switches = crate::proc::main_thread_switches;
        self.record_switches(model, &events, read_switches, Instant::now());
        self.record(
            model,
            &probes.attached,
            (&probes.probe_hits(), &probes.probe_samples()),
            &probes.forced_returns(),
        )
    }

    /// Prices the context switches of each main thread that carries
    /// `events` perf events since the last update, read `now`
    /// (`read_switches` counts a process's); a thread's first reading only
    /// starts its count.
    fn record_switches(
        &mut self,
        model: &CostModel,
        events: &HashMap<u32, usize>,
        read_switches: impl Fn(u32) -> Option<u64>,
        now: Instant,
    ) {
        for (&pid, &count) in events {
            let per_switch =
                model.switch_per_thread + model.switch_per_event.saturating_mul(count as u32);
            let ended = |task: &TaskSwitches| task.at.is_none();
            if self.switches.get(&pid).is_some_and(ended) {
                continue;
            }
            let Some(read) = read_switches(pid) else {
                continue;
            };
            let task = self.switches.entry(pid).or_default();
            // At the costs of now, as hits are.
            task.per_switch = per_switch;
            if let Some(at) = task.at {
                let new = read.saturating_sub(task.read);
                let seconds = now.saturating_duration_since(at).as_secs_f64();
                task.rate = if seconds > 0.0 {
                    new as f64 / seconds
                } else {
                    0.0
                };
                task.add(new);
            }
            (task.read, task.at) = (read, Some(now));
        }
    }

    /// Prices the switches of `pid`'s main thread between its last reading
    /// and its end, `now`, which /proc can no longer count (up to a tick's,
    /// a fifth of a five-second run): at the rate between its last two
    /// readings.
    pub fn process_ended(&mut self, pid: u32, now: Instant) {
        let Some(task) = self.switches.get_mut(&pid) else {
            return;
        };
        if let Some(at) = task.at.take() {
            let seconds = now.saturating_duration_since(at).as_secs_f64();
            task.add((task.rate * seconds) as u64);
        }
    }

    /// Context switches of main threads that carried perf events, and the
    /// time those events added to them, over all processes.
    pub fn switch_costs(&self) -> (u64, Duration) {
        self.switches
            .values()
            .fold((0, Duration::ZERO), |(n, t), s| {
                (n + s.counted, t + s.added)
            })
    }

    fn record(
        &mut self,
        model: &CostModel,
        attached: &[AttachedProbe],
        (hits, samples): (&[u64], &[ProbeSamples]),
        forced: &[Option<bool>],
    ) -> Vec<usize> {
        let mut newly_forced = Vec::new();
        let count = attached.len();
        self.hits.resize(count, 0);
        self.samples.resize(count, ProbeSamples::default());
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
            let sampled = samples.get(index).copied().unwrap_or_default();
            let before = self.samples[index];
            let new_samples = ProbeSamples {
                calls: sampled.calls.saturating_sub(before.calls),
                nanos: sampled.nanos.saturating_sub(before.nanos),
            };
            self.added[index] += model.sampled(probe, new_samples);
            self.samples[index] = sampled;
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
        for (pid, task) in delta.switches.iter_mut() {
            let before = earlier.switches.get(pid).copied().unwrap_or_default();
            task.counted -= before.counted.min(task.counted);
            task.added = task.added.saturating_sub(before.added);
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
        for (pid, task) in &self.switches {
            processes.entry(*pid).or_default().1 += task.added.as_secs_f64();
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
    use profiler_common::CallShape;

    use super::*;
    use crate::{binary::placement::Placement, kernel::ReturnHalf};

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
            windowed: false,
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
        switch_per_thread: Duration::from_nanos(600),
        switch_per_event: Duration::from_nanos(150),
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
        ledger.record(
            &model,
            &probes,
            (&[1000, 2000, 0, 500], &[]),
            &[Some(false); 4],
        );
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
             single-stepped, 0.26 µs return, 0.20 µs a forced return; a context switch \
             0.60 µs and 0.15 µs per perf event"
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
        ledger.record(&MODEL, &probes, (&[100, 100], &[]), &[Some(false); 2]);
        let before = ledger.clone();
        let newly = ledger.record(
            &MODEL,
            &probes,
            (&[300, 300], &[]),
            &[Some(true), Some(false)],
        );
        assert_eq!(newly, [0]);
        // Detached: its last hits at the price it had.
        let newly = ledger.record(&MODEL, &probes, (&[310, 300], &[]), &[None, Some(false)]);
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

    /// A sample adds what the kernel timed of it, and a return half where
    /// only sampled calls take one; each update prices only the new ones.
    #[test]
    fn samples_add_their_timed_cost_and_a_return_each() {
        let probes = [
            probe("malloc", true, ReturnHalf::Session),
            probe("calloc", true, ReturnHalf::Uretprobe),
        ];
        let samples = |calls, nanos| ProbeSamples { calls, nanos };
        let mut ledger = CostLedger::default();
        let first = [samples(10, 50_000), samples(10, 50_000)];
        ledger.record(&MODEL, &probes, (&[100, 100], &first), &[Some(false); 2]);
        let costs = ledger.costs(&probes);
        let cost = |symbol: &str| costs.iter().find(|c| c.symbol == symbol).unwrap().added;
        assert_eq!(
            cost("malloc"),
            Duration::from_nanos(409 * 100 + 50_000 + 263 * 10)
        );
        assert_eq!(
            cost("calloc"),
            Duration::from_nanos((409 + 263) * 100 + 50_000)
        );
        let before = ledger.clone();
        let next = [samples(12, 60_000), samples(10, 50_000)];
        ledger.record(&MODEL, &probes, (&[110, 100], &next), &[Some(false); 2]);
        let recent = ledger.since(&before).costs(&probes);
        assert_eq!(recent.len(), 1);
        assert_eq!(
            recent[0].added,
            Duration::from_nanos(409 * 10 + 10_000 + 263 * 2)
        );
    }

    /// A main thread's switches are priced for the thread and per perf
    /// event on it, from its first reading on, and count in its process's
    /// added time; those after its last reading, at its end, at the rate
    /// before.
    #[test]
    fn context_switches_are_priced_for_the_thread_and_per_perf_event() {
        let probes = [probe("free", true, ReturnHalf::None)];
        let mut ledger = CostLedger::default();
        let events = HashMap::from([(1, 4)]);
        let switches = std::cell::Cell::new(1_000);
        let read = |_| Some(switches.get());
        let start = Instant::now();
        let at = |seconds| start + Duration::from_secs(seconds);
        ledger.record_switches(&MODEL, &events, read, at(0));
        assert_eq!(ledger.switch_costs(), (0, Duration::ZERO));
        let before = ledger.clone();
        switches.set(1_500);
        ledger.record_switches(&MODEL, &events, read, at(1));
        ledger.record(&MODEL, &probes, (&[10], &[]), &[Some(false)]);
        let per_switch = 600 + 4 * 150;
        let added = Duration::from_nanos(500 * per_switch);
        assert_eq!(ledger.switch_costs(), (500, added));
        assert_eq!(ledger.since(&before).switch_costs(), (500, added));
        let process = ledger.per_process(&probes)[&1];
        assert_eq!(process.0, 10);
        let probe_time = Duration::from_nanos(371 * 10);
        assert!((process.1 - (added + probe_time).as_secs_f64()).abs() < 1e-12);
        // Gone: /proc no longer counts; its end, half a second on, adds
        // 500 a second for that half second, once.
        ledger.record_switches(&MODEL, &events, |_| None, at(2));
        assert_eq!(ledger.switch_costs(), (500, added));
        let end = at(1) + Duration::from_millis(500);
        ledger.process_ended(1, end);
        ledger.process_ended(1, at(3));
        let with_tail = Duration::from_nanos(750 * per_switch);
        assert_eq!(ledger.switch_costs(), (750, with_tail));
        // Its pid read again (the events not yet gone) adds nothing.
        ledger.record_switches(&MODEL, &events, read, at(4));
        assert_eq!(ledger.switch_costs(), (750, with_tail));
    }

    /// `/metrics` names a switch's price only where one was timed.
    #[test]
    fn a_switch_is_priced_in_metrics_only_where_timed() {
        let kinds = |model: CostModel| -> Vec<&str> {
            model.measured_kinds().into_iter().map(|(k, _)| k).collect()
        };
        assert!(kinds(MODEL).contains(&"switch_per_perf_event"));
        assert!(kinds(MODEL).contains(&"switch_of_thread_with_perf_events"));
        let untimed = CostModel {
            switch_per_thread: Duration::ZERO,
            switch_per_event: Duration::ZERO,
            ..MODEL
        };
        assert_eq!(kinds(untimed).len(), 6);
        assert!(!kinds(untimed).contains(&"switch_per_perf_event"));
        assert!(untimed.to_string().ends_with("0.20 µs a forced return"));
        assert!(kinds(CostModel::default()).is_empty());
    }
}
