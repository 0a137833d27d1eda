//! Twin redis-servers, filled alike: while one has something attached, the
//! other is its baseline, and then they swap roles (a crossover), so that
//! neither the host's drift nor a lasting difference between the two
//! counts as a cost.
use std::{
    process::{Child, Command, Stdio},
    time::Duration,
};

use anyhow::{Context, Result, bail};

use super::Load;

/// A redis-server under load.
#[derive(Clone, Copy)]
pub(super) struct Server {
    pub pid: u32,
    pub port: &'static str,
    pub load: Load,
}

/// Two redis-servers started afresh and filled for `load`, killed when
/// dropped.
pub(super) struct Twins {
    children: Vec<Child>,
    pub servers: [Server; 2],
}

impl Twins {
    pub fn start(load: Load) -> Result<Self> {
        let mut twins = Twins {
            children: Vec::new(),
            servers: [Server {
                pid: 0,
                port: "",
                load,
            }; 2],
        };
        for (server, port) in twins.servers.iter_mut().zip(["6399", "6400"]) {
            let child = start_server(port)?;
            *server = Server {
                pid: child.id(),
                port,
                load,
            };
            twins.children.push(child);
            fill(*server)?;
        }
        Ok(twins)
    }
}

impl Drop for Twins {
    fn drop(&mut self) {
        for child in &mut self.children {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Both halves of a crossover: `measure` with something attached to the
/// first twin of the pair, then with the twins' roles swapped.
pub(super) fn crossover<H: Default>(
    [a, b]: [Server; 2],
    mut measure: impl FnMut([Server; 2], &mut H) -> Result<()>,
) -> Result<[H; 2]> {
    let mut halves = [H::default(), H::default()];
    measure([a, b], &mut halves[0])?;
    measure([b, a], &mut halves[1])?;
    Ok(halves)
}

/// redis-server on CPU 0 (its clients run on the other: neither takes the
/// other's time).
fn start_server(port: &str) -> Result<Child> {
    let child = Command::new("taskset")
        .args(["-c", "0", "redis-server"])
        .args(["--port", port, "--save", "", "--appendonly", "no"])
        .args(["--bind", "127.0.0.1"])
        .stdout(Stdio::null())
        .spawn()
        .context("starting redis-server")?;
    std::thread::sleep(Duration::from_millis(500));
    Ok(child)
}

/// Sets most of the million keys the measured runs use (with pipelining,
/// in seconds): without this the first runs would find fewer keys to
/// replace, and free less, than the later ones.
fn fill(server: Server) -> Result<()> {
    let status = Command::new("taskset")
        .args(["-c", "1", "redis-benchmark", "-h", "127.0.0.1"])
        .args(["-p", server.port])
        .args(["-t", "set", "-n", "3000000", "-r", "1000000"])
        .args(["-d", &server.load.value_bytes.to_string()])
        .args(["-P", "16", "-q"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()?;
    if !status.success() {
        bail!("redis-benchmark could not fill redis-server");
    }
    Ok(())
}
