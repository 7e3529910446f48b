//! Parameter shards in files (`--offload-param nvme`): the shards at the end of a rank's host
//! pool live in a file under the `--nvme-path` directory, and the rank's host pool ([`Pages`],
//! a mapping of its own) holds their pages only while the program's
//! [`autotp_program::param_file::ParamSwap`] schedule has them in memory.
//!
//! Around each instruction that uses shards the executor applies that instruction's swaps
//! ([`ParamFile::before`], [`ParamFile::after`]; an optimizer step's per tensor): writes back
//! what it updated, gives back the pages of the shards it released, issues the reads of the
//! shards the next uses need, and waits for the reads of its own. The reads, writes and
//! releases run on the rank's I/O threads, each shard's in order on one of them, so that the
//! reads overlap the instructions before their uses and each other; a use waits for every
//! request on its shards issued before it. The file is opened with `O_DIRECT` where the filesystem allows it (each shard is
//! on pages of its own, in the file and in the pool), so the process's I/O counters count
//! exactly the schedule's bytes.
//!
//! The file is scratch, as the optimizer's ([`crate::nvme`]): checkpoints hold the
//! parameters, and it is removed when its executor is dropped.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::sync::Arc;

use autotp_program::param_file::{FileParam, InstructionSwaps, NvmeParams, ParamSwap, Swaps};
use autotp_program::{Program, Region, HOST_POOL};

use crate::nvme::Scratch;
use crate::RuntimeError;

/// Zeroed page-aligned memory, a mapping of its own whose pages can be given back to the
/// system: a rank's host pool.
pub(crate) struct Pages {
    ptr: std::ptr::NonNull<u8>,
    len: usize,
}

// SAFETY: `Pages` owns its mapping; shared access follows the borrow rules, and the I/O
// threads touch only pages the schedule gives it (see `ParamFile`).
unsafe impl Send for Pages {}
unsafe impl Sync for Pages {}

impl Pages {
    pub fn zeroed(len: usize) -> Result<Pages, RuntimeError> {
        if len == 0 {
            return Ok(Pages { ptr: std::ptr::NonNull::dangling(), len });
        }
        // SAFETY: a fresh anonymous private mapping; nothing else is touched.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        match std::ptr::NonNull::new(ptr as *mut u8).filter(|_| ptr != libc::MAP_FAILED) {
            Some(ptr) => Ok(Pages { ptr, len }),
            None => Err(RuntimeError::Device(format!(
                "cannot map {len} bytes of host memory for the host pool: {}",
                std::io::Error::last_os_error()
            ))),
        }
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: the mapping holds `len` bytes for as long as `self` lives.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, borrowed mutably.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for Pages {
    fn drop(&mut self) {
        if self.len > 0 {
            // SAFETY: the mapping made in `zeroed`, unmapped once.
            unsafe { libc::munmap(self.ptr.as_ptr() as *mut libc::c_void, self.len) };
        }
    }
}

/// What an I/O thread does, in order; `at` is an address in the host pool.
enum Request {
    Read {
        at: usize,
        len: usize,
        offset: usize,
    },
    Write {
        at: usize,
        len: usize,
        offset: usize,
    },
    /// Gives back the pages (they read as zeros until read again).
    Release {
        at: usize,
        len: usize,
    },
}

/// Where a rank's parameter file stands: what it moved so far.
#[derive(Clone, Copy, Debug)]
pub struct ParamFileStatus<'a> {
    pub swap: &'a ParamSwap,
    /// Whether the shards move by direct I/O (not through the page cache).
    pub direct: bool,
    /// Bytes read from and written to the file by the runs so far.
    pub read: u64,
    pub written: u64,
}

/// A rank's parameter shards in their file, and the threads that move them.
pub(crate) struct ParamFile {
    path: PathBuf,
    /// The same file through the page cache: a single shard's reads and writes between runs.
    buffered: File,
    direct: bool,
    swap: ParamSwap,
    io: Io,
}

