//! What a run waits on besides events: signals, timers, the launched
//! command, the profiled processes' exits, the endpoints' requests.
use std::{
    io::Write,
    os::fd::{FromRawFd, OwnedFd},
    process::ExitStatus,
};

use tokio::{
    io::{Interest, unix::AsyncFd},
    signal::unix::{Signal, SignalKind, signal},
    sync::mpsc,
};

use crate::{
    error::Result,
    run::{event_loop::Stop, events_error, targets::checked::LaunchedCommand},
};

/// The signals that end a run or ask for a snapshot.
pub(super) struct Signals {
    pub interrupt: Signal,
    pub terminate: Signal,
    pub snapshot: Signal,
}

impl Signals {
    pub fn new() -> Result<Self> {
        let listen = |kind| signal(kind).map_err(|e| events_error("listening for signals", e));
        Ok(Self {
            interrupt: listen(SignalKind::interrupt())?,
            terminate: listen(SignalKind::terminate())?,
            snapshot: listen(SignalKind::user_defined1())?,
        })
    }
}

/// A launched command is waited for, as a wrapper would: a signal that
/// stopped memprobe is passed on to it.
pub(super) async fn wait_for_command(
    launched: LaunchedCommand,
    stop: &Stop,
    exit_status: Option<std::io::Result<ExitStatus>>,
    status: &mut dyn Write,
) -> std::io::Result<ExitStatus> {
    if let Stop::Signal(signal) = stop {
        // SAFETY: signalling our own child.
        unsafe { libc::kill(launched.pid as i32, *signal) };
    }
    if let Some(exit_status) = exit_status {
        return exit_status;
    }
    let _ = writeln!(
        status,
        "memprobe: detached; waiting for pid {} to exit",
        launched.pid
    );
    match launched.exit {
        Some(exit) => exit
            .await
            .unwrap_or_else(|_| Err(std::io::Error::other("lost"))),
        None => Err(std::io::Error::other("lost")),
    }
}

pub(super) fn exit_code_of(status: ExitStatus) -> i32 {
    use std::os::unix::process::ExitStatusExt;
    status
        .code()
        .unwrap_or_else(|| 128 + status.signal().unwrap_or(0))
}

pub(super) async fn wait_launched(
    launched: Option<&mut LaunchedCommand>,
) -> std::io::Result<ExitStatus> {
    match launched.and_then(|l| l.exit.as_mut()) {
        Some(receiver) => receiver
            .await
            .unwrap_or_else(|_| Err(std::io::Error::other("lost the launched command"))),
        None => std::future::pending().await,
    }
}

pub(super) async fn tick_of(timer: &mut Option<tokio::time::Interval>) {
    match timer {
        Some(timer) => {
            timer.tick().await;
        }
        None => std::future::pending().await,
    }
}

pub(super) async fn sleep_until(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}

/// Sends `pid` on `exits` when the process ends (pidfd: no polling, no pid reuse).
pub(super) fn watch_exit(pid: u32, exits: mpsc::UnboundedSender<u32>) {
    // SAFETY: pidfd_open takes a pid and flags; the result is a new fd or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if fd < 0 {
        return;
    }
    // SAFETY: the fd was just returned to us and is owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
    // SAFETY: the AsyncFd owns the OwnedFd, which stays open until dropped.
    let Ok(fd) = (unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) }) else {
        return;
    };
    tokio::spawn(async move {
        if fd.readable().await.is_ok() {
            let _ = exits.send(pid);
        }
    });
}
