//! The run's side of Python frames: a tracked process found running
//! CPython (when first tracked, or at a rescan: a launched program's
//! `exec`) is told to the kernel, whose samples of it then carry their
//! Python frames, and forgotten there once it exits or is detached.
use crate::{
    python::ProcessPython,
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
        let Some(found) = t.find_python() else {
            return;
        };
        let read = found
            .layout
            .is_some_and(|layout| self.probes.watch_python(pid, layout.process));
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