/// The I/O threads, and what was asked of each.
struct Io {
    workers: Vec<Worker>,
    /// Where the host pool starts.
    pool: usize,
    /// Each shard's last request: its worker's count of requests when it was issued.
    last: Vec<u64>,
    moved: (u64, u64),
}

/// An I/O thread: it serves the shards `p` with `p % workers == its index`, in order, so that
/// every shard's requests run in the order they were issued while the shards' requests overlap.
struct Worker {
    requests: Option<mpsc::Sender<Request>>,
    done: mpsc::Receiver<Result<(), RuntimeError>>,
    thread: Option<std::thread::JoinHandle<()>>,
    /// Requests issued and done, counted from 1.
    issued: u64,
    completed: u64,
}

/// I/O threads per rank: requests in flight at once (a disk's queue serves several together;
/// DeepSpeed's aio keeps 8 in flight by default).
const IO_THREADS: usize = 4;

impl ParamFile {
    /// Creates rank `rank`'s parameter file under `settings.path` for `program`, holding the
    /// shards' bytes now in `pool` (the rank's host pool), whose pages it then gives back;
    /// `None` where the plan keeps every shard in host memory (all fit `--max-in-cpu`, as
    /// DeepSpeed's `max_in_cpu` keeps them).
    pub fn create(
        program: &Program,
        settings: &NvmeParams,
        rank: usize,
        pool: &mut Pages,
    ) -> Result<Option<ParamFile>, RuntimeError> {
        let Some(swap) = ParamSwap::of(program, settings.buffer_count, settings.buffer_size)
            .map_err(|e| RuntimeError::InvalidProgram(format!("parameters on NVMe: {e}")))?
        else {
            return Ok(None);
        };
        let name = format!("autotp-{}-rank{rank}.params", std::process::id());
        let Scratch { file, buffered, direct, path } = Scratch::create(&settings.path, &name, swap.file_bytes)?;
        let cleanup = |error: RuntimeError| {
            let _ = std::fs::remove_file(&path);
            error
        };
        let tail = &mut pool.as_mut_slice()[swap.resident_bytes..];
        buffered.write_all_at(tail, 0).map_err(|source| {
            cleanup(RuntimeError::Io { action: "write parameters to", path: path.clone(), source })
        })?;
        let pool_start = pool.as_mut_slice().as_mut_ptr() as usize;
        let file = Arc::new(file);
        let mut workers = Vec::new();
        for w in 0..IO_THREADS.min(swap.params.len()) {
            let (requests, inbox) = mpsc::channel::<Request>();
            let (outbox, done) = mpsc::channel();
            let (file, served) = (file.clone(), path.clone());
            let thread = std::thread::Builder::new()
                .name(format!("param-io-{rank}.{w}"))
                .spawn(move || serve(&file, &served, inbox, outbox))
                .map_err(|source| {
                    cleanup(RuntimeError::Io { action: "start an I/O thread of", path: path.clone(), source })
                })?;
            workers.push(Worker { requests: Some(requests), done, thread: Some(thread), issued: 0, completed: 0 });
        }
        let last = vec![0; swap.params.len()];
        let io = Io { workers, pool: pool_start, last, moved: (0, 0) };
        // From here on, an error drops the file: its threads are joined and it is removed.
        let mut made = ParamFile { path, buffered, direct, swap, io };
        for p in 0..made.swap.params.len() {
            made.io.issue(&made.swap.params, p, |at, len, _| Request::Release { at, len });
        }
        made.io.drain()?;
        Ok(Some(made))
    }

