//! The collector's unit tests: samples, returns, frees and resizes in,
//! estimates out.
use crate::discover::AllocatorKind;

use super::*;

fn sample(tid: u32, size: u64, frames: &[u64]) -> Sample {
    Sample {
        tid,
        size,
        align: 0,
        frames: frames.to_vec(),
        stack_error: false,
        allocator: AllocatorKind::Jemalloc,
        window: 0,
        interval: None,
        copy: 0,
        scale: None,
    }
}

fn sampled(tid: u32, size: u64, frames: &[u64]) -> HeapEvent {
    HeapEvent::Sampled(sample(tid, size, frames))
}

fn returned(tid: u32, ptr: u64) -> HeapEvent {
    HeapEvent::Returned {
        tid,
        time_ns: 0,
        ptr,
        untracked: false,
    }
}

fn freed(tid: u32, ptr: u64) -> HeapEvent {
    HeapEvent::Freed {
        tid,
        ptr,
        in_resize: false,
    }
}

fn restored(tid: u32, ptr: u64) -> HeapEvent {
    HeapEvent::Restored { tid, ptr }
}

fn heap(max_live: usize) -> ProcessHeap {
    ProcessHeap::new(
        1,
        4096,
        CollectorOptions {
            allocations_only: false,
            max_live,
            max_stacks: 10,
        },
    )
}

#[test]
fn allocations_only_counts_at_the_call_and_never_frees() {
    let mut heap = ProcessHeap::new(
        1,
        4096,
        CollectorOptions {
            allocations_only: true,
            ..CollectorOptions::default()
        },
    );
    heap.apply(sampled(7, 4096, &[0x10]));
    let w = sample_weight(4096, 4096);
    assert_eq!(heap.samples, 1);
    assert!((heap.inuse_bytes() - w * 4096.0).abs() < 1e-6);
    assert!((heap.alloc_bytes() - heap.inuse_bytes()).abs() < 1e-6);
}

#[test]
fn frees_dropped_mid_run_keep_what_was_live_and_count_the_rest_at_the_call() {
    let mut heap = heap(10);
    let w = sample_weight(4096, 4096);
    // Live before the switch, and a call whose return comes after it.
    heap.apply(sampled(1, 4096, &[0x10]));
    heap.apply(returned(1, 0x1000));
    heap.apply(sampled(2, 4096, &[0x20]));
    heap.track_allocations_only();
    heap.apply(returned(2, 0x2000));
    // After it: counted at the call; a return from an older probe is no drop.
    heap.apply(sampled(3, 4096, &[0x30]));
    heap.apply(returned(3, 0x3000));
    assert!((heap.inuse_bytes() - 3.0 * w * 4096.0).abs() < 1e-6);
    assert_eq!(heap.samples, 3);
    assert_eq!(heap.drops.unmatched_returns, 0);
    // A free still seen (a realloc's) releases what was live before.
    heap.apply(freed(1, 0x1000));
    assert!((heap.inuse_bytes() - 2.0 * w * 4096.0).abs() < 1e-6);
}

#[test]
fn a_windowed_sample_stands_for_its_cycle() {
    let mut heap = heap(10);
    // Counted 32 times over in its window (4096 << 5), sampled with that
    // probability; its thread allocated 40x its window's bytes that cycle.
    heap.apply(HeapEvent::Sampled(Sample {
        window: 4096 << 5,
        scale: Some(40.0),
        ..sample(1, 4096, &[0x10])
    }));
    heap.apply(returned(1, 0x1000));
    let expected = 40.0 * sample_weight(4096 << 5, 4096) * 4096.0;
    assert!((heap.inuse_bytes() - expected).abs() < 1e-6);
}

#[test]
fn allocation_then_free_leaves_only_the_allocated_side() {
    let mut heap = heap(10);
    heap.apply(sampled(7, 4096, &[0x10, 0x20]));
    heap.apply(returned(7, 0xdead0));
    let w = sample_weight(4096, 4096);
    assert!((heap.inuse_bytes() - w * 4096.0).abs() < 1e-6);
    heap.apply(freed(7, 0xdead0));
    let profile = heap.snapshot(String::new());
    assert_eq!(profile.stacks.len(), 1);
    assert_eq!(profile.stacks[0].inuse_bytes, 0.0);
    assert!((profile.stacks[0].alloc_bytes - w * 4096.0).abs() < 1e-6);
}

#[test]
fn bytes_are_size_classes() {
    let mut heap = heap(10);
    heap.apply(sampled(1, 100_000, &[0x10]));
    heap.apply(returned(1, 0x1000));
    let profile = heap.snapshot(String::new());
    let s = &profile.stacks[0];
    assert!((s.inuse_bytes / s.inuse_objects - 114_688.0).abs() < 1e-6);
}

