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
    kernel::{AttachedProbe, ReturnHalf, Scope, foreign::ForcingPlaces},
    proc::FileId,
};

/// For each probe of `attached` (`live` says which are attached now):
/// `None` once detached; else whether each of its calls traps at its
/// return for another process's live probe at the same place, memprobe's
/// or another tool's (`foreign`), its own return half being no uretprobe
/// (which traps on every call anyway).
pub(super) fn forced_returns(
    attached: &[AttachedProbe],
    live: &[bool],
    foreign: &ForcingPlaces,
) -> Vec<Option<bool>> {
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
                let Some(place) = place(probe) else {
                    return false;
                };
                let own = returning
                    .get(&place)
                    .is_some_and(|scopes| scopes.iter().any(|s| *s != probe.scope));
                let other_tools = match (probe.scope, foreign.get(&place)) {
                    (Scope::Process(pid), Some(pids)) => pids.iter().any(|&p| p != pid),
                    _ => false,
                };
                probe.return_half != ReturnHalf::Uretprobe && (own || other_tools)
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
    use crate::binary::placement::Placement;
    use crate::discover::AllocatorKind;

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
            windowed: false,
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
            forced_returns(&attached, &live, &ForcingPlaces::new()),
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
            forced_returns(&attached, &[true, false], &ForcingPlaces::new()),
            [Some(false), None]
        );
        // A probe of unknown file is never matched.
        let mut unknown = attached.clone();
        unknown[1].file = None;
        assert_eq!(
            forced_returns(&unknown, &[true, true], &ForcingPlaces::new()),
            [Some(false), Some(false)]
        );
    }

    #[test]
    fn another_tools_returning_link_for_another_process_forces_returns() {
        let attached = [
            probe(1, 7, 0x100, ReturnHalf::Session),
            probe(1, 7, 0x200, ReturnHalf::Session),
            probe(1, 7, 0x300, ReturnHalf::Uretprobe),
        ];
        let file = FileId {
            device: 1,
            inode: 7,
        };
        // At the probe's place (its offset plus the placement's 4): for
        // process 2, then for process 1 itself (its own business).
        let foreign = ForcingPlaces::from([
            ((file, 0x104), vec![2]),
            ((file, 0x204), vec![1]),
            ((file, 0x304), vec![2]),
        ]);
        assert_eq!(
            forced_returns(&attached, &[true; 3], &foreign),
            [true, false, false].map(Some)
        );
    }
}
