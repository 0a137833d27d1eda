//! What discovery found that the user must hear of: jemalloc found by
//! its code (how, and the entry points whose calls go unseen), and files
//! with jemalloc that cannot be probed, loaded after the start.
use std::path::Path;

use crate::{
    discover::{Allocator, AllocatorKind},
    kernel::Scope,
    proc::Mapping,
    run::Session,
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
            self.clear_progress();
            let _ = writeln!(
                self.status,
                "memprobe: warning: pid {pid}: {note}; give its debug file with --debug-dir"
            );
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
        let whose = match scope {
            Scope::Process(pid) => format!("pid {pid}: "),
            Scope::AllProcesses => String::new(),
        };
        if self.options.verbose {
            let _ = writeln!(self.status, "memprobe: {whose}{note}");
        } else if !found.missing.is_empty() {
            let name = Path::new(path).file_name().map(|n| n.to_string_lossy());
            let _ = writeln!(
                self.status,
                "memprobe: {whose}{}: jemalloc's entry points found by their code; calls to {} \
                 are not seen",
                name.unwrap_or_default(),
                found.missing.join(", ")
            );
        }
        if let Scope::Process(pid) = scope
            && let Some(t) = self.tracked.get_mut(&pid)
            && !t.found_notes.contains(&note)
        {
            t.found_notes.push(note);
        }
    }
}
