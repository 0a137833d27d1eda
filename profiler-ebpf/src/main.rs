//! Uprobes on jemalloc's entry points. Thin on purpose: count bytes down,
//! and for the rare sampled call record size, stack and pointer; userspace
//! does everything else.
//!
//! Every entry point that needs its call's result comes twice: a plain
//! uprobe (paired with the `call_return` uretprobe, which runs on every
//! call), and a uprobe-session program (kernel 6.13+) that serves both
//! halves and asks for the return half only when the call was sampled.
#![no_std]
#![no_main]
// Atomic adds on map values: core's Atomic types need a compare-and-swap
// the BPF target does not offer.
#![feature(core_intrinsics)]
#![allow(internal_features)]

mod alloc;
mod exits;
mod mapped;
mod maps;
mod python;
mod release;
mod ring;
mod sampled;
mod sampling;
mod slow_path;
mod thread_bases;

use core::ffi::c_void;

use alloc::{on_allocation, record_allocation};
use aya_ebpf::{
    macros::{uprobe, uretprobe},
    programs::{ProbeContext, RetProbeContext},
};
use maps::PENDING;
use profiler_common::{PendingCall, pending_kind};
use release::{
    expect_restore, finish_allocation, on_free, on_free_in_resize, on_resize_entry, on_return,
};
use sampling::{Args, Thread, count_hit, probe_cookie, session};
use slow_path::{on_large_request, on_slow_path};

