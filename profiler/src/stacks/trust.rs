//! Frame pointers as a fast path: a process whose frame-pointer walks keep
//! matching their DWARF unwinds is trusted, and the kernel then sends most
//! of its samples without the stack copy; one mismatch ends the trust.
use crate::stacks::unwind::UnwindEnd;

/// Matches in a row after which a process's frame pointers are trusted.
pub const FRAME_POINTER_MATCHES: u32 = 32;

/// One process's record of frame-pointer walks against DWARF unwinds.
#[derive(Debug, Default)]
pub struct FramePointerTrust {
    /// Complete DWARF unwinds in a row that the walk of the same sample
    /// matched.
    matches: u32,
    trusted: bool,
}

impl FramePointerTrust {
    pub fn trusted(&self) -> bool {
        self.trusted
    }

    /// Takes one sample's comparison; returns the new trust when it
    /// changes. Only complete unwinds are evidence either way.
    pub fn judge(&mut self, end: UnwindEnd, matched: bool) -> Option<bool> {
        if end != UnwindEnd::Complete {
            return None;
        }
        if !matched {
            self.matches = 0;
            return std::mem::take(&mut self.trusted).then_some(false);
        }
        self.matches += 1;
        if self.matches >= FRAME_POINTER_MATCHES && !self.trusted {
            self.trusted = true;
            return Some(true);
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trusted_after_enough_matches_and_untrusted_at_one_mismatch() {
        let mut trust = FramePointerTrust::default();
        for _ in 1..FRAME_POINTER_MATCHES {
            assert_eq!(trust.judge(UnwindEnd::Complete, true), None);
        }
        // Incomplete unwinds prove nothing.
        assert_eq!(trust.judge(UnwindEnd::StackCopyExhausted, false), None);
        assert_eq!(trust.judge(UnwindEnd::Complete, true), Some(true));
        assert!(trust.trusted());
        assert_eq!(trust.judge(UnwindEnd::Complete, true), None);
        assert_eq!(trust.judge(UnwindEnd::Complete, false), Some(false));
        assert!(!trust.trusted());
        // Trust is earned again from zero.
        assert_eq!(trust.judge(UnwindEnd::Complete, true), None);
    }
}
