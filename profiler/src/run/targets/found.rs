//! What discovery found that the user must hear of: jemalloc found by
//! its code (how, and the entry points whose calls go unseen), and files
//! with jemalloc that cannot be probed, loaded after the start.
use std::path::Path;

use crate::{
    discover::{Allocator, AllocatorKind},
    kernel::Scope,
    proc::Mapping,
    run::{Session, notice::TargetNotice},
};

impl Session<'_> {
    /// Files with jemalloc that cannot be probed, loaded since the start:
    /// said once each on stderr and in the profile, whose allocations
    /// through them go unseen.
    pub(in crate::run) fn say_unprobed(&mut self, pid: u32, mappings: &[Mapping]) {
        for (file, path, why) in self.cache.unprobed_jemalloc(mappings) {
            let Some(t) = self.tracked.get_mut(&pid) else {
                return;
            };
            if !t.attached_files.insert((file, AllocatorKind::Jemalloc)) {
                continue;
            }
            let note = format!("{path}: jemalloc not probed ({why}), its allocations not seen");
            t.found_notes.push(note.clone());
            self.say(TargetNotice::NotProbed { pid, note });
        }
    }

    /// An allocator found by its code: how, in the profile and with
    /// `--verbose`; the entry points it could not find, always.
    pub(in crate::run) fn say_found_by_code(
        &mut self,
        scope: Scope,
        path: &str,
        allocator: &Allocator,
    ) {
        let Some(found) = &allocator.by_code else {
            return;
        };
        let note = format!("{path}: {}", found.describe());
        let pid = match scope {
            Scope::Process(pid) => Some(pid),
            Scope::AllProcesses => None,
        };
        let notice = if self.options.verbose || found.missing.is_empty() {
            TargetNotice::FoundByCode {
                pid,
                note: note.clone(),
            }
        } else {
            let name = Path::new(path).file_name().unwrap_or_default();
            TargetNotice::EntryPointsUnseen {
                pid,
                file: name.to_string_lossy().into_owned(),
                missing: found.missing.iter().map(|m| m.to_string()).collect(),
            }
        };
        self.say(notice);
        if let Scope::Process(pid) = scope
            && let Some(t) = self.tracked.get_mut(&pid)
            && !t.found_notes.contains(&note)
        {
            t.found_notes.push(note);
        }
    }
}
