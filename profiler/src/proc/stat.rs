//! A process's times and state as the kernel counts them: `stat`,
//! `statm`, `status` and `schedstat` under `/proc/PID`, and `/proc/stat`.
use std::time::Duration;

use super::{maps::maps_stamp, proc_path};

/// How often the process's main thread (the task whose id is `pid`) has
/// been switched out, voluntarily or not; `None` once it is gone.
pub fn main_thread_switches(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(proc_path(pid, &format!("task/{pid}/status"))).ok()?;
    context_switches(&status)
}

/// `pid`'s resident bytes (`statm`: the kernel's counters, no walk of its
/// page tables); `None` once it is gone.
pub fn resident_bytes(pid: u32) -> Option<u64> {
    let statm = std::fs::read_to_string(proc_path(pid, "statm")).ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    Some(pages * page.max(1) as u64)
}

/// The CPU time `pid` has used so far, all its threads, user and system
/// (probe traps included: they run in its threads), in seconds.
pub fn cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(proc_path(pid, "stat")).ok()?;
    cpu_ticks(&stat).map(tick_seconds)
}

/// Clock ticks, the unit of `stat`'s times, in seconds.
fn tick_seconds(ticks: u64) -> f64 {
    // SAFETY: sysconf has no preconditions.
    let per_second = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    ticks as f64 / per_second.max(1) as f64
}

/// The time `pid`'s threads have spent on a CPU so far, in nanoseconds
/// (each thread's `schedstat`: precise where `stat` counts clock ticks, so
/// a span of a few milliseconds reads true); `None` once it is gone.
pub fn run_nanos(pid: u32) -> Option<u64> {
    let tasks = std::fs::read_dir(proc_path(pid, "task")).ok()?;
    let total = tasks
        .filter_map(|task| {
            let stat = std::fs::read_to_string(task.ok()?.path().join("schedstat")).ok()?;
            stat.split_whitespace().next()?.parse::<u64>().ok()
        })
        .sum();
    Some(total)
}

/// Each CPU's busy time so far, in clock ticks, by CPU number (`None`
/// where /proc/stat cannot be read).
pub fn cpu_busy_ticks() -> Option<Vec<(usize, u64)>> {
    std::fs::read_to_string("/proc/stat")
        .ok()
        .map(|stat| parse_cpu_busy(&stat))
}

/// The `cpuN` lines of /proc/stat: user, nice, system, idle, iowait, irq,
/// softirq, steal (then guest times, already within user and nice), busy
/// being all but idle and iowait (stolen time is a CPU not to be had).
fn parse_cpu_busy(stat: &str) -> Vec<(usize, u64)> {
    const IDLE: usize = 3;
    const IOWAIT: usize = 4;
    stat.lines()
        .filter_map(|line| {
            let mut fields = line.split_whitespace();
            let cpu = fields.next()?.strip_prefix("cpu")?.parse().ok()?;
            let mut busy = 0;
            for (index, field) in fields.take(8).enumerate() {
                let ticks: u64 = field.parse().ok()?;
                if index != IDLE && index != IOWAIT {
                    busy += ticks;
                }
            }
            Some((cpu, busy))
        })
        .collect()
}

/// How long ago `pid` started, to a clock tick (its `stat` start time
/// against the system's uptime); `None` once it is gone.
pub fn age(pid: u32) -> Option<Duration> {
    let started = maps_stamp(pid)?.started;
    let uptime = std::fs::read_to_string("/proc/uptime").ok()?;
    let uptime: f64 = uptime.split_whitespace().next()?.parse().ok()?;
    let since = uptime - tick_seconds(started);
    Some(Duration::from_secs_f64(since.max(0.0)))
}

/// Whether `pid` has ended: gone, or a zombie (state `Z` or `X` in
/// `stat`), whose files and memory are no longer there to probe.
pub fn has_ended(pid: u32) -> bool {
    let Ok(stat) = std::fs::read_to_string(proc_path(pid, "stat")) else {
        return true;
    };
    let state = stat_fields(&stat).and_then(|mut fields| fields.next());
    matches!(state, None | Some("Z" | "X"))
}

/// A `stat` line's fields from the third (the state) on: those after the
/// command's closing parenthesis, since a command may hold spaces and ')'.
pub(super) fn stat_fields(stat: &str) -> Option<std::str::SplitWhitespace<'_>> {
    Some(stat.rsplit_once(')')?.1.split_whitespace())
}

/// utime + stime from a `stat` line: fields 14 and 15.
fn cpu_ticks(stat: &str) -> Option<u64> {
    let mut fields = stat_fields(stat)?.skip(11);
    let utime: u64 = fields.next()?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    Some(utime + stime)
}

/// The sum of `voluntary_ctxt_switches` and `nonvoluntary_ctxt_switches`
/// in a task's `status` text.
fn context_switches(status: &str) -> Option<u64> {
    let count = |name: &str| -> Option<u64> {
        let line = status.lines().find(|l| l.starts_with(name))?;
        line[name.len()..].trim().parse().ok()
    };
    Some(count("voluntary_ctxt_switches:")? + count("nonvoluntary_ctxt_switches:")?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_ticks_are_read_past_a_command_with_spaces_and_parentheses() {
        let stat = "4242 (a b) c) S 1 4242 4242 0 -1 4194560 100 0 0 0 250 37 0 0 20 0 3";
        assert_eq!(cpu_ticks(stat), Some(287));
        assert!(cpu_seconds(std::process::id()).is_some());
    }

    #[test]
    fn a_cpu_is_busy_but_for_idle_and_iowait() {
        let stat = "cpu  10 1 5 100 7 2 3 4 0 0\n\
                    cpu0 6 1 3 50 7 1 2 4 9 0\n\
                    cpu1 4 0 2 50 0 1 1 0 0 0\n\
                    intr 12345 0 1\n";
        assert_eq!(parse_cpu_busy(stat), vec![(0, 17), (1, 8)]);
        let cpus = cpu_busy_ticks().unwrap();
        assert!(!cpus.is_empty(), "{cpus:?}");
    }

    #[test]
    fn a_process_s_age_counts_from_its_start() {
        let mut child = std::process::Command::new("sleep")
            .arg("5")
            .spawn()
            .unwrap();
        let young = age(child.id()).unwrap();
        let _ = child.kill();
        let _ = child.wait();
        // A clock tick's rounding either way.
        assert!(young < Duration::from_millis(500), "{young:?}");
        assert_eq!(age(u32::MAX), None);
    }

    #[test]
    fn a_zombie_or_a_reaped_process_has_ended() {
        assert!(!has_ended(std::process::id()));
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        // Not waited for yet: a zombie once it exits.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while !has_ended(pid) {
            assert!(std::time::Instant::now() < deadline, "{pid} never ended");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        child.wait().unwrap();
        assert!(has_ended(pid));
    }

    #[test]
    fn context_switches_add_both_kinds() {
        let status = "Name:\tdemo\nvoluntary_ctxt_switches:\t120\nnonvoluntary_ctxt_switches:\t3\n";
        assert_eq!(context_switches(status), Some(123));
        assert_eq!(context_switches("Name:\tdemo\n"), None);
        let own = main_thread_switches(std::process::id());
        assert!(own.is_some(), "{own:?}");
    }
}