/// Declares the plain and the session program of one entry-point shape.
/// `$entry` returns whether the call's return half is needed.
macro_rules! entry_point {
    ($(#[$doc:meta])* $plain:ident, $session:ident, $entry:ident) => {
        $(#[$doc])*
        #[uprobe]
        pub fn $plain(ctx: ProbeContext) -> u32 {
            if let Some(thread) = Thread::current() {
                $entry(&ctx, &thread);
            }
            0
        }

        session_program!($session, $entry);
    };
}

/// Declares the uprobe-session program of one entry-point shape.
macro_rules! session_program {
    ($(#[$doc:meta])* $session:ident, $entry:ident) => {
        $(#[$doc])*
        // Not `#[uprobe]`: its wrapper returns 0 whatever the function
        // returns, and a session entry's return value is what matters. The
        // section is the plain uprobe one so that aya parses the object;
        // userspace loads these programs itself (`uprobe_multi`).
        #[unsafe(no_mangle)]
        #[unsafe(link_section = "uprobe")]
        pub fn $session(ctx: *mut c_void) -> u32 {
            session(&ProbeContext::new(ctx), $entry)
        }
    };
}

entry_point!(
    /// malloc, valloc, operator new (all variants): size in the first argument.
    alloc_size_arg0,
    session_size_arg0,
    size_arg0
);
entry_point!(
    /// aligned_alloc, memalign: alignment first, size second.
    alloc_size_arg1,
    session_size_arg1,
    size_arg1
);
entry_point!(
    /// calloc(count, size).
    alloc_calloc,
    session_calloc,
    calloc
);
entry_point!(
    /// realloc(ptr, size): a free of `ptr`, then an allocation.
    alloc_realloc,
    session_realloc,
    realloc
);
entry_point!(
    /// posix_memalign(&ptr, alignment, size): the pointer is stored, not returned.
    alloc_posix_memalign,
    session_posix_memalign,
    posix_memalign
);
entry_point!(
    /// mallocx(size, flags): the low 6 bits of flags are lg(alignment).
    alloc_mallocx,
    session_mallocx,
    mallocx
);
entry_point!(
    /// rallocx(ptr, size, flags).
    alloc_rallocx,
    session_rallocx,
    rallocx
);
entry_point!(
    /// xallocx(ptr, size, extra, flags): resizes in place, returns the new size.
    resize_xallocx,
    session_xallocx,
    xallocx
);

session_program!(
    /// realloc and rallocx where jemalloc's own profiler samples (its
    /// samples come from `own_sample`): a free of the first argument,
    /// undone at the return if the call fails. Without sessions these calls
    /// are plain frees (`free_arg0`).
    session_free_in_resize,
    free_in_resize_entry
);

entry_point!(
    /// jemalloc's malloc_default: the slow path of malloc and operator new.
    alloc_slow_path,
    session_slow_path,
    on_slow_path
);

entry_point!(
    /// jemalloc's arena_malloc_hard, where the slow path sends requests no
    /// thread cache holds: size in the third argument.
    alloc_large_request,
    session_large_request,
    on_large_request
);

#[inline(always)]
fn size_arg0(ctx: &ProbeContext, thread: &Thread) -> bool {
    let args = Args::of(ctx);
    on_allocation(ctx, thread, args.arg(0), 0, returned_pointer())
}

#[inline(always)]
fn size_arg1(ctx: &ProbeContext, thread: &Thread) -> bool {
    let args = Args::of(ctx);
    on_allocation(ctx, thread, args.arg(1), args.arg(0), returned_pointer())
}

#[inline(always)]
fn calloc(ctx: &ProbeContext, thread: &Thread) -> bool {
    let args = Args::of(ctx);
    let (count, size) = (args.arg(0), args.arg(1));
    // BPF has no 128-bit multiply, so no overflow check by multiplication:
    // products of 32-bit values fit; beyond that only a count of 1 is real.
    let total = if (count | size) >> 32 == 0 {
        count * size
    } else if count <= 1 || size <= 1 {
        count.max(size) * count.min(size).min(1)
    } else {
        u64::MAX
    };
    on_allocation(ctx, thread, total, 0, returned_pointer())
}

#[inline(always)]
fn realloc(ctx: &ProbeContext, thread: &Thread) -> bool {
    let args = Args::of(ctx);
    resize(ctx, thread, args.arg(0), args.arg(1), 0)
}

/// realloc and rallocx: a free of `ptr` (undone if the call fails), then
/// an allocation of `size`. Returns whether the return half is needed.
#[inline(always)]
fn resize(ctx: &ProbeContext, thread: &Thread, ptr: u64, size: u64, align: u64) -> bool {
    let restorable = on_free_in_resize(ctx, ptr, size);
    let pending = PendingCall {
        kind: pending_kind::RETURNED_POINTER,
        addr: if restorable { ptr } else { 0 },
    };
    on_allocation(ctx, thread, size, align, pending)
        || (restorable && expect_restore(ctx, thread, ptr))
}

#[inline(always)]
fn free_in_resize_entry(ctx: &ProbeContext, thread: &Thread) -> bool {
    sampling::count_entry(ctx);
    // Whoever asks for this call's return half, jemalloc's samples inside
    // it find the trampoline where its return address was.
    thread.note_resize_return(ctx);
    let args = Args::of(ctx);
    let ptr = args.arg(0);
    on_free_in_resize(ctx, ptr, args.arg(1)) && expect_restore(ctx, thread, ptr)
}

#[inline(always)]
fn posix_memalign(ctx: &ProbeContext, thread: &Thread) -> bool {
    let args = Args::of(ctx);
    let pending = PendingCall {
        kind: pending_kind::STORED_POINTER,
        addr: args.arg(0),
    };
    on_allocation(ctx, thread, args.arg(2), args.arg(1), pending)
}

#[inline(always)]
fn mallocx(ctx: &ProbeContext, thread: &Thread) -> bool {
    let args = Args::of(ctx);
    let align = sampling::mallocx_alignment(args.arg(1));
    on_allocation(ctx, thread, args.arg(0), align, returned_pointer())
}

#[inline(always)]
fn rallocx(ctx: &ProbeContext, thread: &Thread) -> bool {
    let args = Args::of(ctx);
    let align = sampling::mallocx_alignment(args.arg(2));
    resize(ctx, thread, args.arg(0), args.arg(1), align)
}

#[inline(always)]
fn xallocx(ctx: &ProbeContext, thread: &Thread) -> bool {
    sampling::count_entry(ctx);
    let args = Args::of(ctx);
    on_resize_entry(ctx, thread, args.arg(0))
}

/// free, dallocx, sdallocx, operator delete (all variants): pointer first.
#[uprobe]
pub fn free_arg0(ctx: ProbeContext) -> u32 {
    sampling::count_entry(&ctx);
    let args = Args::of(&ctx);
    on_free(&ctx, args.arg(0));
    0
}

/// jemalloc's `prof_malloc_sample_object(tsd, ptr, size, usize, tctx)`:
/// jemalloc's own profiler sampled this allocation (by usable bytes, like
/// memprobe's countdown); its pointer is known, so no return half.
#[uprobe]
pub fn own_sample(ctx: ProbeContext) -> u32 {
    let Some(thread) = Thread::current() else {
        return 0;
    };
    // Deep inside jemalloc: a frame-pointer walk from here names no caller.
    let thread = Thread {
        past_entry: true,
        ..thread
    };
    count_hit(&ctx);
    let args = Args::of(&ctx);
    let (ptr, usable) = (args.arg(1), args.arg(3));
    // No return half: the thread's call in flight (a probed realloc
    // around this sample) keeps its own.
    if record_allocation(&ctx, &thread, usable, 0, returned_pointer(), 0) {
        let _ = PENDING.remove(thread.id);
        finish_allocation(thread.id, probe_cookie(&ctx), ptr);
    }
    0
}

/// The return half of every plain entry program that may want its result.
#[uretprobe]
pub fn call_return(ctx: RetProbeContext) -> u32 {
    on_return(&ctx, ctx.ret());
    0
}

const fn returned_pointer() -> PendingCall {
    PendingCall {
        kind: pending_kind::RETURNED_POINTER,
        addr: 0,
    }
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 4] = *b"GPL\0";
