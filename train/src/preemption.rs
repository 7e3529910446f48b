//! Preemption: the signals a scheduler sends before it kills a job (SLURM's `--signal`, a
//! cluster's grace period) ask the run to stop cleanly instead of dying mid-step.
//!
//! [`watch`] installs handlers for `SIGTERM` and `SIGUSR1` that only record which signal came.
//! The training loop asks [`requested`] after every step, and every process of a job agrees on
//! it ([`crate::trainer::Trainer::agree_to_stop`]): a signal that reached one rank stops them
//! all after the same step. The run then writes a checkpoint (with `--save`) and ends with
//! [`PREEMPTED_EXIT_CODE`], which a job script can test to requeue itself; `--resume` continues
//! bit-identically.
//!
//! A second signal of either kind while the first is being honoured (a checkpoint that takes
//! too long for the scheduler's patience) ends the process at once, as the signal's default
//! action does; the save is atomic, so the previous checkpoint stays whole.

use std::sync::atomic::{AtomicI32, Ordering};

/// The exit status of a run stopped by a signal after its checkpoint: `EX_TEMPFAIL` of
/// `sysexits.h`, "a temporary failure: the user is invited to retry".
pub const PREEMPTED_EXIT_CODE: u8 = 75;

/// The signals that ask for a checkpoint and a stop.
pub const SIGNALS: [libc::c_int; 2] = [libc::SIGTERM, libc::SIGUSR1];

/// The first signal received since [`watch`], or 0.
static RECEIVED: AtomicI32 = AtomicI32::new(0);

/// A signal that asked the run to stop.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Signal(pub libc::c_int);

impl Signal {
    /// Its conventional name: `SIGTERM`, `SIGUSR1`.
    pub fn name(self) -> String {
        match self.0 {
            libc::SIGTERM => "SIGTERM".to_string(),
            libc::SIGUSR1 => "SIGUSR1".to_string(),
            libc::SIGINT => "SIGINT".to_string(),
            n => format!("signal {n}"),
        }
    }
}

/// A stop every process of a job agreed on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Stop {
    pub signal: Signal,
    /// In a job of processes, the lowest rank whose process received a signal.
    pub rank: Option<usize>,
}

impl std::fmt::Display for Stop {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.rank {
            Some(rank) => write!(f, "{} reached rank {rank}", self.signal.name()),
            None => write!(f, "{} received", self.signal.name()),
        }
    }
}

extern "C" fn record(signal: libc::c_int) {
    if RECEIVED.compare_exchange(0, signal, Ordering::SeqCst, Ordering::SeqCst).is_err() {
        // A second signal: its default action, now. Both calls are async-signal-safe.
        // SAFETY: restores the default disposition and re-raises the signal in this process.
        unsafe {
            libc::signal(signal, libc::SIG_DFL);
            libc::raise(signal);
        }
    }
}

/// Installs the handlers of [`SIGNALS`] (restarting interrupted system calls, so that a
/// signal never turns a read or a collective into an error).
pub fn watch() -> std::io::Result<()> {
    for signal in SIGNALS {
        // SAFETY: a zeroed sigaction is a valid starting value; the handler only touches an
        // atomic and async-signal-safe calls.
        let installed = unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = record as extern "C" fn(libc::c_int) as libc::sighandler_t;
            action.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut action.sa_mask);
            libc::sigaction(signal, &action, std::ptr::null_mut())
        };
        if installed != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// The signal that asked this process to stop, if one did.
pub fn requested() -> Option<Signal> {
    match RECEIVED.load(Ordering::SeqCst) {
        0 => None,
        signal => Some(Signal(signal)),
    }
}
