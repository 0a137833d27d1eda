//! Live heap on request. Under `--track allocations` (the host agent's
//! setup) no free is probed: a process pays for its allocations alone, and
//! its profile's in use is what it allocated. A delta asked of the
//! endpoints (`/debug/pprof/heap?seconds=N`) has its process's frees
//! followed for those N seconds: each of its allocator copies is attached
//! again with its free probes and its return halves, so that the delta's
//! in use is what was allocated in the span and is still live at its end.
//! Then the copies go back to allocations only, and the cost with them.
//! Resident growth asks the same (`--dump-on-growth rss:...`): its frees
//! are followed for `--follow-on-growth`, and the delta over that span is
//! written as a snapshot: what grew.
//!
//! The same re-attaching serves the budget's second step: a process whose
//! frees it dropped has its copies attached again in their
//! allocations-only form.
use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    time::{Duration, Instant, SystemTime},
};

use crate::{
    discover::Allocator,
    kernel::Scope,
    profile::HeapProfile,
    run::{
        Session,
        notice::{FollowCause, SamplingNotice},
        snapshots::{SnapshotKind, writer::Announce},
    },
};

/// One allocator copy attached the usual way (memprobe's own sampling),
/// as needed to attach it again in the other mode.
#[derive(Debug)]
pub(in crate::run) struct UsualCopy {
    path: String,
    open_path: PathBuf,
    /// Its entry points as attached (jemalloc's slow path standing in for
    /// `malloc` in windows): frees and return halves follow the process's
    /// tracking when attached again.
    probed: Allocator,
    instance: u16,
    /// Every probe index the copy has held: attached again, each entry
    /// point takes back the one it held.
    slots: Vec<usize>,
}

impl UsualCopy {
    pub fn new(
        (path, open_path): (&str, &Path),
        probed: &Allocator,
        instance: u16,
        slots: Vec<usize>,
    ) -> Self {
        Self {
            path: path.to_owned(),
            open_path: open_path.to_owned(),
            probed: probed.clone(),
            instance,
            slots,
        }
    }
}

/// Since when and until when a process's frees are followed.
#[derive(Debug, Clone, Copy)]
struct Followed {
    since: SystemTime,
    until: Instant,
}

/// A process's frees followed since its resident memory grew: its profile
/// then, and why.
#[derive(Debug)]
struct GrowthSpan {
    before: HeapProfile,
    since: Instant,
    growth: String,
}

/// Per process: its usual copies, and the span its frees are followed.
#[derive(Debug, Default)]
pub(in crate::run) struct FreesOnRequest {
    copies: BTreeMap<u32, Vec<UsualCopy>>,
    followed: BTreeMap<u32, Followed>,
    /// Spans asked by resident growth, whose delta is written at their end.
    growth: BTreeMap<u32, GrowthSpan>,
    /// The last span each process's frees were followed, once over.
    last: BTreeMap<u32, (SystemTime, SystemTime)>,
}

impl FreesOnRequest {
    pub fn record(&mut self, pid: u32, copy: UsualCopy) {
        self.copies.entry(pid).or_default().push(copy);
    }

    /// Forgets copy `instance` of `pid` (attached another way since).
    pub fn forget_copy(&mut self, pid: u32, instance: u16) {
        if let Some(copies) = self.copies.get_mut(&pid) {
            copies.retain(|c| c.instance != instance);
        }
    }

    /// Forgets `pid`, which exited or was detached.
    pub fn forget(&mut self, pid: u32) {
        self.copies.remove(&pid);
        self.followed.remove(&pid);
        self.growth.remove(&pid);
        self.last.remove(&pid);
    }

    /// The profile's `# tracking:` note for a process tracked for its
    /// allocations only.
    pub fn note(&self, pid: u32) -> String {
        let clock = |t: SystemTime| humantime::format_rfc3339_seconds(t).to_string();
        match (self.followed.get(&pid), self.last.get(&pid)) {
            (Some(now), _) => format!(
                "allocations and frees since {} (asked through /debug/pprof/heap?seconds=), \
                 allocations only before (--track allocations)",
                clock(now.since)
            ),
            (None, Some(&(from, to))) => format!(
                "allocations only (--track allocations): in use = allocated, but for what was \
                 freed while frees were followed on request (last from {} to {})",
                clock(from),
                clock(to)
            ),
            (None, None) => "allocations only (--track allocations): in use = allocated".into(),
        }
    }
}

