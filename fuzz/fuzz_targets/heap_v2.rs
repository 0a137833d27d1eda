//! Any bytes given to the `.heap` reader: an error or a profile, never a
//! panic, and whatever parses goes through the analyses without one either.
#![no_main]

use profiler::{
    offline::{
        analysis::{LeakOptions, diff, rank_sites},
        report::{Measure, rows},
    },
    output::heap_v2::read::parse,
};

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    if let Ok(heap) = parse(&text) {
        let _ = diff(&heap, &heap);
        let _ = rank_sites(std::slice::from_ref(&heap), &LeakOptions::default());
        let names = |frames: &[u64]| frames.iter().map(|f| format!("{f:x}")).collect();
        let _ = rows(&heap, Measure::AllocObjects, names);
    }
});
