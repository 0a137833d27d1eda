//! What the kernel programs count: per entry point, its hits (and, from
//! their records, its samples' time); for the run, its calls, samples and
//! drops ([`Counter`]), each per CPU.
use aya::maps::PerCpuArray;
use profiler_common::{Counter, maps};

use crate::kernel::KernelProbes;

/// The kernel's counters, each read by its [`Counter`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KernelCounters([u64; Counter::COUNT as usize]);

impl KernelCounters {
    pub fn get(&self, counter: Counter) -> u64 {
        self.0[counter as usize]
    }
}

/// One entry point's sampled calls as their records arrived, and what its
/// program spent on them as the kernel timed each (`send_nanos`): a sample
/// costs the thread far more than an unsampled hit (its Python frames, a
/// stack copy, a record), and a window samples densely.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ProbeSamples {
    pub calls: u64,
    pub nanos: u64,
}

impl KernelProbes {
    /// Counts a sampled call's record of probe `probe` (its index), which
    /// its program spent `nanos` on.
    pub fn note_sample(&mut self, probe: u32, nanos: u64) {
        let index = probe as usize;
        if index >= self.attached.len() {
            return;
        }
        if self.samples.len() <= index {
            self.samples.resize(index + 1, ProbeSamples::default());
        }
        let samples = &mut self.samples[index];
        samples.calls += 1;
        samples.nanos += nanos;
    }

    /// Sampled calls of each attached entry point and the time its program
    /// spent on them, in the order of [`attached`](Self::attached).
    pub fn probe_samples(&self) -> Vec<ProbeSamples> {
        let mut samples = self.samples.clone();
        samples.resize(self.attached.len(), ProbeSamples::default());
        samples
    }

    /// Hits of each attached entry point, summed over CPUs, in the order of
    /// [`attached`](Self::attached).
    pub fn probe_hits(&self) -> Vec<u64> {
        (0..self.attached.len())
            .map(|index| self.hits_of(index).unwrap_or(0))
            .collect()
    }

    /// Hits of attached entry point `index`, summed over CPUs: one read,
    /// where a process's own few are wanted (its windows are judged once a
    /// second, and an agent watches many processes).
    pub fn hits_of(&self, index: usize) -> Option<u64> {
        let map = self.ebpf.map(maps::PROBE_HITS)?;
        let counters = PerCpuArray::<_, u64>::try_from(map).ok()?;
        let values = counters.get(&u32::try_from(index).ok()?, 0).ok()?;
        Some(values.iter().sum())
    }

    /// Sampled calls of attached entry point `index`, and their time.
    pub fn samples_of(&self, index: usize) -> ProbeSamples {
        self.samples.get(index).copied().unwrap_or_default()
    }

    /// Hits of the calibration's probes (the last counter slot), since the
    /// counters were last reset.
    pub fn calibration_hits(&self) -> u64 {
        let slot = profiler_common::MAX_COUNTED_PROBES - 1;
        self.hits_of(slot as usize).unwrap_or(0)
    }

    /// Zeroes the kernel counters and the hit counts: what calibration
    /// counted is not the targets'.
    pub fn reset_counters(&mut self) {
        for (name, slots) in [
            (maps::COUNTERS, Counter::COUNT),
            (maps::PROBE_HITS, profiler_common::MAX_COUNTED_PROBES),
        ] {
            let Some(map) = self.ebpf.map_mut(name) else {
                continue;
            };
            let Ok(mut counters) = PerCpuArray::<_, u64>::try_from(map) else {
                continue;
            };
            let cpus = aya::util::nr_cpus().map_or(1, |n| n.max(1));
            for index in 0..slots {
                if let Ok(zeros) = aya::maps::PerCpuValues::try_from(vec![0u64; cpus]) {
                    let _ = counters.set(index, zeros, 0);
                }
            }
        }
    }

    /// Kernel counters summed over CPUs.
    pub fn counters(&self) -> KernelCounters {
        let mut totals = KernelCounters::default();
        let Some(map) = self.ebpf.map(maps::COUNTERS) else {
            return totals;
        };
        let Ok(counters) = PerCpuArray::<_, u64>::try_from(map) else {
            return totals;
        };
        for counter in Counter::ALL {
            if let Ok(values) = counters.get(&(counter as u32), 0) {
                totals.0[counter as usize] = values.iter().sum();
            }
        }
        totals
    }
}