    pub fn status(&self) -> ParamFileStatus<'_> {
        ParamFileStatus { swap: &self.swap, direct: self.direct, read: self.io.moved.0, written: self.io.moved.1 }
    }

    /// The swaps around instruction `index`, if it uses shards.
    pub fn swaps(&self, index: usize) -> Option<&InstructionSwaps> {
        self.swap.swaps.get(&index)
    }

    /// Applies the swaps before instruction `index`.
    pub fn before(&mut self, index: usize) -> Result<(), RuntimeError> {
        match self.swap.swaps.get(&index) {
            Some(at) => self.io.apply(&self.swap.params, &at.before),
            None => Ok(()),
        }
    }

    /// Applies the swaps after instruction `index`.
    pub fn after(&mut self, index: usize) -> Result<(), RuntimeError> {
        match self.swap.swaps.get(&index) {
            Some(at) => self.io.apply(&self.swap.params, &at.after),
            None => Ok(()),
        }
    }

    /// Updates the tensors of optimizer step `index` whose shards are in the file, each by
    /// `update` between its swaps.
    pub fn update_tensors(
        &mut self,
        index: usize,
        mut update: impl FnMut(usize) -> Result<(), RuntimeError>,
    ) -> Result<(), RuntimeError> {
        let Some(at) = self.swap.swaps.get(&index) else { return Ok(()) };
        for (t, before, after) in &at.tensors {
            self.io.apply(&self.swap.params, before)?;
            update(*t)?;
            self.io.apply(&self.swap.params, after)?;
        }
        Ok(())
    }

    /// Whether the program's update `k` writes a shard in the file.
    pub fn writes_update(&self, k: usize) -> bool {
        self.swap.updates.iter().any(|&(update, _)| update == k)
    }

    /// Writes `bytes` as the new value of the shard update `k` writes, after a run (drained):
    /// through the shard's pages, which it gives back after.
    pub fn write_update(&mut self, k: usize, bytes: &[u8]) -> Result<(), RuntimeError> {
        let Some(&(_, p)) = self.swap.updates.iter().find(|&&(update, _)| update == k) else {
            return Err(RuntimeError::InvalidProgram(format!("update {k} writes no parameter in the file")));
        };
        let param = &self.swap.params[p];
        self.io.wait_for(p)?;
        // SAFETY: after the run's requests are done no one uses the shard's pages; they hold
        // `file_len` bytes of the pool, of which the shard is the first `bytes.len()`.
        let pages = unsafe {
            std::slice::from_raw_parts_mut((self.io.pool + param.region.offset - HOST_POOL) as *mut u8, bytes.len())
        };
        pages.copy_from_slice(bytes);
        let swaps = Swaps { write_back: vec![p], release: vec![p], ..Swaps::default() };
        self.io.apply(&self.swap.params, &swaps)
    }

    /// Waits for every request issued: the end of a run.
    pub fn drain(&mut self) -> Result<(), RuntimeError> {
        self.io.drain()
    }

    /// The shard of host-pool `region` (a parameter in the file), between runs.
    pub fn read(&self, region: &Region) -> Option<Result<Vec<u8>, RuntimeError>> {
        let param = self.param(region)?;
        let mut bytes = vec![0; region.len];
        Some(
            self.buffered
                .read_exact_at(&mut bytes, param.file_offset as u64)
                .map(|()| bytes)
                .map_err(|source| RuntimeError::Io { action: "read parameters from", path: self.path.clone(), source }),
        )
    }

    /// Writes `bytes` as the shard of host-pool `region`, between runs; None if it is not in
    /// the file.
    pub fn write(&self, region: &Region, bytes: &[u8]) -> Option<Result<(), RuntimeError>> {
        let param = self.param(region)?;
        Some(self.buffered.write_all_at(bytes, param.file_offset as u64).map_err(|source| RuntimeError::Io {
            action: "write parameters to",
            path: self.path.clone(),
            source,
        }))
    }

    fn param(&self, region: &Region) -> Option<&FileParam> {
        self.swap.params.iter().find(|p| p.region == *region)
    }
}

impl Drop for ParamFile {
    fn drop(&mut self) {
        // The threads write into the host pool: stop them before the pool goes.
        for worker in &mut self.io.workers {
            worker.requests = None;
        }
        for worker in &mut self.io.workers {
            if let Some(thread) = worker.thread.take() {
                let _ = thread.join();
            }
        }
        let _ = std::fs::remove_file(&self.path);
    }
}