#[test]
fn returns_pair_with_their_thread_and_failures_count_nothing() {
    let mut heap = heap(10);
    heap.apply(sampled(1, 64, &[0x10]));
    heap.apply(sampled(2, 8192, &[0x20]));
    heap.apply(returned(2, 0x2000));
    heap.apply(returned(1, 0));
    heap.apply(returned(3, 0x3000));
    let profile = heap.snapshot(String::new());
    assert_eq!(profile.stacks.len(), 1);
    assert_eq!(profile.stacks[0].frames, [0x20]);
    assert_eq!(heap.drops.unmatched_returns, 1);
}

#[test]
fn a_full_live_table_is_counted_and_reported() {
    let mut heap = heap(1);
    for (i, ptr) in [0x1000u64, 0x2000, 0x3000].into_iter().enumerate() {
        heap.apply(sampled(i as u32, 4096, &[0x10]));
        heap.apply(returned(i as u32, ptr));
    }
    assert_eq!(heap.live_samples(), 1);
    assert_eq!(heap.drops.live_table_full, 2);
    let profile = heap.snapshot(String::new());
    assert_eq!(profile.notes.drops.live_table_full, 2);
    assert!(
        profile
            .notes
            .lines()
            .contains(&("dropped_live_table_full".into(), "2".into()))
    );
}

#[test]
fn resize_in_place_changes_bytes_not_objects() {
    let mut heap = heap(10);
    heap.apply(sampled(1, 1 << 20, &[0x10]));
    heap.apply(returned(1, 0x1000));
    heap.apply(HeapEvent::Resized {
        ptr: 0x1000,
        new_size: 2 << 20,
    });
    assert!((heap.inuse_bytes() - (2 << 20) as f64).abs() < 1.0);
}

#[test]
fn forgetting_a_copy_drops_only_its_live_samples() {
    let mut heap = heap(100);
    heap.apply(sampled(1, 4096, &[0x10]));
    heap.apply(returned(1, 0x1000));
    heap.apply(HeapEvent::Sampled(Sample {
        copy: 1,
        ..sample(2, 4096, &[0x20])
    }));
    heap.apply(returned(2, 0x2000));
    let before = heap.inuse_bytes();
    assert_eq!(heap.forget_copy(1), 1);
    assert_eq!(heap.live_samples(), 1);
    assert!((heap.inuse_bytes() - before / 2.0).abs() < 1e-6 * before);
    // What was allocated stays counted.
    assert!((heap.alloc_bytes() - before).abs() < 1e-6 * before);
    // Its pointer's free, if it came, finds nothing.
    heap.apply(freed(2, 0x2000));
    assert!((heap.inuse_bytes() - before / 2.0).abs() < 1e-6 * before);
}

fn freed_in_resize(tid: u32, ptr: u64) -> HeapEvent {
    HeapEvent::Freed {
        tid,
        ptr,
        in_resize: true,
    }
}

#[test]
fn a_failed_resize_puts_its_pointer_back_as_it_was() {
    let mut heap = heap(100);
    heap.apply(sampled(1, 4096, &[0x10]));
    heap.apply(returned(1, 0x1000));
    let before = heap.inuse_bytes();
    heap.apply(freed_in_resize(1, 0x1000));
    assert_eq!(heap.inuse_bytes(), 0.0);
    heap.apply(restored(1, 0x1000));
    assert_eq!(heap.live_samples(), 1);
    assert!((heap.inuse_bytes() - before).abs() < 1e-6 * before);
    // Allocated once, not twice.
    assert!((heap.alloc_bytes() - before).abs() < 1e-6 * before);
    // Its later free finds it.
    heap.apply(freed(1, 0x1000));
    assert_eq!(heap.live_samples(), 0);
}

#[test]
fn a_restore_needs_the_same_thread_and_pointer() {
    let mut heap = heap(100);
    heap.apply(sampled(1, 4096, &[0x10]));
    heap.apply(returned(1, 0x1000));
    heap.apply(freed_in_resize(1, 0x1000));
    // Another thread's restore, or another pointer's, is not this one's.
    for (tid, ptr) in [(2, 0x1000), (1, 0x2000)] {
        heap.apply(restored(tid, ptr));
    }
    assert_eq!(heap.live_samples(), 0);
    // A plain free is not held for a restore.
    heap.apply(sampled(1, 4096, &[0x10]));
    heap.apply(returned(1, 0x3000));
    heap.apply(freed(1, 0x3000));
    heap.apply(restored(1, 0x3000));
    assert_eq!(heap.live_samples(), 0);
}