impl Session<'_> {
    /// Follows `pid`'s frees for `wanted` from now, where the run tracks
    /// allocations only (longer if they are already followed); returns
    /// whether they are followed now. Nothing to do where frees are
    /// followed anyway, were dropped for the budget, or the process has no
    /// copy attached the usual way.
    pub(in crate::run) fn follow_frees_for(
        &mut self,
        pid: u32,
        wanted: Duration,
        cause: FollowCause,
    ) -> bool {
        let until = Instant::now() + wanted;
        if !self.options.collector.allocations_only
            || self.budget.frees_dropped(pid)
            || self.tracked.get(&pid).is_none_or(|t| t.exited)
        {
            return false;
        }
        if let Some(followed) = self.frees_on_request.followed.get_mut(&pid) {
            followed.until = followed.until.max(until);
            return true;
        }
        if self
            .frees_on_request
            .copies
            .get(&pid)
            .is_none_or(Vec::is_empty)
        {
            return false;
        }
        self.switch_frees(pid, true);
        let since = SystemTime::now();
        (self.frees_on_request.followed).insert(pid, Followed { since, until });
        self.say(SamplingNotice::FreesFollowed {
            pid,
            seconds: wanted.as_secs(),
            cause,
        });
        true
    }

    /// `--follow-on-growth`: after `pid`'s resident memory grew (`growth`
    /// says how), its frees are followed for that long, and what it
    /// allocated then and still holds at the end is written as a snapshot.
    pub(in crate::run) fn follow_on_growth(&mut self, pid: u32, growth: &str) {
        let span = self.options.follow_on_growth;
        if span.is_zero()
            || self.frees_on_request.growth.contains_key(&pid)
            || !self.follow_frees_for(pid, span, FollowCause::Growth)
        {
            return;
        }
        let Some(t) = self.tracked.get(&pid) else {
            return;
        };
        let span = GrowthSpan {
            before: t.profile(),
            since: Instant::now(),
            growth: growth.to_owned(),
        };
        self.frees_on_request.growth.insert(pid, span);
    }

    /// Each tick: processes whose asked span is over go back to their
    /// allocations only.
    pub(in crate::run) fn end_frees_on_request(&mut self) {
        let now = Instant::now();
        let over: Vec<(u32, Followed)> = (self.frees_on_request.followed.iter())
            .filter(|(_, f)| f.until <= now)
            .map(|(&pid, &f)| (pid, f))
            .collect();
        for (pid, followed) in over {
            self.frees_on_request.followed.remove(&pid);
            if let Some(span) = self.frees_on_request.growth.remove(&pid) {
                self.write_growth_delta(pid, span);
            }
            if self.tracked.get(&pid).is_some_and(|t| !t.exited) {
                self.switch_frees(pid, false);
                self.say(SamplingNotice::FreesFollowedEnd { pid });
            }
            (self.frees_on_request.last).insert(pid, (followed.since, SystemTime::now()));
        }
    }

    /// The snapshot at the end of a span asked by resident growth: the
    /// profile less the one at its start, what was allocated in the span
    /// and is still live.
    fn write_growth_delta(&mut self, pid: u32, span: GrowthSpan) {
        let seconds = span.since.elapsed().as_secs();
        let reason = format!(
            "allocated in the {seconds} s after {} and still live (frees followed)",
            span.growth
        );
        let announce = Announce::Growth(reason.clone());
        self.snapshot_as(pid, &reason, SnapshotKind::Requested, announce, |now| {
            now.since(&span.before, seconds).growth_only()
        });
    }

    /// After the budget dropped `pid`'s frees (its free probes detached):
    /// its copies attached again without return halves.
    pub(in crate::run) fn attach_without_frees(&mut self, pid: u32) {
        self.frees_on_request.followed.remove(&pid);
        self.switch_frees(pid, false);
    }

    /// Attaches each usual copy of `pid` again, following its frees or
    /// not, and counts its samples so from now on. A window open now is
    /// closed first (its held events applied): the next opens with the
    /// new probes.
    fn switch_frees(&mut self, pid: u32, follow: bool) {
        let continuous = self.sampling.windows(pid).is_some_and(|w| w.continuous());
        if continuous {
            self.close_continuous_window(pid);
        } else {
            self.close_open_window(pid);
        }
        self.probes.follow_frees(pid, follow);
        let mut copies = self
            .frees_on_request
            .copies
            .remove(&pid)
            .unwrap_or_default();
        for copy in &mut copies {
            self.probes.detach_probes(&copy.slots);
            if let Err(error) = self.attach_copy_again(pid, copy) {
                self.say(SamplingNotice::SamplingLost {
                    pid,
                    path: copy.path.clone(),
                    error: crate::error::chain(&error),
                });
            }
        }
        self.frees_on_request.copies.insert(pid, copies);
        if let Some(t) = self.tracked.get_mut(&pid) {
            if follow {
                t.heap.follow_frees();
            } else {
                t.heap.track_allocations_only();
            }
        }
        if continuous {
            self.open_window(pid);
        }
    }

    fn attach_copy_again(&mut self, pid: u32, copy: &mut UsualCopy) -> crate::error::Result<()> {
        let file = (copy.path.as_str(), copy.open_path.as_path());
        let used = self.probes.attach_again(
            Scope::Process(pid),
            file,
            &copy.probed,
            copy.instance,
            &copy.slots,
        )?;
        for index in used {
            if !copy.slots.contains(&index) {
                copy.slots.push(index);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The note says whether frees are followed now, were for a while, or
    /// never were.
    #[test]
    fn the_tracking_note_says_when_frees_were_followed() {
        let mut requests = FreesOnRequest::default();
        assert_eq!(
            requests.note(7),
            "allocations only (--track allocations): in use = allocated"
        );
        let since = SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000);
        let until = Instant::now();
        requests.followed.insert(7, Followed { since, until });
        assert!(
            requests
                .note(7)
                .starts_with("allocations and frees since 2027-01-15T08:00:00Z"),
            "{}",
            requests.note(7)
        );
        requests.followed.remove(&7);
        let to = since + Duration::from_secs(30);
        requests.last.insert(7, (since, to));
        assert!(
            requests
                .note(7)
                .ends_with("(last from 2027-01-15T08:00:00Z to 2027-01-15T08:00:30Z)"),
            "{}",
            requests.note(7)
        );
        requests.forget(7);
        assert!(requests.note(7).ends_with("in use = allocated"));
    }
}
