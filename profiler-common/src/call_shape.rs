//! How each entry point passes its arguments: the one table of shapes
//! the eBPF programs and the profiler go by.
use crate::programs;

/// How an entry point passes its arguments, and so which programs probe
/// it: the one table of shapes both sides go by.
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
    /// jemalloc's `malloc_default`, where `malloc` and `operator new` go
    /// when their inlined fast path cannot serve: size in the first argument.
    SlowPath,
    /// jemalloc's `arena_malloc_hard(tsdn, arena, size, ind, zero)`, where
    /// `malloc_default` sends the requests no thread cache holds (above
    /// [`crate::FastPathConfig::large_above`]): size in the third argument.
    /// A call is counted only when it comes from the slow path
    /// ([`crate::FastPathConfig::callers`]) and is that large; small and
    /// middle-sized requests never trap there.
    LargeRequest,
    /// jemalloc's `prof_malloc_sample_object(tsd, ptr, size, usize, tctx)`:
    /// an allocation jemalloc's own profiler (`prof:true`) sampled, its
    /// pointer already known.
    OwnSample,
    /// `realloc` or `rallocx` where jemalloc's own profiler samples: old
    /// pointer, then size. Only the free of the old pointer is followed,
    /// and undone if the call fails.
    FreeInResize,
}

impl CallShape {
    pub const ALL: [CallShape; 13] = [
        CallShape::SlowPath,
        CallShape::LargeRequest,
        CallShape::OwnSample,
        CallShape::FreeInResize,
        CallShape::SizeArg0,
        CallShape::SizeArg1,
        CallShape::Calloc,
        CallShape::Realloc,
        CallShape::PosixMemalign,
        CallShape::Mallocx,
        CallShape::Rallocx,
        CallShape::Xallocx,
        CallShape::Free,
    ];

    /// The plain uprobe program, and the uprobe-session program of shapes
    /// whose call's result is needed.
    pub const fn programs(self) -> (&'static str, Option<&'static str>) {
        use programs::session;
        match self {
            CallShape::SizeArg0 => (programs::ALLOC_SIZE_ARG0, Some(session::SIZE_ARG0)),
            CallShape::SizeArg1 => (programs::ALLOC_SIZE_ARG1, Some(session::SIZE_ARG1)),
            CallShape::Calloc => (programs::ALLOC_CALLOC, Some(session::CALLOC)),
            CallShape::Realloc => (programs::ALLOC_REALLOC, Some(session::REALLOC)),
            CallShape::PosixMemalign => (
                programs::ALLOC_POSIX_MEMALIGN,
                Some(session::POSIX_MEMALIGN),
            ),
            CallShape::Mallocx => (programs::ALLOC_MALLOCX, Some(session::MALLOCX)),
            CallShape::Rallocx => (programs::ALLOC_RALLOCX, Some(session::RALLOCX)),
            CallShape::Xallocx => (programs::RESIZE_XALLOCX, Some(session::XALLOCX)),
            CallShape::Free => (programs::FREE_ARG0, None),
            CallShape::SlowPath => (programs::ALLOC_SLOW_PATH, Some(session::SLOW_PATH)),
            CallShape::LargeRequest => {
                (programs::ALLOC_LARGE_REQUEST, Some(session::LARGE_REQUEST))
            }
            CallShape::OwnSample => (programs::OWN_SAMPLE, None),
            // Without sessions, a plain free (see `returns_by_uretprobe`).
            CallShape::FreeInResize => (programs::FREE_ARG0, Some(session::FREE_IN_RESIZE)),
        }
    }

    pub const fn program(self) -> &'static str {
        self.programs().0
    }

    pub const fn session_program(self) -> Option<&'static str> {
        self.programs().1
    }

    /// Whether the call's result is needed: the new pointer or size.
    pub const fn needs_return(self) -> bool {
        self.session_program().is_some()
    }

    /// Whether, where uprobe sessions are missing, the return half comes
    /// from a uretprobe on every call. Not for a realloc under jemalloc's
    /// own samples: a uretprobe on every realloc, for the rare one that
    /// fails, would cost more than it tells, so there it is a plain free.
    pub const fn returns_by_uretprobe(self) -> bool {
        self.needs_return() && !matches!(self, CallShape::FreeInResize)
    }

    /// Shapes whose entry point allocates (for reports).
    pub const fn allocates(self) -> bool {
        !matches!(
            self,
            CallShape::Free | CallShape::Xallocx | CallShape::FreeInResize
        )
    }
}
