//! `--all`'s look at every process each second reads a process's maps
//! again only where they may have changed since: reading a big process's
//! maps walks each of its mappings, thousands in a JVM, under its
//! address space's lock, and a fleet host runs hundreds of processes.
use std::{
    collections::{HashMap, HashSet},
    time::{Duration, Instant},
};

use crate::proc::{MapsStamp, maps_stamp};

/// However unchanged its stamp, a process's maps are read again this long
/// after its last look (plus up to a minute, by pid, so that the processes
/// met at the first scan are not all read again in the same second): a
/// library mapped as something of its size was unmapped leaves the stamp
/// as it was. A fifth of a second of CPU every five minutes beside 150
/// processes of 2,000 mappings each.
const LOOK_AGAIN_AFTER: Duration = Duration::from_secs(300);

/// Each process's stamp when its maps were last read and dealt with, and
/// when.
#[derive(Default)]
pub(in crate::run) struct LastLooks(HashMap<u32, (MapsStamp, Instant)>);

impl LastLooks {
    /// `pid`'s stamp at `now`, where its maps may have changed since its
    /// last look; `None` where they have not (or it is gone). A library
    /// mapped changes the stamp (its virtual size), and a process that
    /// maps code is told by the kernel besides (`probe_mapped_code`); the
    /// rest is left to [`LOOK_AGAIN_AFTER`].
    pub(in crate::run) fn changed(&self, pid: u32, now: Instant) -> Option<MapsStamp> {
        let stamp = maps_stamp(pid)?;
        let spread = Duration::from_secs(u64::from(pid % 60));
        let fresh = self.0.get(&pid).is_some_and(|&(last, at)| {
            last == stamp && now.saturating_duration_since(at) < LOOK_AGAIN_AFTER + spread
        });
        (!fresh).then_some(stamp)
    }

    /// `pid`'s maps, read at `stamp`, were dealt with at `now`.
    pub(in crate::run) fn looked(&mut self, pid: u32, stamp: MapsStamp, now: Instant) {
        self.0.insert(pid, (stamp, now));
    }

    /// Forgets the processes gone: the table holds one entry per live
    /// process at most.
    pub(in crate::run) fn keep_only(&mut self, pids: &[u32]) {
        let live: HashSet<&u32> = pids.iter().collect();
        self.0.retain(|pid, _| live.contains(pid));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A `sleep` whose loader is done: its maps stay as they are (this
    /// process's own change whenever another test's thread starts).
    fn quiet_process() -> std::process::Child {
        let child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .expect("sleep runs");
        std::thread::sleep(Duration::from_millis(200));
        child
    }

    #[test]
    fn a_process_is_looked_at_again_once_its_maps_change() {
        let own = std::process::id();
        let now = Instant::now();
        let mut looks = LastLooks::default();
        let stamp = looks.changed(own, now).expect("never looked at");
        looks.looked(own, stamp, now);
        // 64 MiB mapped: the virtual size moves.
        let len = 64 << 20;
        // SAFETY: a fresh anonymous mapping of our own, unmapped below.
        let at = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(at, libc::MAP_FAILED);
        let changed = looks.changed(own, now);
        // SAFETY: the mapping made above, not used since.
        unsafe { libc::munmap(at, len) };
        assert!(changed.is_some_and(|c| c != stamp));
    }

    #[test]
    fn an_unchanged_process_is_looked_at_again_only_after_a_while() {
        let mut quiet = quiet_process();
        let pid = quiet.id();
        let now = Instant::now();
        let mut looks = LastLooks::default();
        let stamp = looks.changed(pid, now).expect("never looked at");
        looks.looked(pid, stamp, now);
        let unchanged = looks.changed(pid, now);
        let within = looks.changed(pid, now + LOOK_AGAIN_AFTER - Duration::from_secs(1));
        let past = looks.changed(pid, now + LOOK_AGAIN_AFTER + Duration::from_secs(60));
        looks.keep_only(&[]);
        let forgotten = looks.changed(pid, now);
        let _ = quiet.kill();
        let _ = quiet.wait();
        assert_eq!((unchanged, within), (None, None));
        assert_eq!(past, Some(stamp));
        assert_eq!(forgotten, Some(stamp));
    }
}
