//! The clocks memprobe reads: the kernel programs' (`bpf_ktime_get_ns`,
//! CLOCK_MONOTONIC) and a thread's CPU time.

/// CLOCK_MONOTONIC in nanoseconds: the kernel's `bpf_ktime_get_ns` clock.
pub fn monotonic_ns() -> u64 {
    clock_ns(libc::CLOCK_MONOTONIC)
}

/// `clock`'s reading in nanoseconds.
pub fn clock_ns(clock: libc::clockid_t) -> u64 {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `now` is a valid timespec to write into.
    unsafe { libc::clock_gettime(clock, &mut now) };
    now.tv_sec as u64 * 1_000_000_000 + now.tv_nsec as u64
}
