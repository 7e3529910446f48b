//! Optimizer state in files (`--offload-optimizer nvme`): a rank's host pool
//! ([`autotp_program::HOST_POOL`]) lives in a file under the `--nvme-path` directory instead of
//! memory, laid out in tiles as [`autotp_program::offload::Layout`] says, and each optimizer step
//! streams it through a few page-aligned buffers, one tile at a time.
//!
//! A step ([`StateFile::step`]). A reader thread reads tile i+1 into a free buffer while the
//! calling thread updates tile i (the in-memory step's multi-tensor kernel, on the buffer) and
//! a writer thread writes tile i-1 back: with `buffer_count` buffers (DeepSpeed's
//! `buffer_count`) no more than that many tiles are in memory. The file is opened with
//! `O_DIRECT`, bypassing the page cache, so the process's I/O counters count exactly the tiles'
//! bytes; on a filesystem that refuses it (tmpfs) the I/O is buffered, as
//! [`NvmeStatus::direct`] says.
//!
//! The file is scratch: checkpoints hold the states. It is removed when its executor is
//! dropped, and it is named by process id and rank, so a killed run's file clashes with no
//! later run's.

use std::fs::File;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::mpsc;

use autotp_program::offload::{Layout, NvmeOffload, Tile, BLOCK};
use autotp_program::{Instruction, Program, Region, HOST_POOL};

use crate::RuntimeError;

/// Memory aligned for direct I/O, zeroed.
struct PageBuf {
    ptr: std::ptr::NonNull<u8>,
    len: usize,
}

// SAFETY: a PageBuf owns its memory; it moves between the step's threads, one at a time.
unsafe impl Send for PageBuf {}

impl PageBuf {
    fn layout(len: usize) -> std::alloc::Layout {
        std::alloc::Layout::from_size_align(len.max(BLOCK), BLOCK).expect("a buffer's size fits the address space")
    }

    fn zeroed(len: usize) -> PageBuf {
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(PageBuf::layout(len)) };
        let ptr = std::ptr::NonNull::new(ptr).unwrap_or_else(|| std::alloc::handle_alloc_error(PageBuf::layout(len)));
        PageBuf { ptr, len }
    }

    fn bytes(&mut self, len: usize) -> &mut [u8] {
        assert!(len <= self.len, "a tile fits its buffer");
        // SAFETY: the allocation holds `self.len` bytes, owned by `self`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), len) }
    }
}

impl Drop for PageBuf {
    fn drop(&mut self) {
        // SAFETY: allocated by `zeroed` with this layout.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), PageBuf::layout(self.len)) };
    }
}

/// Where a rank's optimizer state in a file stands.
#[derive(Clone, Copy, Debug)]
pub struct NvmeStatus<'a> {
    pub layout: &'a Layout,
    /// Whether the tiles move by direct I/O (not through the page cache).
    pub direct: bool,
    /// Buffers of [`Layout::tile_bytes`] a step uses.
    pub buffers: usize,
    /// Bytes the steps have read from the file so far.
    pub read: u64,
    /// Bytes the steps have written to the file so far.
    pub written: u64,
}

/// A rank's offloaded optimizer state in its file, and the buffers its steps stream it through.
pub(crate) struct StateFile {
    path: PathBuf,
    /// Opened with `O_DIRECT` where the filesystem allows it: the tiles' reads and writes.
    file: File,
    /// The same file through the page cache: reads and writes of single states (checkpoints,
    /// initial masters), which need not be block-aligned.
    buffered: File,
    direct: bool,
    layout: Layout,
    /// The free buffers, each [`Layout::tile_bytes`] long.
    buffers: Vec<PageBuf>,
    /// Buffers a step uses (`--buffer-count`; fewer for a step of fewer tiles).
    buffer_count: usize,
    /// Bytes the steps have read from and written to the file so far.
    moved: (u64, u64),
}

