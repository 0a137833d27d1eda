//! Uprobes on jemalloc's entry points. Thin on purpose: count bytes down,
//! and for the rare sampled call record size, stack and pointer; userspace
//! does everything else.
#![no_std]
#![no_main]

mod maps;
mod record;

use aya_ebpf::{
    macros::{uprobe, uretprobe},
    programs::{ProbeContext, RetProbeContext},
};
use profiler_common::{PendingCall, pending_kind};
use record::{Args, on_allocation, on_free, on_resize_entry, on_return};

/// malloc, valloc, operator new (all variants): size in the first argument.
#[uprobe]
pub fn alloc_size_arg0(ctx: ProbeContext) -> u32 {
    let args = Args::of(&ctx);
    on_allocation(&ctx, args.arg(0), 0, returned_pointer())
}

/// aligned_alloc, memalign: alignment first, size second.
#[uprobe]
pub fn alloc_size_arg1(ctx: ProbeContext) -> u32 {
    let args = Args::of(&ctx);
    on_allocation(&ctx, args.arg(1), args.arg(0), returned_pointer())
}

/// calloc(count, size).
#[uprobe]
pub fn alloc_calloc(ctx: ProbeContext) -> u32 {
    let args = Args::of(&ctx);
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
    on_allocation(&ctx, total, 0, returned_pointer())
}

/// realloc(ptr, size): a free of `ptr`, then an allocation.
#[uprobe]
pub fn alloc_realloc(ctx: ProbeContext) -> u32 {
    let args = Args::of(&ctx);
    on_free(&ctx, args.arg(0));
    on_allocation(&ctx, args.arg(1), 0, returned_pointer())
}

/// posix_memalign(&ptr, alignment, size): the pointer is stored, not returned.
#[uprobe]
pub fn alloc_posix_memalign(ctx: ProbeContext) -> u32 {
    let args = Args::of(&ctx);
    let pending = PendingCall {
        kind: pending_kind::STORED_POINTER,
        addr: args.arg(0),
    };
    on_allocation(&ctx, args.arg(2), args.arg(1), pending)
}

/// mallocx(size, flags): the low 6 bits of flags are lg(alignment).
#[uprobe]
pub fn alloc_mallocx(ctx: ProbeContext) -> u32 {
    let args = Args::of(&ctx);
    on_allocation(
        &ctx,
        args.arg(0),
        record::mallocx_alignment(args.arg(1)),
        returned_pointer(),
    )
}

/// rallocx(ptr, size, flags).
#[uprobe]
pub fn alloc_rallocx(ctx: ProbeContext) -> u32 {
    let args = Args::of(&ctx);
    on_free(&ctx, args.arg(0));
    on_allocation(
        &ctx,
        args.arg(1),
        record::mallocx_alignment(args.arg(2)),
        returned_pointer(),
    )
}

/// xallocx(ptr, size, extra, flags): resizes in place, returns the new size.
#[uprobe]
pub fn resize_xallocx(ctx: ProbeContext) -> u32 {
    record::count_entry(&ctx);
    let args = Args::of(&ctx);
    on_resize_entry(&ctx, args.arg(0));
    0
}

/// free, dallocx, sdallocx, operator delete (all variants): pointer first.
#[uprobe]
pub fn free_arg0(ctx: ProbeContext) -> u32 {
    record::count_entry(&ctx);
    let args = Args::of(&ctx);
    on_free(&ctx, args.arg(0));
    0
}

/// The return half of every call above that may want its result.
#[uretprobe]
pub fn call_return(ctx: RetProbeContext) -> u32 {
    on_return(&ctx);
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
