//! A process's memory, read through `/proc/PID/mem`.
use super::proc_path;

/// A process's memory, `/proc/PID/mem`: read, never written.
pub struct ProcessMemory(std::fs::File);

impl ProcessMemory {
    pub fn open(pid: u32) -> Option<Self> {
        std::fs::File::open(proc_path(pid, "mem")).ok().map(Self)
    }

    /// Fills `bytes` from `address`; `None` if that is not mapped.
    pub fn read(&self, address: u64, bytes: &mut [u8]) -> Option<()> {
        use std::os::unix::fs::FileExt;
        self.0.read_exact_at(bytes, address).ok()
    }

    /// The little-endian word at `address`; `None` if that is not mapped.
    pub fn read_word(&self, address: u64) -> Option<u64> {
        let mut word = [0u8; 8];
        self.read(address, &mut word)?;
        Some(u64::from_le_bytes(word))
    }
}
