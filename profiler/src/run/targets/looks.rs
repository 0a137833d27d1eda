//! `--all`'s look at every process each second reads a process's maps
//! again only where they may have changed since: reading a big process's
//! maps walks each of its mappings, thousands in a JVM, under its
//! address space's lock, and a fleet host runs hundreds of processes.
use std::collections::{HashMap, HashSet};

use crate::proc::{MapsStamp, maps_stamp};

/// Each process's stamp when its maps were last read and dealt with.
#[derive(Default)]
pub(in crate::run) struct LastLooks(HashMap<u32, MapsStamp>);

impl LastLooks {
    /// `pid`'s stamp now, where its maps may have changed since its last
    /// look; `None` where they have not (or it is gone). A library mapped
    /// changes the stamp (its virtual size) but where something of the
    /// same size was unmapped at once; a process that maps code is told
    /// by the kernel besides (`probe_mapped_code`).
    pub(in crate::run) fn changed(&self, pid: u32) -> Option<MapsStamp> {
        let now = maps_stamp(pid)?;
        (self.0.get(&pid) != Some(&now)).then_some(now)
    }

    /// `pid`'s maps, read at `stamp`, were dealt with.
    pub(in crate::run) fn looked(&mut self, pid: u32, stamp: MapsStamp) {
        self.0.insert(pid, stamp);
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

    #[test]
    fn a_process_is_looked_at_again_once_its_maps_change() {
        let own = std::process::id();
        let mut looks = LastLooks::default();
        let stamp = looks.changed(own).expect("never looked at");
        looks.looked(own, stamp);
        assert_eq!(looks.changed(own), None);
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
        let changed = looks.changed(own);
        // SAFETY: the mapping made above, not used since.
        unsafe { libc::munmap(at, len) };
        assert!(changed.is_some());
        looks.keep_only(&[]);
        assert!(looks.changed(own).is_some());
    }
}
