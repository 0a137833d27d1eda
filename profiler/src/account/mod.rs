//! A process's resident memory accounted for: the kernel's figures
//! (`/proc/PID/smaps`, and pagemap for the mappings memprobe saw made)
//! split into the heap in use, the allocators' footprint beyond it, direct
//! mappings by site, thread stacks, a JVM's own, file-backed and shared
//! memory, and what is left unexplained, on a line of its own. The parts
//! add up to the resident total.
mod classify;

use std::collections::BTreeMap;

pub use classify::Owner;

use crate::{
    proc::{parse_maps, resident::ResidentMapping},
    profile::{HeapProfile, MappedRange, MemoryAccount, MemoryReading, SiteMemory},
    symbolize::Namer,
};

/// Resident bytes of the process's own mappings, by kind, as smaps has
/// them.
#[derive(Default)]
struct ByKind {
    /// glibc's `[heap]` (its main arena, grown by `brk`).
    brk_heap: u64,
    /// `[stack]`, and the stacks of threads started before memprobe
    /// attached.
    stacks: u64,
    file_backed: u64,
    /// Anonymous memory right after a file's mapping that memprobe did not
    /// see mapped: the file's zeroed static data (`.bss`), which the
    /// kernel maps with the executable.
    static_data: u64,
    shared: u64,
    private_anonymous: u64,
}

fn by_kind(reading: &MemoryReading) -> ByKind {
    let (resident, mapped) = (&reading.resident, &reading.mapped);
    let mut kinds = ByKind::default();
    let mut previous: Option<&ResidentMapping> = None;
    for m in resident {
        let name = m.name.as_deref().unwrap_or("");
        let after_file = previous.is_some_and(|p| {
            p.end == m.start && p.name.as_deref().is_some_and(|n| n.starts_with('/'))
        });
        previous = Some(m);
        let seen = mapped
            .iter()
            .any(|r| r.start < m.end && m.start < r.start + r.len);
        // A thread started before memprobe attached: its stack holds a
        // blocked thread's stack pointer.
        let holds_stack = || {
            reading
                .stack_pointers
                .iter()
                .any(|&sp| m.start <= sp && sp < m.end)
        };
        let part = if name == "[heap]" {
            &mut kinds.brk_heap
        } else if name == "[stack]" || (m.is_private_anonymous() && !seen && holds_stack()) {
            &mut kinds.stacks
        } else if m.shared || name.starts_with("/dev/shm/") || name.starts_with("/memfd:") {
            &mut kinds.shared
        } else if m.is_private_anonymous() && after_file && !seen && m.name.is_none() {
            &mut kinds.static_data
        } else if m.is_private_anonymous() {
            &mut kinds.private_anonymous
        } else {
            // Files, and the few pages the kernel maps itself ([vdso]).
            &mut kinds.file_backed
        };
        *part += m.resident;
    }
    kinds
}

/// What the mappings memprobe saw made hold, by owner.
#[derive(Default)]
struct Seen {
    allocators: BTreeMap<&'static str, u64>,
    thread_stacks: u64,
    jvm: u64,
    sites: BTreeMap<String, SiteMemory>,
    /// All of the above: private anonymous memory whose owner is known.
    private: u64,
}

/// Each mapping of its own the process was seen to make, with its owner.
pub fn owned<'a>(
    profile: &HeapProfile,
    reading: &'a MemoryReading,
    namer: &mut Namer,
) -> Vec<(Owner, &'a MappedRange)> {
    let mappings = parse_maps(&profile.mapped_libraries);
    (reading.mapped.iter())
        .filter(|r| !r.shared)
        .map(|r| (classify::owner(&r.frames, namer, &mappings), r))
        .collect()
}

fn seen(profile: &HeapProfile, reading: &MemoryReading, namer: &mut Namer) -> Seen {
    let mut seen = Seen::default();
    for (owner, range) in owned(profile, reading, namer) {
        seen.private += range.resident;
        match owner {
            Owner::Allocator(name) => *seen.allocators.entry(name).or_default() += range.resident,
            Owner::ThreadStack => seen.thread_stacks += range.resident,
            Owner::Jvm => seen.jvm += range.resident,
            Owner::Site => {
                let name = site_name(namer, &range.frames);
                let site = seen
                    .sites
                    .entry(name.clone())
                    .or_insert_with(|| SiteMemory {
                        name,
                        frames: range.frames.clone(),
                        ..SiteMemory::default()
                    });
                site.mappings += 1;
                site.mapped += range.len;
                site.resident += range.resident;
            }
        }
    }
    seen
}

