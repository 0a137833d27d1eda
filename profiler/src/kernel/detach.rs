//! Detaching: each entry point's links close in order, entry points side
//! by side. Closing a link takes its breakpoints out at once, then waits
//! for a grace period (some 50 ms here): closed one after another, a
//! window's three links kept the last of them trapping some 100 ms past
//! the window's end, and a window of 100 ms cost 2.7 times its length.
use std::os::fd::OwnedFd;

use aya::programs::{UProbe, uprobe::UProbeLink};

use crate::kernel::{KernelProbes, ProbeLinks};

/// Most threads closing links at once (a process's every entry point at
/// its detach: a few dozen).
const MOST_CLOSERS: usize = 16;

/// One entry point's links, each kind in the order they close.
struct Closing {
    perf: Vec<UProbeLink>,
    multi: Vec<OwnedFd>,
}

impl Closing {
    /// Closes them in order: aya's first (a `Vec` drops its items first
    /// to last), then the uprobe_multi links.
    fn close(self) {
        drop(self.perf);
        drop(self.multi);
    }
}

impl KernelProbes {
    /// Takes `links` out of aya's programs, in the reverse order of
    /// attaching: a return half goes before its entry half, so that no
    /// call meets the return half alone (its uretprobe would hide the
    /// caller's return address from a sample taken inside the call, with
    /// no entry program there to note it; closing links waits for a grace
    /// period, long enough to be met: the 6.1 and 6.12 guests lost
    /// `keep_1m` under windowed sampling so).
    fn closing(&mut self, links: ProbeLinks) -> Closing {
        let mut perf = Vec::with_capacity(links.uprobes.len());
        for (program, link) in links.uprobes.into_iter().rev() {
            let program = self.ebpf.program_mut(program).map(<&mut UProbe>::try_from);
            if let Some(Ok(program)) = program
                && let Ok(link) = program.take_link(link)
            {
                perf.push(link);
            }
        }
        let multi = links.multi.into_iter().rev().collect();
        Closing { perf, multi }
    }

    /// Detaches one entry point's links.
    pub(super) fn detach_links(&mut self, links: ProbeLinks) {
        self.closing(links).close();
    }

    /// Detaches several entry points' links, side by side.
    pub(super) fn detach_side_by_side(&mut self, all: Vec<ProbeLinks>) {
        let closings: Vec<Closing> = all
            .into_iter()
            .filter(|links| !links.is_empty())
            .map(|links| self.closing(links))
            .collect();
        close_side_by_side(closings);
    }
}

/// Closes each of `closings` in its order, all of them side by side; one
/// that no thread could be started for, here.
fn close_side_by_side(closings: Vec<Closing>) {
    if closings.len() <= 1 {
        closings.into_iter().for_each(Closing::close);
        return;
    }
    let threads = closings.len().min(MOST_CLOSERS);
    let mut shares: Vec<Vec<Closing>> = (0..threads).map(|_| Vec::new()).collect();
    for (k, closing) in closings.into_iter().enumerate() {
        shares[k % threads].push(closing);
    }
    std::thread::scope(|scope| {
        for share in shares {
            let spawned = std::thread::Builder::new()
                .name("memprobe-detach".into())
                .spawn_scoped(scope, move || share.into_iter().for_each(Closing::close));
            // Without a thread: the share was dropped with the closure,
            // its links closed in order all the same.
            drop(spawned);
        }
    });
}

impl Drop for KernelProbes {
    /// Every link closed side by side: at the end of a run, a target traps
    /// until its last link closes.
    fn drop(&mut self) {
        let all = std::mem::take(&mut self.links);
        self.detach_side_by_side(all);
    }
}