impl Io {
    /// Sends the request `make(address, bytes, file offset)` for shard `p` to its worker.
    fn issue(&mut self, params: &[FileParam], p: usize, make: impl Fn(usize, usize, usize) -> Request) {
        let param = &params[p];
        let at = self.pool + param.region.offset - HOST_POOL;
        let count = self.workers.len();
        let worker = &mut self.workers[p % count];
        worker.issued += 1;
        self.last[p] = worker.issued;
        // A closed channel: the thread stopped on an error, which `wait_for` reports.
        let requests = worker.requests.as_ref().expect("open while the file lives");
        let _ = requests.send(make(at, param.file_len, param.file_offset));
    }

    fn apply(&mut self, params: &[FileParam], swaps: &Swaps) -> Result<(), RuntimeError> {
        for &p in &swaps.write_back {
            self.issue(params, p, |at, len, offset| Request::Write { at, len, offset });
            self.moved.1 += params[p].file_len as u64;
        }
        for &p in &swaps.release {
            self.issue(params, p, |at, len, _| Request::Release { at, len });
        }
        for &p in &swaps.fetch {
            self.issue(params, p, |at, len, offset| Request::Read { at, len, offset });
            self.moved.0 += params[p].file_len as u64;
        }
        for &p in &swaps.wait {
            self.wait_for(p)?;
        }
        Ok(())
    }

    /// Waits until the requests issued on shard `p` so far are done.
    fn wait_for(&mut self, p: usize) -> Result<(), RuntimeError> {
        let worker = p % self.workers.len();
        self.workers[worker].wait_for(self.last[p])
    }

    fn drain(&mut self) -> Result<(), RuntimeError> {
        self.workers.iter_mut().try_for_each(|w| w.wait_for(w.issued))
    }
}

impl Worker {
    fn wait_for(&mut self, request: u64) -> Result<(), RuntimeError> {
        while self.completed < request {
            match self.done.recv() {
                Ok(Ok(())) => self.completed += 1,
                Ok(Err(e)) => return Err(e),
                Err(_) => return Err(RuntimeError::Device("an I/O thread of the parameter file stopped".into())),
            }
        }
        Ok(())
    }
}

/// An I/O thread: serves `inbox` in order, answering each request on `outbox`; stops at the
/// first error.
fn serve(file: &File, path: &Path, inbox: mpsc::Receiver<Request>, outbox: mpsc::Sender<Result<(), RuntimeError>>) {
    for request in inbox {
        let result = match request {
            // SAFETY: the schedule gives the thread these pages (a shard's, page-aligned and
            // padded) until the rank waits for this request; the pool outlives the thread.
            Request::Read { at, len, offset } => {
                let bytes = unsafe { std::slice::from_raw_parts_mut(at as *mut u8, len) };
                crate::nvme::read_fully(file, path, bytes, offset)
            }
            Request::Write { at, len, offset } => {
                // SAFETY: as above; only read here.
                let bytes = unsafe { std::slice::from_raw_parts(at as *const u8, len) };
                file.write_all_at(bytes, offset as u64).map_err(|source| RuntimeError::Io {
                    action: "write parameters to",
                    path: path.to_path_buf(),
                    source,
                })
            }
            // SAFETY: as above: no one uses these pages until they are read again.
            Request::Release { at, len } => {
                match unsafe { libc::madvise(at as *mut libc::c_void, len, libc::MADV_DONTNEED) } {
                    0 => Ok(()),
                    _ => Err(RuntimeError::Device(format!(
                        "cannot give back a parameter's pages: {}",
                        std::io::Error::last_os_error()
                    ))),
                }
            }
        };
        let failed = result.is_err();
        if outbox.send(result).is_err() || failed {
            return;
        }
    }
}
