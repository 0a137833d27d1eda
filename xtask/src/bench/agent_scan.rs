//! What the host agent's look at every process costs it on a crowded host:
//! its own CPU beside the host's processes as they are, then beside 150
//! more idle ones of 2,000 mappings each (a JVM or a database has
//! thousands), side by side in one run. Each second `--all` lists the
//! processes and reads again the maps of those whose virtual size or
//! start time changed: idle ones cost it a `stat` read each.
use std::{
    path::Path,
    process::{Child, Command, Stdio},
    thread,
    time::Duration,
};

use anyhow::Result;

use super::{
    agent::{SHIPPED_WINDOWS, cpu_over, start_agent},
    build_fixture, stop,
};

/// The idle processes started for the crowded span.
const CROWD: usize = 150;
/// Untimed once the agent attached: its first look reads every process's
/// maps.
const WARMUP: Duration = Duration::from_secs(5);
const TIMED: Duration = Duration::from_secs(15);

/// The agent's CPU seconds over [`TIMED`], on the host as is and beside
/// the crowd.
pub(super) struct ScanCosts {
    alone: f64,
    crowded: f64,
}

pub(super) fn scan_costs(memprobe: &Path, out: &Path, profiles_dir: &str) -> Result<ScanCosts> {
    eprintln!("bench: the host agent beside {CROWD} idle processes of 2,000 mappings each");
    let many = build_fixture(out, "many_mappings", "many_mappings", &[])?;
    let alone = agent_cpu(memprobe, profiles_dir)?;
    let mut crowd: Vec<Child> = Vec::with_capacity(CROWD);
    let crowded = (|| {
        for _ in 0..CROWD {
            crowd.push(Command::new(&many).stdout(Stdio::null()).spawn()?);
        }
        thread::sleep(Duration::from_secs(1));
        agent_cpu(memprobe, profiles_dir)
    })();
    for mut child in crowd {
        let _ = child.kill();
        let _ = child.wait();
    }
    Ok(ScanCosts {
        alone,
        crowded: crowded?,
    })
}

/// The agent's CPU seconds over a timed span, once it has settled.
fn agent_cpu(memprobe: &Path, profiles_dir: &str) -> Result<f64> {
    let mut agent = start_agent(memprobe, SHIPPED_WINDOWS, profiles_dir)?;
    thread::sleep(WARMUP);
    let (used, _) = cpu_over(&agent, TIMED);
    stop(&mut agent);
    Ok(used)
}

pub(super) fn scan_table(costs: &ScanCosts) -> String {
    let secs = TIMED.as_secs_f64();
    let row =
        |name: &str, cpu: f64| format!("| {name} | {cpu:.2} s | {:.2}% |\n", 100.0 * cpu / secs);
    let mut table = format!(
        "\n| the host agent (`--all`, as deploy/ ships it), its own CPU over {secs:.0} s | CPU | of one CPU |\n|---|---|---|\n"
    );
    table.push_str(&row("beside the host's processes as they are", costs.alone));
    table.push_str(&row(
        &format!("beside {CROWD} more idle processes of 2,000 mappings each"),
        costs.crowded,
    ));
    table
}
