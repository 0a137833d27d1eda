//! A program that runs jemalloc's own profiler (`prof:true`): the Rust
//! fixture on tikv-jemallocator built with `profiling`, in its timed loop
//! (a free and an allocation a pair, scattered over a pool), attached with
//! `--pid`. memprobe takes jemalloc's samples there; with the profiler
//! inactive it probes as usual (malloc in windows).
use std::{path::Path, process::Command};

use anyhow::Result;

use super::attached::{Attached, WINDOWS_WARMUP, best_of_three, start_timed, wait_ns};

/// What memprobe says when it takes jemalloc's own samples.
const OWN_SAMPLES: &str = "jemalloc's own samples";

/// Nanoseconds per pair.
pub(super) struct OwnProfiler {
    none: f64,
    prof_none: f64,
    own: f64,
    inactive: f64,
}

pub(super) fn own_profiler(memprobe: &Path, profiles_dir: &str) -> Result<OwnProfiler> {
    eprintln!("bench: a loop running jemalloc's own profiler (prof:true), attached with --pid");
    // Built as the tests build it, into the same target folder.
    let fixture = tests::rust_prof_fixture();
    let command = |conf: &str| {
        let mut command = Command::new(&fixture);
        command
            .env("FIXTURE_LOOP_SECONDS", "3")
            .env("_RJEM_MALLOC_CONF", conf);
        command
    };
    let alone = |conf: &str| best_of_three(|| Ok(wait_ns(start_timed(command(conf), None)?)?.0));
    let none = alone("")?;
    let prof_none = alone("prof:true")?;
    let attached = |conf: &'static str, warmup, said_first| {
        let attached = Attached {
            warmup: Some(warmup),
            said_first,
            ..Attached::new(memprobe, profiles_dir, &["-v"])
        };
        attached.ns(|| command(conf))
    };
    // memprobe says it at attach, before the loop's delay ends.
    let own = attached("prof:true", "1", Some(OWN_SAMPLES))?;
    let inactive = attached("prof:true,prof_active:false", WINDOWS_WARMUP, None)?;
    Ok(OwnProfiler {
        none,
        prof_none,
        own,
        inactive,
    })
}

/// docs/overhead.md's table.
pub(super) fn own_profiler_table(r: &OwnProfiler) -> String {
    let added = |ns: f64| ns - r.prof_none;
    format!(
        "\n| a Rust loop on tikv-jemallocator (`profiling`): a free and an allocation of 64-127 B a pair, scattered over 4096 live vectors; attached with `--pid` | ns per pair | added ns vs `prof:true` alone |\n|---|---|---|\n\
         | no profiler, jemalloc's profiler off | {:.1} | - |\n\
         | no profiler, `_RJEM_MALLOC_CONF=prof:true` (jemalloc samples every 512 KiB) | {:.1} | - |\n\
         | memprobe, `prof:true`: jemalloc's own samples taken (a trap per sample and per free off the fast path) | {:.1} | {:.1} |\n\
         | memprobe, `prof:true,prof_active:false`: memprobe's own sampling (malloc in windows, timed once they narrowed; every free traps) | {:.0} | {:.0} |\n",
        r.none,
        r.prof_none,
        r.own,
        added(r.own),
        r.inactive,
        added(r.inactive),
    )
}