impl StateFile {
    /// Creates rank `rank`'s state file under `nvme.path` for `program`, holding the host
    /// pool's bytes `pool`. Every tile is written, so that no read finds a hole the disk is
    /// not asked for.
    pub fn create(program: &Program, nvme: &NvmeOffload, rank: usize, pool: &[u8]) -> Result<StateFile, RuntimeError> {
        let layout = Layout::of(program, nvme.tile_elements)
            .map_err(|e| RuntimeError::InvalidProgram(format!("optimizer state on NVMe: {e}")))?;
        let name = format!("autotp-{}-rank{rank}.optimizer", std::process::id());
        let Scratch { file, buffered, direct, path } = Scratch::create(&nvme.path, &name, layout.file_bytes)?;
        let buffer_count = nvme.buffer_count.max(1);
        let state =
            StateFile { path, file, buffered, direct, layout, buffers: Vec::new(), buffer_count, moved: (0, 0) };
        let mut buffer = PageBuf::zeroed(state.layout.tile_bytes);
        for (index, tiles) in state.layout.steps() {
            let Instruction::OptimizerStep { dtype, tensors, .. } = &program.instructions[index] else {
                unreachable!("tiles are made for optimizer steps")
            };
            for tile in tiles {
                let bytes = buffer.bytes(tile.len);
                bytes.fill(0);
                for piece in &tile.pieces {
                    let range = piece.elements.start * dtype.size()..piece.elements.end * dtype.size();
                    for &(k, at) in &piece.offloaded {
                        let region = &tensors[piece.tensor].inputs[k];
                        let from = &pool[region.offset - HOST_POOL..region.end() - HOST_POOL][range.clone()];
                        bytes[at..at + from.len()].copy_from_slice(from);
                    }
                }
                state.file.write_all_at(bytes, tile.file_offset as u64).map_err(|source| state.write_error(source))?;
            }
        }
        Ok(state)
    }

    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    pub fn status(&self) -> NvmeStatus<'_> {
        NvmeStatus {
            layout: &self.layout,
            direct: self.direct,
            buffers: self.layout.buffers(self.buffer_count),
            read: self.moved.0,
            written: self.moved.1,
        }
    }

    /// The bytes of host-pool `region` (an offloaded state).
    pub fn read(&self, region: &Region) -> Result<Vec<u8>, RuntimeError> {
        let mut bytes = vec![0; region.len];
        for (at, range) in self.layout.pieces_of(region) {
            read_fully(&self.buffered, &self.path, &mut bytes[range], at)?;
        }
        Ok(bytes)
    }

    /// Writes `bytes` as host-pool `region` (an offloaded state).
    pub fn write(&self, region: &Region, bytes: &[u8]) -> Result<(), RuntimeError> {
        for (at, range) in self.layout.pieces_of(region) {
            self.buffered.write_all_at(&bytes[range], at as u64).map_err(|source| self.write_error(source))?;
        }
        Ok(())
    }

    /// Runs the step at instruction `index` over its tiles: each is read into a buffer, given
    /// to `update` with its bytes, and written back, the reads and writes on threads of their
    /// own so that they overlap the updates of other tiles.
    pub fn step(
        &mut self,
        index: usize,
        mut update: impl FnMut(&Tile, &mut [u8]) -> Result<(), RuntimeError>,
    ) -> Result<(), RuntimeError> {
        let Some(tiles) = self.layout.tiles(index) else { return Ok(()) };
        // Made at the first step (and again after an error lost some in flight).
        let wanted = self.buffer_count.min(tiles.len());
        while self.buffers.len() < wanted {
            self.buffers.push(PageBuf::zeroed(self.layout.tile_bytes));
        }
        let (free_tx, free_rx) = mpsc::channel::<PageBuf>();
        for buffer in self.buffers.drain(..) {
            free_tx.send(buffer).expect("the receiver is here");
        }
        let (full_tx, full_rx) = mpsc::channel::<(usize, PageBuf)>();
        let (done_tx, done_rx) = mpsc::channel::<(usize, PageBuf)>();
        let (file, path) = (&self.file, self.path.as_path());
        let (reading, writing, updating) = std::thread::scope(|scope| {
            let reader = scope.spawn(move || {
                for (i, tile) in tiles.iter().enumerate() {
                    // A closed channel: the others stopped on an error, which they report.
                    let Ok(mut buffer) = free_rx.recv() else { break };
                    if let Err(e) = read_fully(file, path, buffer.bytes(tile.len), tile.file_offset) {
                        return (Err(e), free_rx);
                    }
                    if full_tx.send((i, buffer)).is_err() {
                        break;
                    }
                }
                (Ok(()), free_rx)
            });
            let writer = scope.spawn(move || {
                for (i, mut buffer) in done_rx {
                    let tile = &tiles[i];
                    if let Err(source) = file.write_all_at(buffer.bytes(tile.len), tile.file_offset as u64) {
                        return Err(RuntimeError::Io {
                            action: "write optimizer state to",
                            path: path.to_path_buf(),
                            source,
                        });
                    }
                    let _ = free_tx.send(buffer);
                }
                Ok(())
            });
            let mut updating = Ok(0);
            for (i, mut buffer) in full_rx {
                let tile = &tiles[i];
                if let Err(e) = update(tile, buffer.bytes(tile.len)) {
                    updating = Err(e);
                    break;
                }
                if done_tx.send((i, buffer)).is_err() {
                    break;
                }
                updating = updating.map(|n| n + 1);
            }
            drop(done_tx);
            let writing = writer.join().expect("the writer does not panic");
            let (reading, free_rx) = reader.join().expect("the reader does not panic");
            self.buffers.extend(free_rx.try_iter());
            (reading, writing, updating)
        });
        reading?;
        writing?;
        let updated = updating?;
        if updated != tiles.len() {
            return Err(RuntimeError::File {
                path: self.path.clone(),
                message: format!("the optimizer step updated {updated} of its {} tiles", tiles.len()),
            });
        }
        let bytes: usize = tiles.iter().map(|t| t.len).sum();
        self.moved.0 += bytes as u64;
        self.moved.1 += bytes as u64;
        Ok(())
    }

    fn write_error(&self, source: std::io::Error) -> RuntimeError {
        RuntimeError::Io { action: "write optimizer state to", path: self.path.clone(), source }
    }
}

