//! `--verbose`'s account of what was attached: each probe's place, the
//! wrappers left unprobed, jemalloc's fast path as recognised.
use crate::{
    discover::{
        Allocator, AllocatorKind,
        fast_path::{SlowPath, TlsOffset},
    },
    kernel::{ReturnHalf, Scope},
    run::Session,
};

impl Session<'_> {
    pub(in crate::run) fn print_verbose_wrappers(&mut self, path: &str, allocator: &Allocator) {
        if !self.options.verbose {
            return;
        }
        if allocator.kind == AllocatorKind::Jemalloc {
            let _ = writeln!(
                self.status,
                "memprobe: {path}: {}",
                describe_fast_path(allocator.fast_path.as_ref())
            );
        }
        for (wrapper, inner) in &allocator.wrappers {
            let _ = writeln!(
                self.status,
                "memprobe: {path}: {wrapper} not probed: every call passes to {inner}"
            );
        }
    }

    pub(in crate::run) fn print_verbose_probes(&mut self, from: usize) {
        if !self.options.verbose {
            return;
        }
        if from == 0
            && let Some(reason) = &self.probes.sessions_unavailable
        {
            let _ = writeln!(
                self.status,
                "memprobe: return probes: uretprobes ({reason}): every allocation call also \
                 traps at its return"
            );
        }
        if from == 0
            && let Some(reason) = &self.probes.mapped_code_unavailable
        {
            let _ = writeln!(
                self.status,
                "memprobe: libraries loaded later are found by rescans, within a second (the \
                 kernel cannot tell of newly mapped code: {})",
                crate::error::chain(reason)
            );
        }
        if from == 0
            && let Some(reason) = &self.probes.threads_unlisted
        {
            let _ = writeln!(
                self.status,
                "memprobe: a thread idle at the attach has its bytes counted from its first \
                 window (the kernel cannot list threads: {reason})"
            );
        }
        for p in &self.probes.attached[from..] {
            let scope = match p.scope {
                Scope::Process(pid) => format!("pid {pid}"),
                Scope::AllProcesses => "all processes".to_owned(),
            };
            let halves = match p.return_half {
                ReturnHalf::None => "entry",
                ReturnHalf::Uretprobe => "entry and return",
                ReturnHalf::Session => "entry and return, as a session",
            };
            let place = match &p.placement.fallback {
                None => format!("+{:#x} `{}`", p.placement.offset, p.placement.instruction),
                Some(reason) => format!(" at the first instruction: {reason}"),
            };
            let _ = writeln!(
                self.status,
                "memprobe: {scope}: {} at {}+{:#x}{place} ({halves})",
                p.symbol, p.path, p.file_offset,
            );
        }
    }
}

/// `--verbose`'s words on jemalloc's fast path.
fn describe_fast_path(fast: Option<&SlowPath>) -> String {
    let Some(SlowPath {
        fast,
        large_requests,
        ..
    }) = fast
    else {
        return "jemalloc's malloc fast path not recognised".into();
    };
    let large = match large_requests {
        Some(l) => format!(
            "; the slow path sends requests no thread cache holds to the function at file \
             offset {:#x} (its limit read from address {:#x})",
            l.file_offset, l.limit
        ),
        None => "; where the slow path sends requests no thread cache holds: not found".into(),
    };
    let tls = match fast.tls {
        TlsOffset::GotSlot(slot) => {
            format!("the TLS offset in the GOT slot at file offset {slot:#x}")
        }
        TlsOffset::Immediate(offset) => format!("TLS at fs{}", signed_hex(offset)),
        TlsOffset::TlsIndex(index) => format!(
            "the TLS block found through __tls_get_addr, its tls_index at file offset {index:#x}"
        ),
    };
    format!(
        "jemalloc 5.3 malloc fast path recognised: above {} bytes and at a thread's \
         threshold it leaves for the slow path at file offset {:#x}; thread counters at TLS \
         {} and {}, {tls}{large}",
        fast.large_above,
        fast.slow_path,
        signed_hex(fast.allocated),
        signed_hex(fast.allocated + 8)
    )
}

/// `+0x338`, `-0xa98`.
fn signed_hex(value: i64) -> String {
    let sign = if value < 0 { '-' } else { '+' };
    format!("{sign}{:#x}", value.unsigned_abs())
}
