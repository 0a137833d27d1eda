//! The kernels suite: the release binary's smoke suite on the host's own
//! kernel and inside Debian's 6.1 and 6.12 kernels booted under qemu (TCG:
//! these machines have no KVM), with one table of results.
mod checks;
mod initramfs;
mod setup;

use std::{
    fs,
    io::{BufRead, BufReader},
    path::Path,
    process::{Command, Stdio},
    sync::mpsc,
    time::{Duration, Instant},
};

use anyhow::{Context, Result};

use checks::Outcome;
use initramfs::Programs;
use setup::{Kernel, Vm};

/// Longest a VM may run before it is killed and its kernel failed. The 6.1
/// guest, whose probes are perf events and whose every trap qemu emulates,
/// ran the suite in 136 s when most fixture mallocs went by unprobed (on
/// jemalloc's slow path); with windows, which probe every call of a short
/// program, it no longer ended within 150 s. The Python walk's global
/// function, which 6.1's verifier checks in every sampling program, added
/// some 10 s to each attach there (measured under qemu: 22-26 s to 33-35 s
/// for an attach of a second), and the suite took 191 s. With the sections
/// added since, it took 203 to 254 s here, and 389 s on a slower host
/// (2026-12-01, 2.7% of its CPU time stolen): the limit, which only a hang
/// should reach, leaves room for a slower one still.
const VM_TIMEOUT: Duration = Duration::from_secs(600);

/// Installs what booting kernels needs (for `cargo xtask setup`).
pub fn install() -> Result<()> {
    setup::qemu()?;
    setup::kernels()?;
    Ok(())
}

/// Runs the suite everywhere; returns (kernels passed, kernels failed).
pub fn run(memprobe: &Path) -> Result<(u64, u64)> {
    let vm = setup::qemu()?;
    let kernels = setup::kernels()?;
    let dir = setup::vm_dir();
    let programs = Programs {
        memprobe: memprobe.to_owned(),
        sites: initramfs::build_sites(&dir)?,
    };
    let archive = initramfs::build(&programs, &dir)?;
    let mut rows = Vec::new();
    eprintln!("xtask: kernels: the smoke suite on the host's kernel");
    let started = Instant::now();
    rows.push((
        "host".to_owned(),
        on_host(&programs, &dir)?,
        started.elapsed(),
    ));
    // The guests at once: each runs on one host thread (single-threaded
    // TCG), and the host is otherwise idle by then, so two take the time of
    // the slower (6.1's) rather than the sum.
    let booted: Vec<Result<(Outcome, Duration)>> = std::thread::scope(|scope| {
        let guests: Vec<_> = kernels
            .iter()
            .map(|kernel| scope.spawn(|| boot(&vm, kernel, &archive, &dir)))
            .collect();
        guests
            .into_iter()
            .map(|g| {
                g.join()
                    .unwrap_or_else(|_| anyhow::bail!("a guest's thread panicked"))
            })
            .collect()
    });
    for (kernel, result) in kernels.iter().zip(booted) {
        let (outcome, took) = result?;
        rows.push((kernel.package.clone(), outcome, took));
    }
    let table = table(&rows);
    println!("{table}");
    fs::write(dir.join("results.md"), &table)?;
    let passed = rows.iter().filter(|(_, o, _)| o.passed()).count() as u64;
    Ok((passed, rows.len() as u64 - passed))
}

/// Boots `kernel` with the suite, and once more if the guest kernel itself
/// crashed (before single-threaded TCG: an int3 oops in the scheduler, in
/// no code of memprobe's), which the table then says.
fn boot(vm: &Vm, kernel: &Kernel, archive: &Path, dir: &Path) -> Result<(Outcome, Duration)> {
    eprintln!("xtask: kernels: booting {} under qemu", kernel.package);
    let started = Instant::now();
    let mut outcome = in_vm(vm, kernel, archive, dir)?;
    if !outcome.passed() && kernel_oopsed(dir, &kernel.package) {
        eprintln!(
            "xtask: kernels: {} oopsed; booting it again",
            kernel.package
        );
        let log = dir.join(format!("{}.log", kernel.package));
        fs::rename(&log, dir.join(format!("{}.oops.log", kernel.package)))?;
        outcome = in_vm(vm, kernel, archive, dir)?;
        outcome.kernel = format!("{} (booted twice: the first boot oopsed)", outcome.kernel);
    }
    Ok((outcome, started.elapsed()))
}

