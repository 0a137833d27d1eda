//! The run's side of Python frames: a tracked process found running
//! CPython (when first tracked, or at a rescan: a launched program's
//! `exec`) is told to the kernel, whose samples of it then carry their
//! Python frames, and forgotten there once it exits or is detached.
use crate::{
    python::{ProcessPython, runtime},
    run::{Session, notice::TargetNotice},
};

impl Session<'_> {
    /// Looks for CPython in `pid`'s mappings (each file once); where found
    /// and read, the kernel walks its Python frames from now on.
    pub(in crate::run) fn watch_python(&mut self, pid: u32) {
        let Some(t) = self.tracked.get_mut(&pid) else {
            return;
        };
        if t.python.is_some() {
            return;
        }
        let mappings = t.mappings().to_vec();
        let Some(found) = runtime::find(pid, &mappings, &mut t.python_files_seen) else {
            return;
        };
        let read = found
            .process
            .is_some_and(|p| self.probes.watch_python(pid, p));
        let notice = TargetNotice::Python {
            pid,
            version: found.version.clone(),
            path: found.path.clone(),
            read,
        };
        t.python = Some(ProcessPython::new(pid, found));
        self.say(notice);
    }
}
