//! Builds the eBPF programs (profiler-ebpf) for the BPF target with the
//! nightly toolchain and bpf-linker; the binary embeds the object.
fn main() -> anyhow::Result<()> {
    let manifest_dir = std::env::var("CARGO_MANIFEST_DIR")?;
    let ebpf_dir = format!("{manifest_dir}/../profiler-ebpf");
    aya_build::build_ebpf(
        [aya_build::Package {
            name: "profiler-ebpf",
            root_dir: &ebpf_dir,
            ..Default::default()
        }],
        aya_build::Toolchain::default(),
    )
}
