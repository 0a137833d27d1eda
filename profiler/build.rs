//! Builds the eBPF programs (profiler-ebpf) for the BPF target with the
//! nightly toolchain and bpf-linker; the binary embeds the object.
fn main() -> anyhow::Result<()> {
    // A fuzz build (`--cfg fuzzing`) never loads the programs: it embeds an
    // empty object, and skips the minute and more a nested build takes.
    if std::env::var_os("CARGO_CFG_FUZZING").is_some() {
        let out_dir = std::env::var("OUT_DIR")?;
        std::fs::write(format!("{out_dir}/profiler"), [])?;
        return Ok(());
    }
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