impl Drop for StateFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

fn nvme_path_error(path: &Path, what: &str) -> RuntimeError {
    RuntimeError::File {
        path: path.to_path_buf(),
        message: format!("{what}: --nvme-path must name an existing directory for the offloaded files"),
    }
}

/// A scratch file of offloaded state, open twice.
pub(crate) struct Scratch {
    /// Opened with `O_DIRECT` where the filesystem allows it.
    pub file: File,
    /// Through the page cache: reads and writes that need not be block-aligned.
    pub buffered: File,
    /// Whether `file` is direct.
    pub direct: bool,
    pub path: PathBuf,
}

impl Scratch {
    /// Creates the scratch file `name` in directory `dir` with `len` bytes reserved.
    pub fn create(dir: &Path, name: &str, len: usize) -> Result<Scratch, RuntimeError> {
        match std::fs::metadata(dir) {
            Ok(m) if m.is_dir() => {}
            Ok(_) => return Err(nvme_path_error(dir, "is not a directory")),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(nvme_path_error(dir, "no such directory"))
            }
            Err(source) => return Err(RuntimeError::Io { action: "open", path: dir.to_path_buf(), source }),
        }
        let path = dir.join(name);
        let open = |flags: i32| {
            std::fs::OpenOptions::new().read(true).write(true).create_new(true).custom_flags(flags).open(&path)
        };
        let (file, direct) = match open(libc::O_DIRECT) {
            Ok(file) => (file, true),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                let file =
                    open(0).map_err(|source| RuntimeError::Io { action: "create", path: path.clone(), source })?;
                (file, false)
            }
            Err(source) => return Err(RuntimeError::Io { action: "create", path, source }),
        };
        let buffered = allocate(&file, len)
            .map_err(|source| RuntimeError::Io {
                action: "allocate the offloaded bytes in",
                path: path.clone(),
                source,
            })
            .and_then(|()| {
                let reopened = std::fs::OpenOptions::new().read(true).write(true).open(&path);
                reopened.map_err(|source| RuntimeError::Io { action: "open", path: path.clone(), source })
            });
        match buffered {
            Ok(buffered) => Ok(Scratch { file, buffered, direct, path }),
            Err(e) => {
                let _ = std::fs::remove_file(&path);
                Err(e)
            }
        }
    }
}

/// Reserves `len` bytes of disk for `file` (zeros), so that a full disk is found now rather
/// than in the middle of a step.
fn allocate(file: &File, len: usize) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    if len == 0 {
        return Ok(());
    }
    // SAFETY: a valid descriptor; the call only changes the file's allocation.
    match unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, len as libc::off_t) } {
        0 => Ok(()),
        libc::EOPNOTSUPP | libc::EINVAL => file.set_len(len as u64),
        errno => Err(std::io::Error::from_raw_os_error(errno)),
    }
}

/// Fills `bytes` from `file` at `offset`; a file that ends first is a short read.
pub(crate) fn read_fully(file: &File, path: &Path, bytes: &mut [u8], offset: usize) -> Result<(), RuntimeError> {
    let mut done = 0;
    while done < bytes.len() {
        match file.read_at(&mut bytes[done..], (offset + done) as u64) {
            Ok(0) => {
                return Err(RuntimeError::File {
                    path: path.to_path_buf(),
                    message: format!(
                        "short read of offloaded state: {done} of {} bytes at offset {offset} (the file was truncated \
                         or replaced while training)",
                        bytes.len()
                    ),
                })
            }
            Ok(n) => done += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(source) => {
                return Err(RuntimeError::Io { action: "read offloaded state from", path: path.to_path_buf(), source })
            }
        }
    }
    Ok(())
}
