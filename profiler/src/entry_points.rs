//! jemalloc's entry points, and which eBPF program watches each.
use iced_x86::Register;
use profiler_common::programs;

/// How an entry point passes its arguments, i.e. which program probes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CallShape {
    /// Size in the first argument: malloc, valloc, operator new.
    SizeArg0,
    /// Alignment, then size: aligned_alloc, memalign.
    SizeArg1,
    Calloc,
    /// Old pointer, then size: realloc.
    Realloc,
    PosixMemalign,
    Mallocx,
    Rallocx,
    Xallocx,
    /// Pointer in the first argument: free, dallocx, sdallocx, operator delete.
    Free,
}

impl CallShape {
    pub fn program(self) -> &'static str {
        match self {
            CallShape::SizeArg0 => programs::ALLOC_SIZE_ARG0,
            CallShape::SizeArg1 => programs::ALLOC_SIZE_ARG1,
            CallShape::Calloc => programs::ALLOC_CALLOC,
            CallShape::Realloc => programs::ALLOC_REALLOC,
            CallShape::PosixMemalign => programs::ALLOC_POSIX_MEMALIGN,
            CallShape::Mallocx => programs::ALLOC_MALLOCX,
            CallShape::Rallocx => programs::ALLOC_RALLOCX,
            CallShape::Xallocx => programs::RESIZE_XALLOCX,
            CallShape::Free => programs::FREE_ARG0,
        }
    }

    /// Whether the call's result is needed: the new pointer or size.
    pub fn needs_return(self) -> bool {
        self != CallShape::Free
    }

    /// The argument registers the entry program reads.
    pub fn reads(self) -> &'static [Register] {
        use Register::{RDI, RDX, RSI};
        match self {
            CallShape::SizeArg0 | CallShape::Xallocx | CallShape::Free => &[RDI],
            CallShape::SizeArg1 | CallShape::Calloc | CallShape::Realloc | CallShape::Mallocx => {
                &[RDI, RSI]
            }
            CallShape::PosixMemalign | CallShape::Rallocx => &[RDI, RSI, RDX],
        }
    }
}

/// C entry points; jemalloc may be built with a prefix (`je_`, `_rjem_`).
pub const C_ENTRY_POINTS: &[(&str, CallShape)] = &[
    ("malloc", CallShape::SizeArg0),
    ("calloc", CallShape::Calloc),
    ("realloc", CallShape::Realloc),
    ("free", CallShape::Free),
    ("posix_memalign", CallShape::PosixMemalign),
    ("aligned_alloc", CallShape::SizeArg1),
    ("memalign", CallShape::SizeArg1),
    ("valloc", CallShape::SizeArg0),
    ("mallocx", CallShape::Mallocx),
    ("rallocx", CallShape::Rallocx),
    ("xallocx", CallShape::Xallocx),
    ("dallocx", CallShape::Free),
    ("sdallocx", CallShape::Free),
];

/// The C++ operators jemalloc provides (mangled, never prefixed).
pub const CXX_ENTRY_POINTS: &[(&str, CallShape)] = &[
    ("_Znwm", CallShape::SizeArg0),
    ("_Znam", CallShape::SizeArg0),
    ("_ZnwmRKSt9nothrow_t", CallShape::SizeArg0),
    ("_ZnamRKSt9nothrow_t", CallShape::SizeArg0),
    ("_ZnwmSt11align_val_t", CallShape::SizeArg0),
    ("_ZnamSt11align_val_t", CallShape::SizeArg0),
    ("_ZnwmSt11align_val_tRKSt9nothrow_t", CallShape::SizeArg0),
    ("_ZnamSt11align_val_tRKSt9nothrow_t", CallShape::SizeArg0),
    ("_ZdlPv", CallShape::Free),
    ("_ZdaPv", CallShape::Free),
    ("_ZdlPvm", CallShape::Free),
    ("_ZdaPvm", CallShape::Free),
    ("_ZdlPvRKSt9nothrow_t", CallShape::Free),
    ("_ZdaPvRKSt9nothrow_t", CallShape::Free),
    ("_ZdlPvSt11align_val_t", CallShape::Free),
    ("_ZdaPvSt11align_val_t", CallShape::Free),
    ("_ZdlPvmSt11align_val_t", CallShape::Free),
    ("_ZdaPvmSt11align_val_t", CallShape::Free),
    ("_ZdlPvSt11align_val_tRKSt9nothrow_t", CallShape::Free),
    ("_ZdaPvSt11align_val_tRKSt9nothrow_t", CallShape::Free),
];

/// Functions only jemalloc defines, all three together: how an object is
/// recognised as jemalloc, whatever its prefix.
pub const SIGNATURE: [&str; 3] = ["mallocx", "rallocx", "sdallocx"];
