//! The facts memprobe reads from the kernel's BTF: where a task's user fs
//! base lies in `struct task_struct` (`thread.fsbase`), so that a probe
//! can find the thread's TLS block (jemalloc's per-thread counters) with
//! `bpf_get_current_task` and a kernel read, and where its thread and
//! process ids lie, for the iterator that lists every thread's fs base.
//! The offsets differ between kernel builds; BTF (`/sys/kernel/btf/vmlinux`)
//! has them.

/// BTF kinds whose records are followed by data of their own.
const KIND_INT: u32 = 1;
const KIND_ARRAY: u32 = 3;
const KIND_STRUCT: u32 = 4;
const KIND_UNION: u32 = 5;
const KIND_ENUM: u32 = 6;
const KIND_FUNC_PROTO: u32 = 13;
const KIND_VAR: u32 = 14;
const KIND_DATASEC: u32 = 15;
const KIND_DECL_TAG: u32 = 17;
const KIND_ENUM64: u32 = 19;

const MAGIC: u16 = 0xeb9f;

/// One struct or union: where its members are in the data.
#[derive(Clone, Copy)]
struct Composite {
    name: u32,
    members: usize,
    count: usize,
    bitfields: bool,
}

/// Byte offsets in `struct task_struct`, 0 where unknown.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TaskOffsets {
    /// `thread.fsbase`.
    pub fsbase: u64,
    /// `pid` (the thread's id) and `tgid` (its process's).
    pub pid: u64,
    pub tgid: u64,
}

/// The offsets in `struct task_struct` memprobe reads, from raw BTF;
/// `None` if the BTF is not what this reads.
pub fn task_offsets(btf: &[u8]) -> Option<TaskOffsets> {
    let btf = Btf::read(btf)?;
    let composites = btf.composites()?;
    let task = composites
        .iter()
        .flatten()
        .find(|c| btf.name(c.name) == Some(b"task_struct".as_slice()))?;
    let fsbase = btf
        .member(*task, b"thread")
        .and_then(|(thread_type, bits)| {
            let thread = (*composites.get(thread_type)?)?;
            let (_, fsbase_bits) = btf.member(thread, b"fsbase")?;
            Some((bits + fsbase_bits) / 8)
        });
    let direct = |name: &[u8]| btf.member(*task, name).map(|(_, bits)| bits / 8);
    Some(TaskOffsets {
        fsbase: fsbase.unwrap_or(0),
        pid: direct(b"pid").unwrap_or(0),
        tgid: direct(b"tgid").unwrap_or(0),
    })
}

/// Raw BTF and where its type records and strings are.
struct Btf<'a> {
    data: &'a [u8],
    types: usize,
    types_len: usize,
    strings: usize,
}

impl<'a> Btf<'a> {
    fn read(data: &'a [u8]) -> Option<Self> {
        if u16::from_le_bytes(data.get(0..2)?.try_into().ok()?) != MAGIC {
            return None;
        }
        let btf = Self {
            data,
            types: 0,
            types_len: 0,
            strings: 0,
        };
        let header = btf.word(4)? as usize;
        Some(Self {
            types: header + btf.word(8)? as usize,
            types_len: btf.word(12)? as usize,
            strings: header + btf.word(16)? as usize,
            ..btf
        })
    }

    fn word(&self, at: usize) -> Option<u32> {
        Some(u32::from_le_bytes(
            self.data.get(at..at + 4)?.try_into().ok()?,
        ))
    }

    fn name(&self, offset: u32) -> Option<&'a [u8]> {
        let rest = self.data.get(self.strings + offset as usize..)?;
        Some(&rest[..rest.iter().position(|&b| b == 0)?])
    }

    /// Every type by id (ids count from 1, in the order of the records):
    /// the structs and unions, `None` for the rest.
    fn composites(&self) -> Option<Vec<Option<Composite>>> {
        let mut composites: Vec<Option<Composite>> = vec![None];
        let mut at = self.types;
        while at < self.types + self.types_len {
            let (name_off, info) = (self.word(at)?, self.word(at + 4)?);
            let (kind, count) = ((info >> 24) & 0x1f, (info & 0xffff) as usize);
            at += 12;
            let extra = match kind {
                KIND_INT | KIND_VAR | KIND_DECL_TAG => 4,
                KIND_ARRAY => 12,
                KIND_STRUCT | KIND_UNION | KIND_DATASEC | KIND_ENUM64 => 12 * count,
                KIND_ENUM | KIND_FUNC_PROTO => 8 * count,
                _ => 0,
            };
            composites.push(
                matches!(kind, KIND_STRUCT | KIND_UNION).then_some(Composite {
                    name: name_off,
                    members: at,
                    count,
                    bitfields: info >> 31 == 1,
                }),
            );
            at += extra;
        }
        Some(composites)
    }

    /// The type id and bit offset of `composite`'s member named `wanted`.
    fn member(&self, composite: Composite, wanted: &[u8]) -> Option<(usize, u64)> {
        (0..composite.count).find_map(|i| {
            let at = composite.members + 12 * i;
            if self.name(self.word(at)?)? != wanted {
                return None;
            }
            let offset = self.word(at + 8)?;
            let bits = if composite.bitfields {
                offset & 0xff_ffff
            } else {
                offset
            };
            Some((self.word(at + 4)? as usize, u64::from(bits)))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A member's bit offset in a struct, as `bpftool btf dump` prints it.
    fn bpftool_bits(dump: &str, structure: &str, member: &str) -> Option<u64> {
        let header = format!("STRUCT '{structure}' ");
        let mut lines = dump.lines().skip_while(|l| !l.contains(&header)).skip(1);
        lines
            .by_ref()
            .take_while(|l| l.starts_with('\t'))
            .find(|l| l.trim_start().starts_with(&format!("'{member}' ")))?
            .rsplit("bits_offset=")
            .next()?
            .parse()
            .ok()
    }

    /// This machine's kernel: the offset bpftool reads from the same BTF.
    #[test]
    fn finds_task_offsets_in_the_running_kernels_btf() {
        let Ok(btf) = std::fs::read("/sys/kernel/btf/vmlinux") else {
            eprintln!("skipped: no /sys/kernel/btf/vmlinux");
            return;
        };
        let offsets = task_offsets(&btf).expect("task_struct");
        let Ok(dump) = std::process::Command::new("bpftool")
            .args([
                "btf",
                "dump",
                "file",
                "/sys/kernel/btf/vmlinux",
                "format",
                "raw",
            ])
            .output()
        else {
            eprintln!("skipped the comparison: no bpftool");
            return;
        };
        let dump = String::from_utf8_lossy(&dump.stdout);
        let thread = bpftool_bits(&dump, "task_struct", "thread").expect("thread");
        let fsbase = bpftool_bits(&dump, "thread_struct", "fsbase").expect("fsbase");
        assert_eq!(offsets.fsbase, (thread + fsbase) / 8);
        let pid = bpftool_bits(&dump, "task_struct", "pid").expect("pid");
        let tgid = bpftool_bits(&dump, "task_struct", "tgid").expect("tgid");
        assert_eq!((offsets.pid, offsets.tgid), (pid / 8, tgid / 8));
    }

    #[test]
    fn other_data_is_not_btf() {
        assert_eq!(task_offsets(b"not btf at all, not even close"), None);
        assert_eq!(task_offsets(&[]), None);
    }
}
