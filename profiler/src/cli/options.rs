//! The flags turned into the library's options.
use profiler::{
    collect::CollectorOptions,
    kernel::{KernelOptions, PlacementMode, ReturnProbes},
    output::Format,
    run::{Retention, Sampling, SessionOptions, Targets},
};

use crate::cli::{
    Cli,
    values::{AllocatorArg, PlacementArg, ReturnProbesArg, SamplingArg, TrackArg, UnwindArg},
};

impl Cli {
    pub fn session_options(&self, progress: bool) -> SessionOptions {
        let targets = if self.all {
            Targets::All
        } else if !self.command.is_empty() {
            Targets::Launch(self.command.clone())
        } else {
            Targets::Pids(self.pids.clone())
        };
        SessionOptions {
            targets,
            duration: self.duration,
            output_dir: self.output.clone(),
            sample_interval: self.sample_interval,
            kernel: self.kernel_options(),
            collector: CollectorOptions {
                allocations_only: self.track == TrackArg::Allocations,
                max_live: self.max_live_samples,
                ..CollectorOptions::default()
            },
            verbose: self.verbose,
            progress,
            snapshot_interval: self.interval,
            dump_on_growth: self.dump_on_growth.clone(),
            min_dump_gap: self.min_dump_gap,
            follow_on_growth: self.follow_on_growth,
            java_perfmap: !self.no_java_perfmap,
            debug_dir: self.debug_dir.clone(),
            allocators: AllocatorArg::kinds(&self.allocator),
            max_overhead: self.max_overhead.0,
            sampling: match self.sampling {
                SamplingArg::Entry => Sampling::Entry,
                SamplingArg::Windows => Sampling::Windows,
            },
            windows: self.windows,
            recalibrate_every: self.recalibrate_every.0,
            listen: self.listen,
            access: self.access_options(),
            retention: Retention {
                keep: self.keep.map(|n| n as usize),
                max_disk: self.max_disk,
            },
            formats: if self.format.is_empty() {
                Format::ALL.to_vec()
            } else {
                self.format.clone()
            },
            ..SessionOptions::default()
        }
    }

    /// How probes are placed and linked, and what the kernel copies.
    fn kernel_options(&self) -> KernelOptions {
        KernelOptions {
            placement: match self.placement {
                PlacementArg::Emulated => PlacementMode::Emulated,
                PlacementArg::Entry => PlacementMode::Entry,
            },
            return_probes: match self.return_probes {
                ReturnProbesArg::Auto => ReturnProbes::Auto,
                ReturnProbesArg::Sessions => ReturnProbes::Sessions,
                ReturnProbesArg::Uretprobes => ReturnProbes::Uretprobes,
            },
            copy_stack: self.unwind != UnwindArg::Fp,
            frame_pointer_fast_path: self.unwind == UnwindArg::Auto,
            allocations_only: self.track == TrackArg::Allocations,
            ring_buffer_bytes: self.ring_buffer,
            ..KernelOptions::default()
        }
    }

    /// Who may use `--listen`'s endpoints, and over what.
    fn access_options(&self) -> profiler::AccessOptions {
        profiler::AccessOptions {
            tls_cert: self.tls_cert.clone(),
            tls_key: self.tls_key.clone(),
            tls_client_ca: self.tls_client_ca.clone(),
            token_file: self.auth_token_file.clone(),
            insecure: self.listen_insecure,
        }
    }
}
