//! A rank's communication thread: the CPU device's collectives stream. It runs the collectives
//! the rank starts, in order, on raw pointers into the rank's arena.

use std::sync::{mpsc, Arc, Condvar, Mutex};
use std::time::Instant;

use autotp_program::CollectiveOp;

use crate::comm::Communicator;
use crate::RuntimeError;

/// An asynchronous collective handed to a rank's communication thread: raw pointers into the
/// rank's arena.
pub(crate) struct Job {
    pub op: CollectiveOp,
    pub seq: u64,
    pub input: (usize, usize),
    pub output: (usize, usize),
    /// The instruction's label, when the rank is tracing: the thread then records when it ran
    /// the job ([`CommThread::take_spans`]).
    pub traced: Option<String>,
}

/// A job the thread ran while tracing: its collective, label, start and end.
pub(crate) type JobSpan = (&'static str, String, Instant, Instant);

// SAFETY: the pointers address the executor's arena, which outlives every job (a run
// synchronises the thread before it returns, and the thread is joined before the arena is
// freed), and the stream schedule orders every other access to these regions before the job
// or after its completion (`StreamSchedule::check`).
unsafe impl Send for Job {}

/// How far a communication thread has got: jobs finished, and the first failure not yet
/// reported to a waiter.
#[derive(Default)]
struct Progress {
    finished: u64,
    error: Option<RuntimeError>,
    failed: bool,
}

/// A rank's communication thread: the collectives stream of the CPU device. It runs the
/// collectives the rank starts, in order.
pub(crate) struct CommThread {
    jobs: mpsc::Sender<Job>,
    progress: Arc<(Mutex<Progress>, Condvar)>,
    spans: Arc<Mutex<Vec<JobSpan>>>,
    /// Jobs handed to the thread so far.
    pub started: u64,
    handle: Option<std::thread::JoinHandle<()>>,
}

impl CommThread {
    pub(crate) fn spawn(rank: usize, comm: Arc<dyn Communicator>) -> CommThread {
        let (jobs, queue) = mpsc::channel::<Job>();
        let progress = Arc::new((Mutex::new(Progress::default()), Condvar::new()));
        let reported = progress.clone();
        let spans: Arc<Mutex<Vec<JobSpan>>> = Arc::default();
        let traced = spans.clone();
        let handle = std::thread::Builder::new()
            .name(format!("autotp-comm-{rank}"))
            .spawn(move || {
                for job in queue {
                    // SAFETY: see `Job`: the regions stay valid and untouched until completion.
                    let input = unsafe { std::slice::from_raw_parts(job.input.0 as *const u8, job.input.1) };
                    let output = unsafe { std::slice::from_raw_parts_mut(job.output.0 as *mut u8, job.output.1) };
                    let started = Instant::now();
                    let result = comm.collective(rank, &job.op, job.seq, input, output);
                    if let Some(label) = job.traced {
                        let span = (job.op.kind.name(), label, started, Instant::now());
                        traced.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).push(span);
                    }
                    if let Err(e) = &result {
                        comm.abort(rank, e);
                    }
                    let (state, changed) = &*reported;
                    let mut state = state.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
                    state.finished += 1;
                    if let Err(e) = result {
                        if !state.failed {
                            state.failed = true;
                            state.error = Some(e);
                        }
                    }
                    changed.notify_all();
                }
            })
            .expect("a communication thread starts");
        CommThread { jobs, progress, spans, started: 0, handle: Some(handle) }
    }

    pub(crate) fn start(&mut self, job: Job) -> Result<(), RuntimeError> {
        self.jobs.send(job).map_err(|_| RuntimeError::Comm("the communication thread stopped".into()))?;
        self.started += 1;
        Ok(())
    }

    /// The spans of the traced jobs finished since the last call.
    pub(crate) fn take_spans(&self) -> Vec<JobSpan> {
        std::mem::take(&mut *self.spans.lock().unwrap_or_else(|poisoned| poisoned.into_inner()))
    }

    /// Blocks until the first `jobs` jobs have finished; fails if one of them failed.
    pub(crate) fn wait_for(&self, jobs: u64) -> Result<(), RuntimeError> {
        let (state, changed) = &*self.progress;
        let mut state = state.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        while state.finished < jobs {
            state = changed.wait(state).unwrap_or_else(|poisoned| poisoned.into_inner());
        }
        match (state.error.take(), state.failed) {
            (Some(e), _) => Err(e),
            (None, true) => Err(RuntimeError::Comm("an earlier collective of this rank failed".into())),
            (None, false) => Ok(()),
        }
    }
}

impl Drop for CommThread {
    fn drop(&mut self) {
        let (closed, _) = mpsc::channel();
        drop(std::mem::replace(&mut self.jobs, closed));
        if let Some(handle) = self.handle.take() {
            let _ = handle.join();
        }
    }
}
