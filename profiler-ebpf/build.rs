use which::which;

/// Rebuild when bpf-linker changes: a new linker can change the object.
fn main() {
    let bpf_linker = which("bpf-linker").expect("bpf-linker not found: run `cargo xtask setup`");
    println!("cargo:rerun-if-changed={}", bpf_linker.display());
}
