//! The NCCL watchdog: NCCL waits for ever on a rank that stopped or hangs, and the host thread
//! waiting on the device with it. While the device is waited on ([`Watchdog::waiting`]), a
//! thread checks how long the wait has lasted; past `--comm-timeout` it aborts the
//! communicators (`ncclCommAbort`, [`super::NcclAborter`]), which ends the wait with an error,
//! and the wait's error becomes one line naming the timeout. A rank that fails aborts them
//! itself ([`super::GpuDevice`]'s `abort`), so the others stop at once.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::NcclAborter;
use crate::RuntimeError;

const POLL: Duration = Duration::from_millis(100);

/// See the module doc.
pub(crate) struct Watchdog {
    waiting_since: Arc<Mutex<Option<Instant>>>,
    fired: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
    timeout: Duration,
    thread: Option<JoinHandle<()>>,
}

impl Watchdog {
    pub(crate) fn start(abort: Arc<NcclAborter>, timeout: Duration) -> Watchdog {
        let waiting_since: Arc<Mutex<Option<Instant>>> = Arc::default();
        let (fired, stop): (Arc<AtomicBool>, Arc<AtomicBool>) = Default::default();
        let thread = {
            let (waiting_since, fired, stop) = (waiting_since.clone(), fired.clone(), stop.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::SeqCst) {
                    let since = *waiting_since.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
                    if since.is_some_and(|since| since.elapsed() > timeout) && !fired.swap(true, Ordering::SeqCst) {
                        abort();
                    }
                    std::thread::sleep(POLL);
                }
            })
        };
        Watchdog { waiting_since, fired, stop, timeout, thread: Some(thread) }
    }

    /// Runs `wait` (a wait on the device) under the watchdog's eye; once it has fired, every
    /// wait fails with the timeout named.
    pub(crate) fn waiting<T>(&self, wait: impl FnOnce() -> Result<T, RuntimeError>) -> Result<T, RuntimeError> {
        *self.waiting_since.lock().unwrap_or_else(|poisoned| poisoned.into_inner()) = Some(Instant::now());
        let result = wait();
        *self.waiting_since.lock().unwrap_or_else(|poisoned| poisoned.into_inner()) = None;
        match self.fired.load(Ordering::SeqCst) {
            true => Err(RuntimeError::Comm(format!(
                "a wait on the GPU lasted past --comm-timeout {} s with NCCL collectives in flight: a rank \
                 stopped, hangs or is far slower, so the NCCL communicators were aborted; if steps are only \
                 slow, raise --comm-timeout",
                self.timeout.as_secs_f64()
            ))),
            false => result,
        }
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A wait that nothing ends but an abort ends at the timeout, with the timeout named; a
    /// quick one before it returns its own result.
    #[test]
    fn a_wait_past_the_timeout_aborts_the_communicators() {
        let aborted = Arc::new(AtomicBool::new(false));
        let seen = aborted.clone();
        let watchdog =
            Watchdog::start(Arc::new(Box::new(move || seen.store(true, Ordering::SeqCst))), Duration::from_millis(300));
        assert_eq!(watchdog.waiting(|| Ok(7)).unwrap(), 7);
        let started = Instant::now();
        let error = watchdog
            .waiting(|| {
                while !aborted.load(Ordering::SeqCst) {
                    std::thread::sleep(Duration::from_millis(10));
                }
                Err::<(), _>(RuntimeError::Comm("aborted".into()))
            })
            .unwrap_err()
            .to_string();
        assert!(error.contains("--comm-timeout 0.3 s"), "{error}");
        assert!(started.elapsed() < Duration::from_secs(2), "{:?}", started.elapsed());
    }
}
