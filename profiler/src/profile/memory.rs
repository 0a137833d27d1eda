//! A process's memory beyond its heap: what the kernel said was resident
//! at a snapshot ([`MemoryReading`]), and that memory accounted for by
//! whose it is ([`MemoryAccount`]), which adds up to the resident total.
use crate::{proc::resident::ResidentMapping, units::bytes};

/// Anonymous memory the process mapped while profiled, as read at a
/// snapshot.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct MappedRange {
    pub start: u64,
    pub len: u64,
    /// The stack that mapped it, innermost first.
    pub frames: Vec<u64>,
    pub shared: bool,
    /// Its resident bytes.
    pub resident: u64,
}

/// What the kernel said of a process's memory at a snapshot.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct MemoryReading {
    /// `/proc/PID/smaps`: every mapping with its resident bytes.
    pub resident: Vec<ResidentMapping>,
    /// The mappings memprobe saw it make.
    pub mapped: Vec<MappedRange>,
    /// Mappings not kept (the table was full).
    pub mappings_dropped: u64,
    /// Whether memprobe saw every mapping from the process's start.
    pub since_start: bool,
    /// Where its threads blocked in a system call had their stack
    /// pointers: the stacks of threads started before memprobe attached.
    pub stack_pointers: Vec<u64>,
}

impl MemoryReading {
    pub fn resident_total(&self) -> u64 {
        self.resident.iter().map(|m| m.resident).sum()
    }
}

/// Direct anonymous mappings made by one stack.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct SiteMemory {
    /// The innermost named frame of the program's that mapped it.
    pub name: String,
    pub frames: Vec<u64>,
    pub mappings: u64,
    pub mapped: u64,
    pub resident: u64,
}

/// A process's resident memory, accounted for: the parts add up to
/// `resident`.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct MemoryAccount {
    pub resident: u64,
    /// The heap in use, as estimated from the samples (at most what the
    /// anonymous memory holds).
    pub heap_in_use: u64,
    /// Allocators' resident memory beyond what is in use: fragmentation,
    /// caches, retained pages, metadata.
    pub allocator_footprint: u64,
    /// Each allocator's resident memory in the mappings it made (and
    /// glibc's `[heap]`).
    pub allocators: Vec<(String, u64)>,
    /// Anonymous memory mapped directly, by site, largest first.
    pub sites: Vec<SiteMemory>,
    pub thread_stacks: u64,
    /// The mappings a JVM's libjvm made: its heap, code cache, metaspace.
    pub jvm: u64,
    pub file_backed: u64,
    /// Files' zeroed static data (`.bss`) the kernel mapped with them.
    pub static_data: u64,
    pub shared: u64,
    /// Anonymous memory mapped before memprobe attached, beyond the heap
    /// in use: whose it is was not seen.
    pub before_attach: u64,
    /// What is left: resident memory none of the above explains.
    pub unexplained: u64,
    /// Mappings memprobe did not keep (its table was full).
    pub mappings_dropped: u64,
}

impl MemoryAccount {
    pub fn sites_resident(&self) -> u64 {
        self.sites.iter().map(|s| s.resident).sum()
    }

    /// Each part with its bytes and what it holds, in the account's order
    /// ("heap in use", 9.4 MiB), adding up to `resident`.
    pub fn parts(&self) -> Vec<(&'static str, u64, String)> {
        let allocators = self
            .allocators
            .iter()
            .map(|(name, resident)| format!("{name} {} resident", bytes(*resident as f64)))
            .collect::<Vec<_>>()
            .join(", ");
        let sites = match self.sites.len() {
            0 => String::new(),
            n => format!("{n} sites"),
        };
        let dropped = match self.mappings_dropped {
            0 => String::new(),
            n => format!("with {n} mappings not kept, the table full"),
        };
        vec![
            ("heap in use", self.heap_in_use, String::new()),
            ("allocator footprint", self.allocator_footprint, allocators),
            ("direct mappings", self.sites_resident(), sites),
            ("thread stacks", self.thread_stacks, String::new()),
            ("JVM", self.jvm, String::new()),
            ("file-backed", self.file_backed, String::new()),
            ("static data", self.static_data, ".bss".into()),
            ("shared memory", self.shared, String::new()),
            ("mapped before attach", self.before_attach, String::new()),
            ("unexplained", self.unexplained, dropped),
        ]
    }

    /// The part named `name` (as [`parts`](Self::parts) names it), to be
    /// set from a written account; `None` for "direct mappings", which
    /// its sites make, and names it does not know.
    pub fn part_mut(&mut self, name: &str) -> Option<&mut u64> {
        Some(match name {
            "resident" => &mut self.resident,
            "heap in use" => &mut self.heap_in_use,
            "allocator footprint" => &mut self.allocator_footprint,
            "thread stacks" => &mut self.thread_stacks,
            "JVM" => &mut self.jvm,
            "file-backed" => &mut self.file_backed,
            "static data" => &mut self.static_data,
            "shared memory" => &mut self.shared,
            "mapped before attach" => &mut self.before_attach,
            "unexplained" => &mut self.unexplained,
            _ => return None,
        })
    }

    /// The account for people: the total, then each part that holds
    /// anything, then the largest direct-mapping sites.
    pub fn lines(&self) -> Vec<String> {
        let mut lines = vec![format!("resident {}", bytes(self.resident as f64))];
        for (name, part, detail) in self.parts() {
            if part == 0 && name != "heap in use" {
                continue;
            }
            let detail = if detail.is_empty() {
                String::new()
            } else {
                format!(" ({detail})")
            };
            lines.push(format!("  {name} {}{detail}", bytes(part as f64)));
        }
        for site in self.sites.iter().take(5) {
            lines.push(format!(
                "  direct mapping by {}: {} resident of {} mapped ({} mappings)",
                site.name,
                bytes(site.resident as f64),
                bytes(site.mapped as f64),
                site.mappings
            ));
        }
        lines
    }
}
