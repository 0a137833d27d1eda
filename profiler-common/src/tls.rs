//! Where a thread keeps a jemalloc copy's allocated-bytes counter: at a
//! fixed distance from its fs base where the copy's TLS is static (the
//! program, or a library it was linked with), or in the block glibc
//! allocates for the copy's module in that thread, found through the
//! thread's dtv, where the copy is in a library loaded with `dlopen` and
//! reaches its TLS through `__tls_get_addr` (pyarrow's, polars'). One
//! walk, for the kernel at each windowed call and for userspace reading a
//! thread through `/proc/PID/mem`.

use crate::FastPathConfig;

/// glibc's x86_64 thread control block (at the fs base): its second word
/// points at the thread's dtv, one entry past the dtv's length.
const TCB_DTV: u64 = 8;

/// A dtv entry: the module's block (or -1 while not allocated), and what
/// to free.
const DTV_ENTRY: u64 = 16;

/// A dtv entry not allocated yet (glibc's `TLS_DTV_UNALLOCATED`).
const UNALLOCATED: u64 = u64::MAX;

/// Where the thread whose fs base is `fsbase` keeps the counter `config`
/// places, its memory read by `read` (a word at an address); `None` where
/// its block for the copy's module does not exist yet (the thread has not
/// reached the copy's TLS) or cannot be read.
#[inline(always)]
pub fn counter_address(
    config: &FastPathConfig,
    fsbase: u64,
    read: impl Fn(u64) -> Option<u64>,
) -> Option<u64> {
    let module = config.tls_module;
    if module == 0 {
        return Some(fsbase.wrapping_add(config.allocated as u64));
    }
    let dtv = read(fsbase.wrapping_add(TCB_DTV))?;
    // A thread that has not called into the module since it was loaded
    // has a dtv too short for it: glibc grows it on that call.
    let length = read(dtv.wrapping_sub(DTV_ENTRY))?;
    if module > length {
        return None;
    }
    let block = read(dtv.wrapping_add(module.wrapping_mul(DTV_ENTRY)))?;
    if block == 0 || block == UNALLOCATED {
        return None;
    }
    Some(block.wrapping_add(config.allocated as u64))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(tls_module: u64, allocated: i64) -> FastPathConfig {
        FastPathConfig {
            tls_module,
            allocated,
            ..FastPathConfig::default()
        }
    }

    /// A thread's memory as a few words.
    fn memory(words: &[(u64, u64)]) -> impl Fn(u64) -> Option<u64> + '_ {
        |at| words.iter().find(|(a, _)| *a == at).map(|(_, w)| *w)
    }

    #[test]
    fn static_tls_is_a_fixed_distance_from_the_fs_base() {
        let at = counter_address(&config(0, -0x100), 0x7000, memory(&[]));
        assert_eq!(at, Some(0x6f00));
    }

    #[test]
    fn dynamic_tls_is_found_through_the_dtv() {
        // fs base 0x7000; dtv at 0x9010 (its length, 3, at 0x9000);
        // module 2's block at 0x20000.
        let words = [(0x7008, 0x9010), (0x9000, 3), (0x9030, 0x20000)];
        let at = counter_address(&config(2, 0x338), 0x7000, memory(&words));
        assert_eq!(at, Some(0x20338));
    }

    #[test]
    fn a_block_not_there_yet_places_no_counter() {
        let unallocated = [(0x7008, 0x9010), (0x9000, 3), (0x9030, UNALLOCATED)];
        let at = counter_address(&config(2, 0x338), 0x7000, memory(&unallocated));
        assert_eq!(at, None);
        let short = [(0x7008, 0x9010), (0x9000, 1), (0x9030, 0x20000)];
        assert_eq!(counter_address(&config(2, 8), 0x7000, memory(&short)), None);
    }
}
