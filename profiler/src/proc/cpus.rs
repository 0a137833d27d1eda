//! Sets of CPUs, and the CPUs a task may run on (its affinity).
use std::fmt;

/// A set of CPU numbers, as `sched_getaffinity` gives and takes them.
#[derive(Clone, Copy)]
pub struct CpuSet(libc::cpu_set_t);

impl CpuSet {
    /// The most CPUs a set holds.
    const CAPACITY: usize = libc::CPU_SETSIZE as usize;

    fn empty() -> Self {
        // SAFETY: a zeroed cpu_set_t is the empty set.
        Self(unsafe { std::mem::zeroed() })
    }

    /// The set of one CPU (`None` past the set's capacity).
    pub fn one(cpu: usize) -> Option<Self> {
        let mut set = Self::empty();
        set.insert(cpu)?;
        Some(set)
    }

    /// Adds `cpu` (`None` past the set's capacity).
    fn insert(&mut self, cpu: usize) -> Option<()> {
        (cpu < Self::CAPACITY).then(|| {
            // SAFETY: `cpu` is within the set's bounds.
            unsafe { libc::CPU_SET(cpu, &mut self.0) }
        })
    }

    pub fn contains(&self, cpu: usize) -> bool {
        // SAFETY: `cpu` is within the set's bounds.
        cpu < Self::CAPACITY && unsafe { libc::CPU_ISSET(cpu, &self.0) }
    }

    /// The CPUs in the set, lowest first.
    pub fn iter(&self) -> impl Iterator<Item = usize> + '_ {
        (0..Self::CAPACITY).filter(|&cpu| self.contains(cpu))
    }

    pub fn is_empty(&self) -> bool {
        self.iter().next().is_none()
    }

    pub fn union(&self, other: &Self) -> Self {
        self.iter().chain(other.iter()).collect()
    }

    /// The CPUs of `self` not in `other`.
    pub fn minus(&self, other: &Self) -> Self {
        self.iter().filter(|&cpu| !other.contains(cpu)).collect()
    }

    /// The CPUs thread `tid` may run on (0: the calling thread); `None` if
    /// the thread is gone.
    pub fn of_thread(tid: u32) -> Option<Self> {
        let tid = libc::pid_t::try_from(tid).ok()?;
        let mut set = Self::empty();
        let size = std::mem::size_of::<libc::cpu_set_t>();
        // SAFETY: a whole cpu_set_t of `size` bytes, filled in by the kernel.
        (unsafe { libc::sched_getaffinity(tid, size, &mut set.0) } == 0).then_some(set)
    }

    /// Keeps thread `tid` (0: the calling thread) to the set's CPUs; the
    /// threads it starts afterwards inherit them. `None` if the kernel
    /// refused (a CPU offline or outside the thread's cpuset).
    pub fn keep_thread(&self, tid: u32) -> Option<()> {
        let tid = libc::pid_t::try_from(tid).ok()?;
        let size = std::mem::size_of::<libc::cpu_set_t>();
        // SAFETY: `self.0` is a whole cpu_set_t of `size` bytes.
        (unsafe { libc::sched_setaffinity(tid, size, &self.0) } == 0).then_some(())
    }
}

/// CPUs past the set's capacity are left out.
impl FromIterator<usize> for CpuSet {
    fn from_iter<I: IntoIterator<Item = usize>>(cpus: I) -> Self {
        let mut set = Self::empty();
        for cpu in cpus {
            set.insert(cpu);
        }
        set
    }
}

impl PartialEq for CpuSet {
    fn eq(&self, other: &Self) -> bool {
        self.iter().eq(other.iter())
    }
}

impl fmt::Debug for CpuSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CpuSet({self})")
    }
}

/// As `taskset -c` and /proc's `Cpus_allowed_list` write them: `0-3,6`.
impl fmt::Display for CpuSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut cpus = self.iter().peekable();
        let mut first = true;
        while let Some(start) = cpus.next() {
            let mut end = start;
            while cpus.peek() == Some(&(end + 1)) {
                end = cpus.next().unwrap_or(end);
            }
            let comma = if first { "" } else { "," };
            first = false;
            match end - start {
                0 => write!(f, "{comma}{start}")?,
                _ => write!(f, "{comma}{start}-{end}")?,
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(cpus: &[usize]) -> CpuSet {
        cpus.iter().copied().collect()
    }

    #[test]
    fn written_as_ranges_like_taskset() {
        assert_eq!(set(&[0, 1, 2, 3, 6, 8, 9]).to_string(), "0-3,6,8-9");
        assert_eq!(set(&[5]).to_string(), "5");
        assert_eq!(CpuSet::empty().to_string(), "");
    }

    #[test]
    fn union_and_difference() {
        let a = set(&[0, 1, 2]);
        let b = set(&[2, 3]);
        assert_eq!(a.union(&b), set(&[0, 1, 2, 3]));
        assert_eq!(a.minus(&b), set(&[0, 1]));
        assert!(b.minus(&set(&[2, 3, 4])).is_empty());
        assert_eq!(CpuSet::one(CpuSet::CAPACITY), None);
    }

    #[test]
    fn the_calling_threads_cpus_are_read_and_kept() {
        let mine = CpuSet::of_thread(0).unwrap();
        assert!(!mine.is_empty());
        // Run in a thread of its own: the test harness's other tests keep
        // theirs.
        std::thread::spawn(move || {
            let first = CpuSet::one(mine.iter().next().unwrap()).unwrap();
            first.keep_thread(0).unwrap();
            assert_eq!(CpuSet::of_thread(0).unwrap(), first);
            let inherited = std::thread::spawn(|| CpuSet::of_thread(0).unwrap());
            assert_eq!(inherited.join().unwrap(), first);
        })
        .join()
        .unwrap();
    }
}
