//! When memprobe's windows were open on a process, and where in one a
//! request fell (as its links were made, in its middle, as they closed).
//! The windows are as the kernel saw memprobe's `bpf(2)` and `close(2)`
//! calls (a bpftrace script on syscall tracepoints): a window opens with
//! the `uprobe_multi` links memprobe creates for that process, and closes
//! as it closes them. The links it holds from the attach on were made
//! before the trace began and are not followed. Times are the kernel's
//! monotonic clock, the client's too. (Tracing syscalls sends every
//! process's system calls through the kernel's slow path, some 80 ns
//! each: both twins alike.)
use std::{
    io::{BufRead, BufReader},
    process::{Child, Command, Stdio},
    thread::JoinHandle,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};

/// A window's first link created and last link closed, in nanoseconds.
pub(super) type Window = (u64, u64);

/// `BPF_LINK_CREATE` (28) of a `BPF_TRACE_UPROBE_MULTI` (48) or
/// `BPF_TRACE_UPROBE_SESSION` (57) link, read at their places in
/// `union bpf_attr` (`link_create.attach_type`, `.uprobe_multi.pid`), for
/// the process profiled alone: memprobe also attaches to its calibration
/// copies as it runs.
const SCRIPT: &str = r#"
tracepoint:syscalls:sys_enter_bpf
/pid == $1 && args->cmd == 28/
{
  $attr = (uint64)args->uattr;
  $type = *(uint32 *)uptr($attr + 8);
  if (($type == 48 || $type == 57) && *(uint32 *)uptr($attr + 56) == $2) {
    @creating[tid] = 1;
    printf("open %llu\n", nsecs);
  }
}
tracepoint:syscalls:sys_exit_bpf
/@creating[tid]/
{
  delete(@creating[tid]);
  if (args->ret >= 0) {
    @links[args->ret] = 1;
  }
}
tracepoint:syscalls:sys_enter_close
/pid == $1 && @links[args->fd]/
{
  delete(@links[args->fd]);
  printf("close %llu\n", nsecs);
}
"#;

/// A running trace of one memprobe's windows on one process.
pub(super) struct WindowTrace {
    child: Child,
    /// Reads bpftrace's lines until it exits, then gives them back.
    reader: Option<JoinHandle<Vec<String>>>,
    began: u64,
}

impl WindowTrace {
    /// Traces `memprobe`'s windows on `pid`, once the probes are in.
    pub fn start(memprobe: u32, pid: u32) -> Result<Self> {
        let mut child = Command::new("bpftrace")
            .args(["-e", SCRIPT, &memprobe.to_string(), &pid.to_string()])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .context("starting bpftrace")?;
        let stdout = child.stdout.take().context("bpftrace's output")?;
        let (ready, attached) = std::sync::mpsc::channel();
        let reader = std::thread::spawn(move || {
            let mut lines = Vec::new();
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if line.starts_with("Attaching") {
                    let _ = ready.send(());
                } else {
                    lines.push(line);
                }
            }
            lines
        });
        let mut trace = Self {
            child,
            reader: Some(reader),
            began: 0,
        };
        if attached.recv_timeout(Duration::from_secs(60)).is_err() {
            bail!("bpftrace did not attach its window trace");
        }
        // "Attaching" is printed before the probes are in.
        std::thread::sleep(Duration::from_millis(500));
        trace.began = monotonic_ns();
        Ok(trace)
    }

    /// Stops the trace: the windows it saw, in order. One open when the
    /// trace began counts from then, one still open at the end to its end.
    pub fn finish(mut self) -> Result<Vec<Window>> {
        let ended = monotonic_ns();
        // SAFETY: signalling our own child.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGINT) };
        let waited = Instant::now();
        while self.child.try_wait()?.is_none() {
            if waited.elapsed() > Duration::from_secs(10) {
                let _ = self.child.kill();
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        // Every line read, to the end of its output: the last windows'
        // closes may still be in the pipe as bpftrace exits.
        let lines = self
            .reader
            .take()
            .map(|r| r.join().unwrap_or_default())
            .unwrap_or_default();
        Ok(windows(&lines, self.began, ended))
    }
}

/// The windows `lines` ("open NS", "close NS") say: from the first link
/// created after none was open to the last closed, links closed within
/// [`ONE_CLOSING`] of each other counting as one window's.
/// bpftrace prints each CPU's events in turn, so they are put in order of
/// time first.
fn windows(lines: &[String], began: u64, ended: u64) -> Vec<Window> {
    let mut events: Vec<(u64, bool)> = lines
        .iter()
        .filter_map(|line| {
            let (what, at) = line.split_once(' ')?;
            let at = at.trim().parse::<u64>().ok()?;
            match what {
                "open" => Some((at, true)),
                "close" => Some((at, false)),
                _ => None,
            }
        })
        .collect();
    events.sort_unstable();
    let mut windows: Vec<Window> = Vec::new();
    let mut opened: Option<u64> = None;
    for (at, opens) in events {
        if opens {
            opened.get_or_insert(at);
            continue;
        }
        match (opened.take(), windows.last_mut()) {
            (Some(from), _) => windows.push((from, at)),
            (None, Some(last)) if at.saturating_sub(last.1) < ONE_CLOSING => last.1 = at,
            // The window open as the trace began.
            (None, None) => windows.push((began, at)),
            // A link made before the trace, closed long after any window:
            // not a window's.
            (None, Some(_)) => {}
        }
    }
    if let Some(from) = opened {
        windows.push((from, ended));
    }
    windows
}

/// Links of one window close one after another, within milliseconds.
const ONE_CLOSING: u64 = 20_000_000;

/// The kernel's monotonic clock (`CLOCK_MONOTONIC`), in nanoseconds: what
/// bpftrace's `nsecs` reads.
pub(super) fn monotonic_ns() -> u64 {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes the timespec it is given.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut now) };
    now.tv_sec as u64 * 1_000_000_000 + now.tv_nsec as u64
}

