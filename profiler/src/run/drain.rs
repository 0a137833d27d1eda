//! Events out of the ring buffer, into each process's heap. Copied out
//! first, a batch at a time, then handled: a copy takes a microsecond or
//! two and a sample's DWARF unwinding far longer, so the kernel gets the
//! ring's space back sooner, and a burst of samples finds it less often
//! over half full (where samples go without their stack copy).
use aya::maps::{MapData, RingBuf};

use crate::{
    collect::{HeapEvent, Sample},
    discover::AllocatorKind,
    kernel::events::{Event, KernelSample, decode},
    proc::read_maps,
    run::{Session, sampling::own_profiler},
};

impl Session<'_> {
    /// Handles one batch: at most the ring's size (`--ring-buffer`), so
    /// that memory stays bounded and a target that sends faster than
    /// memprobe handles cannot keep the event loop from signals and timers.
    /// Threads that ended are settled after it: their samples sent before
    /// their end were in the ring when they were taken, and a batch holds
    /// all that the ring held. Returns whether the ring was left empty.
    pub(super) fn drain(&mut self, ring: &mut RingBuf<MapData>) -> bool {
        let ended = self.probes.take_thread_exits();
        let most = self.options.kernel.ring_buffer_bytes as usize;
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
        for (pid, tid, allocated) in ended {
            self.thread_exited(pid, tid, allocated);
        }
        emptied
    }

    fn handle(&mut self, event: Event) {
        let pid = event.header().pid;
        if let Event::Sampled(sample) = &event {
            // Priced in the cost ledger, whoever it was for.
            self.probes
                .note_sample(sample.header.probe, sample.send_nanos);
        }
        // System-wide probes see processes before the next scan does;
        // memprobe's own allocations (glibc's, probed with `--all`) are
        // not profiled.
        if !self.tracked.contains_key(&pid)
            && self.scope.finds_processes()
            && pid != std::process::id()
        {
            let maps = read_maps(pid).unwrap_or_default();
            self.track(pid, maps);
        }
        if !self.tracked.contains_key(&pid) {
            return;
        }
        let Some(event) = self.heap_event(pid, event) else {
            return;
        };
        let Some(t) = self.tracked.get_mut(&pid) else {
            return;
        };
        let event = match self.sampling.windows_mut(pid) {
            Some(windows) => {
                if let HeapEvent::Sampled(sample) = &event
                    && sample.scale.is_none()
                {
                    windows.count_other(sample, t.heap.estimated_bytes(sample));
                }
                windows.hold(event)
            }
            None => Some(event),
        };
        if let Some(event) = event {
            t.heap.apply(event);
        }
    }

    /// What `event` of `pid` tells its heap; a mapping is kept with its
    /// other mappings instead.
    fn heap_event(&mut self, pid: u32, event: Event) -> Option<HeapEvent> {
        Some(match event {
            Event::Mapped(mapping) => {
                self.mapped_memory(mapping);
                return None;
            }
            Event::Unmapped { addr, len, .. } => {
                self.unmapped_memory(pid, addr, len);
                return None;
            }
            Event::Remapped {
                addr,
                len,
                new_addr,
                new_len,
                ..
            } => {
                self.remapped_memory(pid, (addr, len), (new_addr, new_len));
                return None;
            }
            Event::Sampled(sample) => self.finish_sample(pid, sample)?,
            Event::Returned {
                header,
                ptr,
                untracked,
            } => {
                self.forget_if_untracked(pid, header.probe, ptr);
                HeapEvent::Returned {
                    tid: header.tid,
                    time_ns: header.time_ns,
                    ptr,
                    untracked,
                }
            }
            Event::Freed {
                header,
                ptr,
                in_resize,
            } => HeapEvent::Freed {
                tid: header.tid,
                ptr,
                in_resize,
            },
            Event::Restored { header, ptr } => HeapEvent::Restored {
                tid: header.tid,
                ptr,
            },
            Event::Resized { ptr, new_size, .. } => HeapEvent::Resized { ptr, new_size },
            Event::PythonStack { header, frames } => {
                if let Some(python) = self.tracked.get_mut(&pid).and_then(|t| t.python.as_mut()) {
                    python.hold(header.tid, header.time_ns, frames);
                }
                return None;
            }
            Event::MappedCode { .. } => return None,
        })
    }

    /// A sample of `pid` made whole: its stack unwound, and what its probe
    /// samples (the allocator, the copy, the interval) looked up.
    fn finish_sample(&mut self, pid: u32, mut sample: KernelSample) -> Option<HeapEvent> {
        let fast_path = self.probes.frame_pointer_fast_path();
        let probe = self.probes.attached.get(sample.header.probe as usize);
        let t = self.tracked.get_mut(&pid)?;
        if t.comes_from_unmapped_code(&sample.frames) || t.stacks.needs_trampoline(&sample) {
            t.set_maps(read_maps(pid).ok());
        }
        let trusted = t.stacks.complete(&mut sample, fast_path, &mut t.heap.drops);
        if let Some(python) = &mut t.python {
            let header = &sample.header;
            let call = (header.tid, header.time_ns);
            python.complete(call, &mut sample.frames, &mut t.heap.drops);
        }
        let mut finished = Sample {
            tid: sample.header.tid,
            size: sample.size,
            align: sample.align,
            frames: sample.frames,
            stack_error: sample.stack_error,
            allocator: AllocatorKind::Jemalloc,
            window: sample.window,
            interval: None,
            copy: 0,
            scale: None,
        };
        if let Some(probe) = probe {
            finished.allocator = probe.allocator;
            finished.copy = probe.instance;
            // Weighed when its window closes.
            finished.scale = probe.windowed.then_some(1.0);
            if probe.shape == profiler_common::CallShape::OwnSample {
                let watched = self.sampling.of(pid).map_or(&[][..], |s| &s.watched);
                finished.interval = own_profiler::own_interval(watched, probe.instance);
            }
            if let Some(own_code) = &probe.own_code {
                t.drop_allocator_frames(&probe.path, own_code, &mut finished.frames);
            }
        }
        if let Some(trusted) = trusted {
            self.probes.trust_frame_pointers(pid, trusted);
        }
        Some(HeapEvent::Sampled(finished))
    }

    /// A sampled pointer returned to a process whose frees are no longer
    /// probed: the kernel's set forgets it (no free will take it out).
    fn forget_if_untracked(&mut self, pid: u32, probe: u32, ptr: u64) {
        let frees_dropped = self.budget.frees_dropped(pid);
        if frees_dropped && let Some(probe) = self.probes.attached.get(probe as usize) {
            self.probes.forget_sampled(pid, probe.instance, ptr);
        }
    }
}
