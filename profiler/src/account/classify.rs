//! Whose a mapping is, by the stack that made it: the first frame, from
//! the innermost, that belongs to an allocator, to thread creation or to a
//! JVM decides; a stack with none of them is a direct mapping by the
//! program's own code.
use std::path::Path;

use crate::{proc::Mapping, symbolize::Namer};

/// Whose a mapping is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Owner {
    /// An allocator's ("jemalloc", "glibc", "mimalloc", "tcmalloc").
    Allocator(&'static str),
    ThreadStack,
    /// A JVM's (libjvm made it: its heap, code cache, metaspace).
    Jvm,
    /// The program's own, mapped directly.
    Site,
}

impl Owner {
    /// How profiles label it.
    pub fn label(&self) -> &'static str {
        match self {
            Owner::Allocator(name) => name,
            Owner::ThreadStack => "thread stack",
            Owner::Jvm => "JVM",
            Owner::Site => "direct",
        }
    }
}

/// glibc functions that map memory for malloc: its entry points (named in
/// any libc), and its internals (named where libc has its symbols).
const GLIBC_MALLOC: [&str; 26] = [
    "malloc",
    "calloc",
    "realloc",
    "reallocarray",
    "free",
    "memalign",
    "posix_memalign",
    "aligned_alloc",
    "valloc",
    "pvalloc",
    "sysmalloc",
    "sysmalloc_mmap",
    "sysmalloc_mmap_fallback",
    "new_heap",
    "alloc_new_heap",
    "_int_new_arena",
    "arena_get2",
    "_int_malloc",
    "_int_realloc",
    "mremap_chunk",
    "__libc_malloc",
    "__libc_calloc",
    "__libc_realloc",
    "_int_memalign",
    "_mid_memalign",
    "tcache_init",
];

/// glibc functions that map a new thread's stack.
const THREAD_STACK: [&str; 3] = ["allocate_stack", "pthread_create", "__pthread_create_2_1"];

/// The owner of a mapping made by `frames` (return addresses, innermost
/// first), named by `namer`, placed in files by `mappings`.
pub fn owner(frames: &[u64], namer: &mut Namer, mappings: &[Mapping]) -> Owner {
    for &frame in frames {
        let address = frame.saturating_sub(1);
        let file = mappings
            .iter()
            .find(|m| m.range().contains(address))
            .and_then(|m| m.path.as_deref())
            .and_then(|p| Path::new(p).file_name())
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let names = namer.names(address);
        if let Some(owner) = owner_of_frame(&file, &names) {
            return owner;
        }
    }
    Owner::Site
}

/// The owner a frame in `file` with functions `names` (innermost inlined
/// first) decides, if any.
pub fn owner_of_frame(file: &str, names: &[String]) -> Option<Owner> {
    if file.starts_with("libjvm") {
        return Some(Owner::Jvm);
    }
    for (needle, allocator) in [
        ("jemalloc", "jemalloc"),
        ("mimalloc", "mimalloc"),
        ("tcmalloc", "tcmalloc"),
    ] {
        if file.contains(needle) {
            return Some(Owner::Allocator(allocator));
        }
    }
    for name in names {
        let function = name.split('(').next().unwrap_or(name);
        let function = function.split('@').next().unwrap_or(function);
        if THREAD_STACK.contains(&function) {
            return Some(Owner::ThreadStack);
        }
        if let Some(allocator) = allocator_function(function, file) {
            return Some(Owner::Allocator(allocator));
        }
    }
    None
}

/// The allocator whose internal function `function` is: jemalloc's carry
/// its `je_` prefix (after any of the embedder's, `_rjem_je_`), mimalloc's
/// `mi_`, tcmalloc's its namespace, glibc's malloc is known by name.
fn allocator_function(function: &str, file: &str) -> Option<&'static str> {
    if function.starts_with("je_") || function.contains("_je_") {
        return Some("jemalloc");
    }
    if function.starts_with("mi_") || function.starts_with("_mi_") {
        return Some("mimalloc");
    }
    if function.starts_with("tcmalloc::") {
        return Some("tcmalloc");
    }
    (file.starts_with("libc.so") && GLIBC_MALLOC.contains(&function)).then_some("glibc")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(list: &[&str]) -> Vec<String> {
        list.iter().map(|n| n.to_string()).collect()
    }

    #[test]
    fn frames_decide_by_their_file_and_function() {
        let owner = |file, list: &[&str]| owner_of_frame(file, &names(list));
        assert_eq!(owner("libc.so.6", &["__mmap"]), None);
        assert_eq!(
            owner("libc.so.6", &["sysmalloc"]),
            Some(Owner::Allocator("glibc"))
        );
        assert_eq!(
            owner("libc.so.6", &["malloc"]),
            Some(Owner::Allocator("glibc"))
        );
        assert_eq!(
            owner("libc.so.6", &["allocate_stack"]),
            Some(Owner::ThreadStack)
        );
        assert_eq!(
            owner("libjemalloc.so.2", &["pages_map"]),
            Some(Owner::Allocator("jemalloc"))
        );
        assert_eq!(
            owner("server", &["_rjem_je_pages_map"]),
            Some(Owner::Allocator("jemalloc"))
        );
        assert_eq!(
            owner("libjvm.so", &["os::reserve_memory"]),
            Some(Owner::Jvm)
        );
        // The program's own function named like glibc's is not glibc's.
        assert_eq!(owner("server", &["sysmalloc"]), None);
        assert_eq!(owner("server", &["pool_reserve"]), None);
    }
}