/// The edges of a window: creating its links takes milliseconds (each
/// probe's breakpoint written into the process's pages under its
/// mmap_lock), and closing them as long again.
pub(super) const EDGE_NS: u64 = 20_000_000;

/// Where in a window a request was due.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Part {
    /// In no window, nor within [`EDGE_NS`] of one's close.
    Outside,
    /// In a window's first [`EDGE_NS`], as its links are made.
    Opening,
    Middle,
    /// From half [`EDGE_NS`] before a window's close to [`EDGE_NS`] after,
    /// as its links are closed.
    Closing,
}

pub(super) fn part_of_window(windows: &[Window], ns: u64) -> Part {
    let Some(&(open, close)) = windows
        .iter()
        .find(|&&(open, close)| (open..=close + EDGE_NS).contains(&ns))
    else {
        return Part::Outside;
    };
    if ns + EDGE_NS / 2 >= close {
        Part::Closing
    } else if ns < open + EDGE_NS {
        Part::Opening
    } else {
        Part::Middle
    }
}

impl Drop for WindowTrace {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_window_runs_from_its_first_link_to_its_last() {
        // As bpftrace prints them: one CPU's events, then another's.
        let lines: Vec<String> = [
            "close 6000000",
            "open 103000000",
            "close 201000000",
            "open 900000000",
            "close 5000000",
            "open 100000000",
            "close 200000000",
            "close 500000000",
        ]
        .map(String::from)
        .to_vec();
        assert_eq!(
            windows(&lines, 1000, 1_000_000_000),
            vec![
                (1000, 6_000_000),
                (100_000_000, 201_000_000),
                (900_000_000, 1_000_000_000)
            ]
        );
    }

    #[test]
    fn a_request_is_placed_in_its_window() {
        const MS: u64 = 1_000_000;
        let windows = [(1000 * MS, 1100 * MS), (5000 * MS, 5100 * MS)];
        let part = |ms: u64| part_of_window(&windows, ms * MS);
        assert_eq!(part(999), Part::Outside);
        assert_eq!(part(1000), Part::Opening);
        assert_eq!(part(1019), Part::Opening);
        assert_eq!(part(1050), Part::Middle);
        assert_eq!(part(1090), Part::Closing);
        assert_eq!(part(1120), Part::Closing);
        assert_eq!(part(1121), Part::Outside);
        assert_eq!(part(5060), Part::Middle);
    }
}
