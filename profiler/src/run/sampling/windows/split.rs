//! A jemalloc copy split for sampling in windows: `malloc` and `operator
//! new` for the windows, its thread counters' place told to the kernel;
//! or why it is sampled at entry instead.
use std::time::{Duration, Instant};

use profiler_common::tls;

use crate::{
    discover::{
        Allocator,
        fast_path::TlsOffset,
        large_requests::{LargeRequestsProbe, SMALL_MAX_CLASS},
    },
    kernel::Scope,
    run::{Sampling, Session},
};

impl Session<'_> {
    /// `--sampling windows`: this jemalloc copy's parts for sampling in
    /// windows (see `run::sampling::windows`), with the kernel told where `pid`'s
    /// threads keep their counters; or why it is sampled at entry (other
    /// allocators, unrecognised builds, system-wide probes, a process not
    /// started yet).
    pub(in crate::run) fn windowed_parts(
        &mut self,
        scope: Scope,
        path: &str,
        allocator: &Allocator,
        instance: u16,
    ) -> Result<WindowedParts, &'static str> {
        let Scope::Process(pid) = scope else {
            return Err("system-wide probes");
        };
        if self.options.sampling == Sampling::Entry {
            return Err("--sampling entry");
        }
        if !self.probes.knows_fsbase() {
            return Err("the kernel's BTF does not place a task's fs base");
        }
        let not_recognised = "its malloc fast path is not a jemalloc 5.3 build memprobe recognises";
        let served = allocator.windowed_part().ok_or(not_recognised)?;
        let slow = allocator.fast_path.as_ref().ok_or(not_recognised)?;
        let fast = slow.fast;
        let maps = self.tracked.get(&pid).map(|t| t.maps.as_str());
        let not_started = "its TLS offset is not in its GOT yet: a process not started";
        let unrelocated = "its loader had not filled its GOT after 200 ms";
        let read_got = |file_offset| {
            let maps = maps.ok_or(not_started)?;
            read_relocated_word(pid, maps, path, file_offset).ok_or(unrelocated)
        };
        // The TLS module (0: static TLS), and the counter block's place
        // from the fs base or in the module's block.
        let (tls_module, tls) = match fast.tls {
            TlsOffset::Immediate(offset) => (0, offset),
            TlsOffset::GotSlot(file_offset) => (0, read_got(file_offset)? as i64),
            TlsOffset::TlsIndex(file_offset) => {
                let module = read_got(file_offset)?;
                let offset = maps.and_then(|m| read_mapped_word(pid, m, path, file_offset + 8));
                (module, offset.ok_or(unrelocated)? as i64)
            }
        };
        let large = maps
            .zip(slow.large_requests.as_ref())
            .and_then(|(maps, l)| read_large_requests(pid, maps, path, l));
        let config = profiler_common::FastPathConfig {
            allocated: tls.wrapping_add(fast.allocated),
            tls_module,
            large_above: large.map_or(fast.large_above, |l| l.above),
            window_shift: 0,
            window: 0,
            callers: large.map_or([0, 0], |l| l.callers),
        };
        if !self.probes.set_fast_path(pid, instance, config) {
            return Err("the kernel's table of fast paths is full");
        }
        Ok(WindowedParts {
            served,
            config,
            large_requests: large.is_some(),
        })
    }
}

impl Session<'_> {
    /// Each thread of `pid` that has started, where it keeps the counter
    /// `config` places and that counter now, read through `/proc/PID/mem`
    /// (never written); none where the kernel cannot list threads.
    pub(super) fn thread_counters(
        &mut self,
        pid: u32,
        config: &profiler_common::FastPathConfig,
    ) -> Vec<ThreadCounter> {
        let Some(bases) = self.probes.thread_bases(pid) else {
            return Vec::new();
        };
        let Some(memory) = crate::proc::ProcessMemory::open(pid) else {
            return Vec::new();
        };
        bases
            .into_iter()
            .filter_map(|(tid, fsbase)| {
                let at = tls::counter_address(config, fsbase, |at| memory.read_word(at))?;
                Some(ThreadCounter {
                    tid,
                    at,
                    allocated: memory.read_word(at)?,
                })
            })
            .collect()
    }
}

/// One thread's jemalloc allocated-bytes counter: where, and its value.
#[derive(Clone, Copy, Debug)]
pub(super) struct ThreadCounter {
    pub tid: u32,
    pub at: u64,
    pub allocated: u64,
}

/// A jemalloc copy split for sampling in windows: the entry points the
/// windows attach (`malloc`, `operator new`), and its counters as the
/// kernel was told them.
pub(in crate::run) struct WindowedParts {
    pub served: Allocator,
    pub config: profiler_common::FastPathConfig,
    /// Whether the slow path is probed where it sends the requests no
    /// thread cache holds (else at its entry).
    pub large_requests: bool,
}

/// A copy's large requests as its process has them: above what, and
/// coming from where.
#[derive(Clone, Copy)]
struct LargeRequestsIn {
    above: u64,
    callers: [u64; 2],
}

/// Largest `tcache_maxclass` jemalloc 5.3 takes (`TCACHE_MAXCLASS_LIMIT`).
const MAX_CACHED: u64 = 8 << 20;

/// Reads `pid`'s `tcache_maxclass` (set as jemalloc starts: 0 before) and
/// places its slow path; `None` where either cannot be.
fn read_large_requests(
    pid: u32,
    maps: &str,
    path: &str,
    large: &LargeRequestsProbe,
) -> Option<LargeRequestsIn> {
    let base = crate::proc::file_base(maps, path, large.anchor)?;
    let cached = read_word(pid, base.checked_add(large.limit)?)?;
    if cached == 0 || cached > MAX_CACHED {
        return None;
    }
    let len = large.callers.end - large.callers.start;
    let start = crate::proc::mapped_address(maps, path, large.callers.start, len)?;
    Some(LargeRequestsIn {
        above: cached.max(SMALL_MAX_CLASS),
        callers: [start, start + len],
    })
}

/// How long a GOT slot of a library just mapped is waited for.
const RELOCATION_WAIT: Duration = Duration::from_millis(200);

/// The GOT slot at `file_offset` of `path` in `pid` (a TLS offset or
/// module id, never 0), once the dynamic linker filled it. A copy found as
/// its library is mapped (`dlopen`) is relocated a moment later, the
/// process running on: waited for, up to [`RELOCATION_WAIT`]. Read as it
/// was mapped, the slot held 0, an offset that placed every thread's
/// counter inside its thread descriptor.
fn read_relocated_word(pid: u32, maps: &str, path: &str, file_offset: u64) -> Option<u64> {
    let started = Instant::now();
    loop {
        let word = read_mapped_word(pid, maps, path, file_offset)?;
        if word != 0 {
            return Some(word);
        }
        if started.elapsed() >= RELOCATION_WAIT {
            return None;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// The word at `file_offset` of `path` as `pid` has it mapped, read from
/// `/proc/PID/mem`: read, never written.
fn read_mapped_word(pid: u32, maps: &str, path: &str, file_offset: u64) -> Option<u64> {
    read_word(
        pid,
        crate::proc::mapped_address(maps, path, file_offset, 8)?,
    )
}

/// The word at `address` in `pid`, read from `/proc/PID/mem`.
fn read_word(pid: u32, address: u64) -> Option<u64> {
    crate::proc::ProcessMemory::open(pid)?.read_word(address)
}