/// The innermost function of a direct mapping's stack past the system
/// call's wrapper.
fn site_name(namer: &mut Namer, frames: &[u64]) -> String {
    let names = namer.stack(frames);
    names
        .iter()
        .find(|n| !n.contains("mmap"))
        .or(names.first())
        .cloned()
        .unwrap_or_else(|| "(no stack)".into())
}

/// `profile`'s process's memory as `reading` found it, accounted for.
pub fn account(profile: &HeapProfile, reading: &MemoryReading, namer: &mut Namer) -> MemoryAccount {
    let kinds = by_kind(reading);
    let seen = seen(profile, reading, namer);
    let mut allocators: Vec<(String, u64)> = seen
        .allocators
        .iter()
        .map(|(name, bytes)| (name.to_string(), *bytes))
        .collect();
    if kinds.brk_heap > 0 {
        match allocators.iter_mut().find(|(name, _)| name == "glibc") {
            Some((_, bytes)) => *bytes += kinds.brk_heap,
            None => allocators.push(("glibc".into(), kinds.brk_heap)),
        }
    }
    let in_allocators: u64 = allocators.iter().map(|(_, b)| b).sum();
    let estimated = profile.inuse_bytes().max(0.0) as u64;
    // The heap in use lies in the allocators' mappings; where those were
    // mapped before memprobe attached, in anonymous memory it did not see
    // mapped.
    let in_use_seen = estimated.min(in_allocators);
    let unseen = kinds.private_anonymous.saturating_sub(seen.private);
    let in_use_unseen = (estimated - in_use_seen).min(unseen);
    let rest_unseen = unseen - in_use_unseen;
    let mut sites: Vec<SiteMemory> = seen.sites.into_values().collect();
    sites.sort_by_key(|s| std::cmp::Reverse(s.resident));
    let mut account = MemoryAccount {
        resident: reading.resident_total(),
        heap_in_use: in_use_seen + in_use_unseen,
        allocator_footprint: in_allocators - in_use_seen,
        allocators,
        sites,
        thread_stacks: kinds.stacks + seen.thread_stacks,
        jvm: seen.jvm,
        file_backed: kinds.file_backed,
        static_data: kinds.static_data,
        shared: kinds.shared,
        before_attach: if reading.since_start { 0 } else { rest_unseen },
        unexplained: if reading.since_start { rest_unseen } else { 0 },
        mappings_dropped: reading.mappings_dropped,
    };
    // pagemap and smaps are read a moment apart, while the process runs:
    // pages they disagree on are unexplained when fewer, and the total is
    // the parts' when more (touched between the two readings).
    let parts: u64 = account.parts().iter().map(|(_, bytes, _)| bytes).sum();
    account.unexplained += account.resident.saturating_sub(parts);
    account.resident = account.resident.max(parts);
    account
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::StackEstimate;

    fn anonymous(start: u64, len: u64, resident: u64) -> ResidentMapping {
        ResidentMapping {
            start,
            end: start + len,
            shared: false,
            name: None,
            resident,
        }
    }

    #[test]
    fn the_parts_add_up_to_the_resident_total() {
        const MIB: u64 = 1 << 20;
        let mut file = anonymous(0x1000_0000, 4 * MIB, 3 * MIB);
        file.name = Some("/usr/lib/libc.so.6".into());
        let mut brk = anonymous(0x2000_0000, 8 * MIB, 6 * MIB);
        brk.name = Some("[heap]".into());
        let reading = MemoryReading {
            resident: vec![file, brk, anonymous(0x4000_0000, 1 << 30, 70 * MIB)],
            mapped: vec![MappedRange {
                start: 0x4000_0000,
                len: 1 << 30,
                frames: vec![0x1234],
                shared: false,
                resident: 64 * MIB,
            }],
            mappings_dropped: 0,
            since_start: true,
            stack_pointers: Vec::new(),
        };
        let profile = HeapProfile {
            stacks: vec![StackEstimate {
                frames: vec![1],
                inuse_bytes: 4.0 * MIB as f64,
                ..StackEstimate::default()
            }],
            ..HeapProfile::default()
        };
        let mut namer = Namer::new("", None);
        let account = account(&profile, &reading, &mut namer);
        assert_eq!(account.resident, 79 * MIB);
        assert_eq!(account.file_backed, 3 * MIB);
        assert_eq!(account.heap_in_use, 4 * MIB);
        // glibc's [heap] holds 6 MiB, 4 in use.
        assert_eq!(account.allocator_footprint, 2 * MIB);
        assert_eq!(account.sites_resident(), 64 * MIB);
        assert_eq!(account.unexplained, 6 * MIB);
        let parts: u64 = account.parts().iter().map(|(_, b, _)| b).sum();
        assert_eq!(parts, account.resident);
    }
}