fn on_host(programs: &Programs, dir: &Path) -> Result<Outcome> {
    let bin = dir.join("host-bin");
    fs::create_dir_all(&bin)?;
    fs::copy(&programs.memprobe, bin.join("memprobe"))?;
    fs::copy(&programs.sites, bin.join("sites"))?;
    let output = Command::new("sh")
        .arg("-c")
        .arg(initramfs::SMOKE_SCRIPT)
        .env("SMOKE_BIN", &bin)
        .env("SMOKE_OUT", dir.join("host-out"))
        .stderr(Stdio::inherit())
        .output()
        .context("running the smoke suite")?;
    let uname = Command::new("uname").arg("-r").output()?;
    let text = format!(
        "@@ kernel\n{}@@ end\n{}",
        String::from_utf8_lossy(&uname.stdout),
        String::from_utf8_lossy(&output.stdout)
    );
    fs::write(dir.join("host.log"), &text)?;
    Ok(checks::judge(&text))
}

/// Whether the guest kernel's own log shows it crashed.
fn kernel_oopsed(dir: &Path, package: &str) -> bool {
    fs::read_to_string(dir.join(format!("{package}.log")))
        .is_ok_and(|log| log.contains("Oops:") || log.contains("Kernel panic"))
}

/// Boots `kernel` with the suite as `/init`, reads its serial console until
/// it powers off (or [`VM_TIMEOUT`]), and judges what it printed.
fn in_vm(vm: &Vm, kernel: &Kernel, archive: &Path, dir: &Path) -> Result<Outcome> {
    let mut child = Command::new(&vm.qemu)
        .arg("-L")
        .arg(&vm.firmware)
        // One host thread for both vCPUs: with a thread each, a vCPU could
        // run a stale translation of kernel code the other had just
        // patched through an int3, and the guest oopsed on that int3 at
        // boot (seen twice on 6.12, in the scheduler's code).
        .args(["-accel", "tcg,thread=single", "-cpu", "max", "-smp", "2"])
        .args(["-m", "2048", "-nographic", "-nic", "none", "-no-reboot"])
        .arg("-kernel")
        .arg(&kernel.vmlinuz)
        .arg("-initrd")
        .arg(archive)
        .args([
            "-append",
            "console=ttyS0 rdinit=/init panic=-1 quiet loglevel=1",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {}", vm.qemu.display()))?;
    let stdout = child.stdout.take().context("qemu's output")?;
    let (lines, received) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if lines.send(line).is_err() {
                break;
            }
        }
    });
    let deadline = Instant::now() + VM_TIMEOUT;
    let mut text = String::new();
    while let Some(left) = deadline.checked_duration_since(Instant::now()) {
        match received.recv_timeout(left) {
            Ok(line) => {
                text.push_str(&line);
                text.push('\n');
            }
            Err(_) => break,
        }
    }
    let _ = child.kill();
    let _ = child.wait();
    let log = dir.join(format!("{}.log", kernel.package));
    fs::write(&log, &text)?;
    let mut outcome = checks::judge(&text);
    outcome.kernel = format!("{} ({})", outcome.kernel, kernel.series);
    Ok(outcome)
}

/// "kernel | mode used | result", then each failed check's detail.
fn table(rows: &[(String, Outcome, Duration)]) -> String {
    let mut text = String::from(
        "| kernel | booted from | mode used | result | time |\n|---|---|---|---|---|\n",
    );
    for (source, outcome, took) in rows {
        let passed = outcome.checks.iter().filter(|c| c.passed).count();
        text.push_str(&format!(
            "| {} | {source} | return probes: {} | {} ({passed}/{} checks) | {:.0} s |\n",
            outcome.kernel,
            outcome.mode,
            if outcome.passed() { "pass" } else { "FAIL" },
            outcome.checks.len(),
            took.as_secs_f64()
        ));
    }
    for (source, outcome, _) in rows {
        for check in outcome.checks.iter().filter(|c| !c.passed) {
            text.push_str(&format!(
                "\nFAILED on {source}: {}: {}",
                check.name, check.detail
            ));
        }
    }
    text
}
