//! Cookie attached to each probe: which entry point it is (bits 0-29),
//! whether it is attached only in sampling windows (bit 30, see
//! [`crate::FastPathConfig::window_shift`]), whether it may forward its call to another
//! entry point (bit 31, see [`crate::Forwarder`]), where its return address
//! lies relative to `rsp` at the probed instruction (bits 32-47), and which
//! allocator instance it belongs to (bits 48-63).

const FORWARDS: u64 = 1 << 31;
const WINDOWED: u64 = 1 << 30;
/// Probe indexes must stay below this.
pub const MAX_PROBES: u32 = 1 << 30;

pub const fn encode(
    probe_index: u32,
    return_address_offset: u16,
    instance: u16,
    forwards: bool,
) -> u64 {
    let forwards = if forwards { FORWARDS } else { 0 };
    ((instance as u64) << 48)
        | ((return_address_offset as u64) << 32)
        | forwards
        | (probe_index as u64 & (WINDOWED - 1))
}
/// The same cookie, for a probe attached only in sampling windows.
pub const fn windowed(cookie: u64) -> u64 {
    cookie | WINDOWED
}
pub const fn is_windowed(cookie: u64) -> bool {
    cookie & WINDOWED != 0
}
pub const fn probe_index(cookie: u64) -> u32 {
    (cookie & (WINDOWED - 1)) as u32
}
pub const fn forwards(cookie: u64) -> bool {
    cookie & FORWARDS != 0
}
pub const fn return_address_offset(cookie: u64) -> u64 {
    (cookie >> 32) & 0xffff
}
pub const fn instance(cookie: u64) -> u32 {
    (cookie >> 48) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cookie_fields_round_trip() {
        let c = encode(0x1ead_beef, 24, 7, true);
        assert_eq!(probe_index(c), 0x1ead_beef);
        assert!(!is_windowed(c));
        assert_eq!(probe_index(windowed(c)), 0x1ead_beef);
        assert!(is_windowed(windowed(c)) && forwards(windowed(c)));
        assert_eq!(return_address_offset(c), 24);
        assert_eq!(instance(c), 7);
        assert!(forwards(c));
        assert!(!forwards(encode(0x1ead_beef, 24, 7, false)));
    }
}
