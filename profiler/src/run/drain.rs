//! Events out of the ring buffer, into each process's heap. Copied out
//! first, a batch at a time, then handled: a copy takes a microsecond or
//! two and a sample's DWARF unwinding far longer, so the kernel gets the
//! ring's space back sooner, and a burst of samples finds it less often
//! over half full (where samples go without their stack copy).
use aya::maps::{MapData, RingBuf};

use crate::{
    kernel::{
        KernelOptions,
        events::{Event, decode},
    },
    proc::read_maps,
    run::{Session, Targets, own_sampling},
};

impl Session<'_> {
    /// Handles one batch: at most the ring's size, so that memory stays
    /// bounded and a target that sends faster than memprobe handles cannot
    /// keep the event loop from signals and timers. Returns whether the
    /// ring was left empty.
    pub(super) fn drain(&mut self, ring: &mut RingBuf<MapData>) -> bool {
        let most = KernelOptions::default().ring_buffer_bytes as usize;
        let (mut batch, mut bytes) = (Vec::new(), 0);
        let mut emptied = false;
        while bytes < most {
            let Some(record) = ring.next() else {
                emptied = true;
                break;
            };
            bytes += record.len();
            batch.extend(decode(&record));
        }
        let mut mapped: Vec<(u32, u64)> = Vec::new();
        for event in batch {
            match event {
                Event::MappedCode { header } => mapped.push((header.pid, header.time_ns)),
                event => self.handle(event),
            }
        }
        // One look per process, timed from its first mapping.
        mapped.sort_unstable();
        mapped.dedup_by_key(|(pid, _)| *pid);
        for (pid, mapped_at) in mapped {
            self.probe_mapped_code(pid, mapped_at);
        }
        emptied
    }

    fn handle(&mut self, mut event: Event) {
        let pid = event.header().pid;
        // System-wide probes see processes before the next scan does;
        // memprobe's own allocations (glibc's, probed with `--all`) are
        // not profiled.
        if !self.tracked.contains_key(&pid)
            && matches!(self.options.targets, Targets::All)
            && pid != std::process::id()
        {
            let maps = read_maps(pid).unwrap_or_default();
            self.track(pid, maps);
        }
        let Some(t) = self.tracked.get_mut(&pid) else {
            return;
        };
        if t.comes_from_unmapped_code(&event) || t.stacks.needs_trampoline(&event) {
            t.set_maps(read_maps(pid).ok());
        }
        let fast_path = self.probes.frame_pointer_fast_path();
        if let Some(trusted) = t.stacks.complete(&mut event, fast_path, &mut t.heap.drops) {
            self.probes.trust_frame_pointers(pid, trusted);
        }
        if let Event::Sampled {
            header,
            allocator,
            frames,
            interval,
            copy,
            scale,
            ..
        } = &mut event
            && let Some(probe) = self.probes.attached.get(header.probe as usize)
        {
            *allocator = probe.allocator;
            *copy = probe.instance;
            // Weighed when its window closes.
            *scale = probe.windowed.then_some(1.0);
            if probe.shape == profiler_common::CallShape::OwnSample {
                *interval = own_sampling::own_interval(&t.watched, probe.instance);
            }
            if let Some(own_code) = &probe.own_code {
                t.drop_allocator_frames(&probe.path, own_code, frames);
            }
        }
        if let Event::Returned { header, ptr, .. } = &event
            && t.frees_dropped.is_some()
            && let Some(probe) = self.probes.attached.get(header.probe as usize)
        {
            self.probes.forget_sampled(pid, probe.instance, *ptr);
        }
        let event = match &mut t.windows {
            Some(windows) => windows.hold(event),
            None => Some(event),
        };
        if let Some(event) = event {
            t.heap.apply(event);
        }
    }
}
