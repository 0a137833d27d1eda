//! Where memprobe's own threads run: off the CPUs its targets are kept to.
//!
//! A server pinned to its CPUs (`taskset`, a cpuset cgroup, a database's
//! own thread pinning) counts on having them to itself. memprobe's work
//! comes in bursts (reading a window's samples, unwinding them): on the
//! target's CPU each burst is a wait for a woken request, and the latency
//! bench's scheduler trace found memprobe behind 27% of redis-server's
//! waits over 0.5 ms while a window's samples were read. Run elsewhere,
//! memprobe delays only what is not pinned.
use crate::proc::{CpuSet, thread_ids};

/// The most threads of a target read: a process with more has its first
/// ones' CPUs stand for all (a thread pool shares one pinning).
const MAX_THREADS_READ: usize = 4096;

/// The CPUs memprobe moved to, for its status line.
#[derive(Debug, PartialEq)]
pub(super) struct OwnCpus {
    /// The CPUs memprobe keeps to now.
    pub(super) ours: CpuSet,
    /// The CPUs its targets may run on.
    pub(super) theirs: CpuSet,
}

/// Keeps every thread of memprobe (and the threads and processes it starts
/// afterwards) off the CPUs `pids`' threads may run on, when memprobe may
/// run on others too. `None` when it was not moved: the targets may run
/// anywhere memprobe may, their CPUs could not be read, or the kernel
/// refused.
pub(super) fn keep_off(pids: &[u32]) -> Option<OwnCpus> {
    let theirs = targets_cpus(pids)?;
    let mine = CpuSet::of_thread(0)?;
    let ours = away_from(&mine, &theirs)?;
    // The calling thread first: whether the kernel takes the set at all.
    ours.keep_thread(0)?;
    // Twice: a thread started while the first pass ran inherits from its
    // starter, which may not have been moved yet. A thread that ended
    // between being listed and being moved is not a refusal.
    for _ in 0..2 {
        for tid in thread_ids(std::process::id()) {
            if CpuSet::of_thread(tid).is_some_and(|cpus| cpus != ours) {
                let _ = ours.keep_thread(tid);
            }
        }
    }
    Some(OwnCpus { ours, theirs })
}

/// The CPUs any thread of `pids` may run on; `None` if none was read.
fn targets_cpus(pids: &[u32]) -> Option<CpuSet> {
    pids.iter()
        .flat_map(|&pid| thread_ids(pid).into_iter().take(MAX_THREADS_READ))
        .filter_map(CpuSet::of_thread)
        .reduce(|all, cpus| all.union(&cpus))
}

/// The CPUs of `mine` to move to, away from `theirs`: `None` when that
/// leaves none, or when `mine` holds none of theirs (nothing to leave).
fn away_from(mine: &CpuSet, theirs: &CpuSet) -> Option<CpuSet> {
    let ours = mine.minus(theirs);
    (!ours.is_empty() && ours != *mine).then_some(ours)
}

impl OwnCpus {
    pub(super) fn status_line(&self) -> String {
        format!(
            "memprobe: running on CPUs {}, off the CPUs its targets are kept to ({})",
            self.ours, self.theirs
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(cpus: &[usize]) -> CpuSet {
        cpus.iter().copied().collect()
    }

    #[test]
    fn moves_only_where_cpus_are_left_and_something_is_left_behind() {
        assert_eq!(
            away_from(&set(&[0, 1, 2, 3]), &set(&[0])),
            Some(set(&[1, 2, 3]))
        );
        // A target that may run anywhere: nowhere to go.
        assert_eq!(away_from(&set(&[0, 1]), &set(&[0, 1])), None);
        // memprobe already kept elsewhere (by the user's taskset).
        assert_eq!(away_from(&set(&[2, 3]), &set(&[0, 1])), None);
        assert_eq!(away_from(&set(&[1, 2]), &set(&[0, 1])), Some(set(&[2])));
    }

    #[test]
    fn a_pinned_childs_cpus_are_left_to_it() {
        let mine = CpuSet::of_thread(0).unwrap();
        let Some(first) = mine.iter().next().filter(|_| mine.iter().count() > 1) else {
            eprintln!("one CPU only: nothing to move to");
            return;
        };
        let mut child = std::process::Command::new("taskset")
            .args(["-c", &first.to_string(), "sleep", "30"])
            .spawn()
            .unwrap();
        std::thread::sleep(std::time::Duration::from_millis(200));
        // `keep_off` would move the test harness's own threads: its parts
        // are checked here, the whole in the integration tests.
        let theirs = targets_cpus(&[child.id()]).unwrap();
        let _ = child.kill();
        let _ = child.wait();
        assert_eq!(theirs, CpuSet::one(first).unwrap());
        assert_eq!(away_from(&mine, &theirs), Some(mine.minus(&theirs)));
    }
}
