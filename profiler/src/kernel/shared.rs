//! Return traps a process pays for another's probes. The kernel keys a
//! uprobe by file and offset and runs all of its consumers wherever it is
//! installed. The consumer of a link made for another process is filtered
//! out before its program runs, and a filtered-out uprobe session asks for
//! its return half (`uprobe_prog_run` returns 0, which a session reads as
//! "run the return"); a uretprobe always does. So where two profiled
//! processes map one probed file, every call of an entry point with a
//! return half traps at its return in both, sampled or not.
use std::collections::HashMap;

use crate::{
    kernel::{AttachedProbe, ReturnHalf, Scope},
    proc::FileId,
};

/// For each probe of `attached` (`live` says which are attached now):
/// `None` once detached; else whether each of its calls traps at its
/// return for another process's live probe at the same place, its own
/// return half being no uretprobe (which traps on every call anyway).
pub(super) fn forced_returns(attached: &[AttachedProbe], live: &[bool]) -> Vec<Option<bool>> {
    let mut returning: HashMap<(FileId, u64), Vec<Scope>> = HashMap::new();
    for (probe, _) in attached
        .iter()
        .zip(live)
        .filter(|(probe, live)| **live && probe.return_half != ReturnHalf::None)
    {
        if let Some(place) = place(probe) {
            returning.entry(place).or_default().push(probe.scope);
        }
    }
    attached
        .iter()
        .zip(live)
        .map(|(probe, &live)| {
            live.then(|| {
                probe.return_half != ReturnHalf::Uretprobe
                    && place(probe)
                        .and_then(|place| returning.get(&place))
                        .is_some_and(|scopes| scopes.iter().any(|s| *s != probe.scope))
            })
        })
        .collect()
}

/// Where the kernel's uprobe for `probe` is: its file and offset.
fn place(probe: &AttachedProbe) -> Option<(FileId, u64)> {
    Some((probe.file?, probe.file_offset + probe.placement.offset))
}

#[cfg(test)]
mod tests {
    use profiler_common::CallShape;

    use super::*;
    use crate::discover::{AllocatorKind, placement::Placement};

    fn probe(pid: u32, inode: u64, offset: u64, return_half: ReturnHalf) -> AttachedProbe {
        let mut placement = Placement::entry("test");
        placement.offset = 4;
        AttachedProbe {
            scope: Scope::Process(pid),
            symbol: "malloc".into(),
            path: "/lib/libc.so.6".into(),
            file: Some(FileId { device: 1, inode }),
            file_offset: offset,
            placement,
            return_half,
            instance: 0,
            allocator: AllocatorKind::Glibc,
            shape: CallShape::SizeArg0,
            own_code: None,
        }
    }

    #[test]
    fn sessions_of_two_processes_at_one_place_force_each_others_returns() {
        use ReturnHalf::{None as NoReturn, Session, Uretprobe};
        let attached = [
            probe(1, 7, 0x100, Session),
            probe(2, 7, 0x100, Session),
            // Another function of the same file, and another file.
            probe(1, 7, 0x200, Session),
            probe(2, 8, 0x200, Session),
            // Frees have no return half: nothing forced.
            probe(1, 7, 0x300, NoReturn),
            probe(2, 7, 0x300, NoReturn),
            // A uretprobe forces a session's return; its own traps anyway.
            probe(1, 7, 0x400, Session),
            probe(2, 7, 0x400, Uretprobe),
        ];
        let live = [true; 8];
        assert_eq!(
            forced_returns(&attached, &live),
            [true, true, false, false, false, false, true, false].map(Some)
        );
    }

    #[test]
    fn a_detached_probe_forces_no_return_and_has_none_forced() {
        let attached = [
            probe(1, 7, 0x100, ReturnHalf::Session),
            probe(2, 7, 0x100, ReturnHalf::Session),
        ];
        assert_eq!(
            forced_returns(&attached, &[true, false]),
            [Some(false), None]
        );
        // A probe of unknown file is never matched.
        let mut unknown = attached.clone();
        unknown[1].file = None;
        assert_eq!(
            forced_returns(&unknown, &[true, true]),
            [Some(false), Some(false)]
        );
    }
}
