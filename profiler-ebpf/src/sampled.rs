//! The set of sampled pointers, and its count of them per slot
//! (`profiler_common::sampled_slots`). A pointer is counted in its slot
//! before its allocation returns to the program, and uncounted only once
//! it has left the set, so a slot at 0 holds none: most frees stop there,
//! before the set's hash lookup.
use core::{
    intrinsics::{AtomicOrdering, atomic_xadd},
    ptr::NonNull,
};

use profiler_common::{LiveKey, sampled_slots};

use crate::maps::{SAMPLED, SAMPLED_SLOTS};

/// Whether the set may hold `ptr` (of any process): false for most frees.
#[inline(always)]
pub(crate) fn may_hold(ptr: u64) -> bool {
    // SAFETY: see `slot_count`. An aligned 8-byte load is whole (the BPF
    // backend selects no atomic load).
    slot_count(ptr).is_some_and(|count| unsafe { count.as_ptr().read_volatile() } != 0)
}

/// Whether the set holds `key`.
#[inline(always)]
pub(crate) fn holds(key: &LiveKey) -> bool {
    may_hold(key.ptr) && contains(key)
}

/// The set's own lookup, for a caller that has seen `may_hold` say yes.
#[inline(always)]
pub(crate) fn contains(key: &LiveKey) -> bool {
    SAMPLED.get_ptr(key).is_some()
}

/// Adds `key`; false when the set is full. A key added twice is counted
/// twice, which leaves its slot above 0 for good: a lookup more, never one
/// missed.
#[inline(always)]
pub(crate) fn insert(key: &LiveKey) -> bool {
    if SAMPLED.insert(key, 0u8, 0).is_err() {
        return false;
    }
    add(key.ptr, 1);
    true
}

/// Takes `key` out of the set, if it is there.
#[inline(always)]
pub(crate) fn remove(key: &LiveKey) {
    if SAMPLED.remove(key).is_ok() {
        add(key.ptr, u64::MAX);
    }
}

/// Adds `delta` (wrapping: `u64::MAX` takes one away) to `ptr`'s slot.
#[inline(always)]
fn add(ptr: u64, delta: u64) {
    if let Some(count) = slot_count(ptr) {
        // SAFETY: see `slot_count`.
        unsafe { atomic_xadd::<u64, u64, { AtomicOrdering::Relaxed }>(count.as_ptr(), delta) };
    }
}

/// `ptr`'s slot: an array map's value, which lives as long as the program
/// and is only added to atomically.
#[inline(always)]
fn slot_count(ptr: u64) -> Option<NonNull<u64>> {
    NonNull::new(SAMPLED_SLOTS.get_ptr_mut(sampled_slots::slot(ptr))?)
}
