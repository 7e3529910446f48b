//! Optimizer state in files (`--offload-optimizer nvme`, as DeepSpeed's ZeRO-Infinity offloads
//! the optimizer to NVMe): a rank's host pool ([`crate::HOST_POOL`]) lives in a file under
//! the `--nvme-path` directory instead of memory, and each optimizer step streams it through a
//! few page-aligned buffers, one tile at a time.
//!
//! Layout ([`Layout`]). The offloaded states of one [`Instruction::OptimizerStep`] are cut into
//! tiles of at most `tile_elements` parameter elements (DeepSpeed's `sub_group_size`), in the
//! step's tensor order. For each piece of a tensor it covers, a tile holds each of that
//! tensor's offloaded inputs (the f32 master, the moments) for those elements, one after the
//! other, 64-byte aligned. Tiles follow each other in the file, each padded to 4 KiB so that it
//! is one aligned direct read and one direct write.
//!
//! A step ([`StateFile::step`]). A reader thread reads tile i+1 into a free buffer while the
//! calling thread updates tile i (the in-memory step's multi-tensor kernel, on the buffer) and
//! a writer thread writes tile i-1 back: with `buffer_count` buffers (DeepSpeed's
//! `buffer_count`) no more than that many tiles are in memory. The file is opened with
//! `O_DIRECT`, bypassing the page cache, so the process's I/O counters count exactly the tiles'
//! bytes; on a filesystem that refuses it (tmpfs) the I/O is buffered, as
//! [`NvmeStatus::direct`] says.
//!
//! Only optimizer steps may touch the host pool, each offloaded state updated in place (codegen
//! folds fp16/bf16's skip-selects into the step to make it so); [`Layout::of`] refuses other
//! programs. The file is scratch: checkpoints hold the states. It is removed when its executor
//! is dropped, and it is named by process id and rank, so a killed run's file clashes with no
//! later run's.

use std::collections::BTreeMap;
use std::fs::File;
use std::ops::Range;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::mpsc;

use serde::{Deserialize, Serialize};

use crate::{Instruction, Program, Region, RuntimeError, HOST_POOL};

/// DeepSpeed's default `sub_group_size`: parameter elements per tile.
pub const DEFAULT_TILE_ELEMENTS: usize = 1_000_000_000;
/// DeepSpeed's default `buffer_count` for the optimizer's NVMe offload.
pub const DEFAULT_BUFFER_COUNT: usize = 4;
/// Alignment and granularity of direct I/O: tiles start and end on these boundaries.
const BLOCK: usize = 4096;
/// Alignment of each piece's state inside a tile (the kernels' vector loads).
const PIECE_ALIGN: usize = 64;

/// Where and how a plan keeps its optimizer state in files.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NvmeOffload {
    /// The directory of the state files (one per rank).
    pub path: PathBuf,
    /// Parameter elements per tile (`--sub-group-size`).
    pub tile_elements: usize,
    /// Tiles in memory at once (`--buffer-count`).
    pub buffer_count: usize,
}

/// The elements `elements` of tensor `tensor` of a step, in a tile.
#[derive(Clone, Debug)]
pub(crate) struct Piece {
    pub tensor: usize,
    pub elements: Range<usize>,
    /// For each of the tensor's inputs in the host pool: its index among the tensor's inputs
    /// and the byte offset of these elements of it in the tile.
    pub offloaded: Vec<(usize, usize)>,
}

/// One tile of a step's offloaded states.
#[derive(Clone, Debug)]
pub(crate) struct Tile {
    pub file_offset: usize,
    /// Bytes in the file, padded to [`BLOCK`].
    pub len: usize,
    pub pieces: Vec<Piece>,
}

/// Bytes of the host pool at `pool..pool + len` are in the file at `file`.
#[derive(Clone, Copy, Debug)]
struct Segment {
    pool: usize,
    len: usize,
    file: usize,
}

/// How a program's host pool is laid out in tiles in a file.
#[derive(Clone, Debug)]
pub struct Layout {
    /// The tiles of each step that offloads, by instruction index.
    steps: BTreeMap<usize, Vec<Tile>>,
    /// Every offloaded byte range and its place in the file, by pool offset.
    segments: Vec<Segment>,
    /// Bytes of the file: what one run of every step reads, and writes (the states' bytes plus
    /// each tile's padding to 4 KiB).
    pub file_bytes: usize,
    /// Bytes of the largest tile: what one buffer holds.
    pub tile_bytes: usize,
    /// The offloaded states' own bytes (without padding).
    pub state_bytes: usize,
    /// Parameter elements whose states are in the tiles.
    pub elements: usize,
    /// Tiles of all steps together.
    pub tiles: usize,
}

impl Layout {
    /// The tiles of `program`'s offloaded states, at most `tile_elements` parameter elements
    /// each; an error says what else touches the host pool, where only optimizer steps may,
    /// each offloaded state in place.
    pub fn of(program: &Program, tile_elements: usize) -> Result<Layout, String> {
        if tile_elements == 0 {
            return Err("a tile needs at least one element (--sub-group-size)".into());
        }
        for u in &program.updates {
            if (u.from.in_host_pool() || u.to.in_host_pool()) && u.from != u.to {
                return Err(format!(
                    "an update copies {} bytes of offloaded optimizer state after the step",
                    u.from.len
                ));
            }
        }
        let mut steps = BTreeMap::new();
        for (index, instruction) in program.instructions.iter().enumerate() {
            let Instruction::OptimizerStep { dtype, tensors, label, .. } = instruction else {
                let (inputs, outputs) = instruction.regions();
                if inputs.iter().chain(&outputs).any(Region::in_host_pool) {
                    return Err(format!(
                        "{}: reads or writes optimizer state outside the optimizer step",
                        instruction.label()
                    ));
                }
                continue;
            };
            let size = dtype.size();
            let mut tiles: Vec<Tile> = Vec::new();
            let mut payload = 0;
            let mut filled = tile_elements;
            for (t, tensor) in tensors.iter().enumerate() {
                let offloaded: Vec<usize> =
                    (0..tensor.inputs.len()).filter(|&k| tensor.inputs[k].in_host_pool()).collect();
                let in_place = |k: usize| {
                    let output = if k == 0 { 0 } else { k - 1 };
                    k != 1 && tensor.outputs.get(output) == Some(&tensor.inputs[k])
                };
                let written = tensor.outputs.iter().chain(tensor.copy.as_ref().map(|(r, _)| r));
                let outside = written.filter(|r| r.in_host_pool()).count() != offloaded.len();
                if offloaded.iter().any(|&k| !in_place(k)) || outside {
                    return Err(format!("{label}: a tensor's offloaded state is not updated in place"));
                }
                if offloaded.is_empty() {
                    continue;
                }
                let n = tensor.inputs[0].len / size;
                let mut start = 0;
                while start < n {
                    if filled == tile_elements {
                        if let Some(last) = tiles.last_mut() {
                            last.len = payload;
                        }
                        tiles.push(Tile { file_offset: 0, len: 0, pieces: Vec::new() });
                        (filled, payload) = (0, 0);
                    }
                    let end = (start + tile_elements - filled).min(n);
                    let mut piece = Piece { tensor: t, elements: start..end, offloaded: Vec::new() };
                    for &k in &offloaded {
                        let at = payload.next_multiple_of(PIECE_ALIGN);
                        piece.offloaded.push((k, at));
                        payload = at + (end - start) * size;
                    }
                    tiles.last_mut().expect("pushed above").pieces.push(piece);
                    filled += end - start;
                    start = end;
                }
            }
            if let Some(last) = tiles.last_mut() {
                last.len = payload;
                steps.insert(index, tiles);
            }
        }
        let mut layout =
            Layout { steps, segments: Vec::new(), file_bytes: 0, tile_bytes: 0, state_bytes: 0, elements: 0, tiles: 0 };
        for (&index, tiles) in &mut layout.steps {
            let Instruction::OptimizerStep { dtype, tensors, .. } = &program.instructions[index] else {
                unreachable!("tiles are made for optimizer steps")
            };
            for tile in tiles {
                layout.tile_bytes = layout.tile_bytes.max(tile.len);
                tile.len = tile.len.next_multiple_of(BLOCK);
                tile.file_offset = layout.file_bytes;
                layout.file_bytes += tile.len;
                layout.tiles += 1;
                for piece in &tile.pieces {
                    layout.elements += piece.elements.len();
                    for &(k, at) in &piece.offloaded {
                        let region = tensors[piece.tensor].inputs[k];
                        let len = piece.elements.len() * dtype.size();
                        let pool = region.offset - HOST_POOL + piece.elements.start * dtype.size();
                        layout.segments.push(Segment { pool, len, file: tile.file_offset + at });
                        layout.state_bytes += len;
                    }
                }
            }
        }
        layout.tile_bytes = layout.tile_bytes.next_multiple_of(BLOCK);
        layout.segments.sort_by_key(|s| s.pool);
        if layout.segments.windows(2).any(|w| w[0].pool + w[0].len > w[1].pool) {
            return Err("two optimizer tensors update the same offloaded state".into());
        }
        for slot in program.states.iter().filter(|s| s.region.in_host_pool()) {
            let covered: usize = layout.pieces_of(&slot.region).map(|(_, range)| range.len()).sum();
            if covered != slot.region.len {
                return Err(format!("optimizer state '{}' is offloaded but no optimizer step updates it", slot.name));
            }
        }
        Ok(layout)
    }

    /// The parts of host-pool `region` in the file: (file offset, byte range of the region).
    fn pieces_of(&self, region: &Region) -> impl Iterator<Item = (usize, Range<usize>)> + '_ {
        let (start, end) = (region.offset - HOST_POOL, region.end() - HOST_POOL);
        let first = self.segments.partition_point(|s| s.pool + s.len <= start);
        self.segments[first..].iter().take_while(move |s| s.pool < end).map(move |s| {
            let (from, to) = (s.pool.max(start), (s.pool + s.len).min(end));
            (s.file + from - s.pool, from - start..to - start)
        })
    }

    /// Buffers a step streams its tiles through with `buffer_count` asked for: no more than
    /// the most tiles of one step, at least one.
    pub fn buffers(&self, buffer_count: usize) -> usize {
        let most_tiles = self.steps.values().map(Vec::len).max().unwrap_or(0);
        buffer_count.min(most_tiles).max(1)
    }

    /// The tiles of the step at instruction `index`, if it offloads.
    pub(crate) fn tiles(&self, index: usize) -> Option<&[Tile]> {
        self.steps.get(&index).map(Vec::as_slice)
    }
}

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
        match std::fs::metadata(&nvme.path) {
            Ok(m) if m.is_dir() => {}
            Ok(_) => return Err(nvme_path_error(&nvme.path, "is not a directory")),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(nvme_path_error(&nvme.path, "no such directory"))
            }
            Err(source) => return Err(RuntimeError::Io { action: "open", path: nvme.path.clone(), source }),
        }
        let path = nvme.path.join(format!("autotp-{}-rank{rank}.optimizer", std::process::id()));
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
        let cleanup = |error: RuntimeError| {
            let _ = std::fs::remove_file(&path);
            error
        };
        allocate(&file, layout.file_bytes).map_err(|source| {
            cleanup(RuntimeError::Io { action: "allocate the optimizer state's bytes in", path: path.clone(), source })
        })?;
        let buffered = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .map_err(|source| cleanup(RuntimeError::Io { action: "open", path: path.clone(), source }))?;
        let buffer_count = nvme.buffer_count.max(1);
        let state =
            StateFile { path, file, buffered, direct, layout, buffers: Vec::new(), buffer_count, moved: (0, 0) };
        let mut buffer = PageBuf::zeroed(state.layout.tile_bytes);
        for (&index, tiles) in &state.layout.steps {
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
        let Some(tiles) = self.layout.steps.get(&index) else { return Ok(()) };
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
        message: format!("{what}: --nvme-path must name an existing directory for the optimizer state's files"),
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
fn read_fully(file: &File, path: &Path, bytes: &mut [u8], offset: usize) -> Result<(), RuntimeError> {
    let mut done = 0;
    while done < bytes.len() {
        match file.read_at(&mut bytes[done..], (offset + done) as u64) {
            Ok(0) => {
                return Err(RuntimeError::File {
                    path: path.to_path_buf(),
                    message: format!(
                        "short read of optimizer state: {done} of {} bytes at offset {offset} (the file was truncated \
                         or replaced while training)",
                        bytes.len()
                    ),
                })
            }
            Ok(n) => done += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(source) => {
                return Err(RuntimeError::Io { action: "read optimizer state from", path: path.to_path_buf(), source })
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::program::bare_program;
    use crate::OptimizerTensor;
    use autotp_kernels::{DType, Kernel, Optimizer, SgdConfig};

    fn pooled(offset: usize, len: usize) -> Region {
        Region { offset: HOST_POOL + offset, len }
    }

    /// An SGD-with-momentum step over f32 tensors of 5 and 3 elements: parameters and
    /// gradients in the arena, momenta in the host pool.
    fn step() -> Instruction {
        let tensor = |arena: usize, pool: usize, n: usize| {
            let (param, momentum) = (Region { offset: arena, len: 4 * n }, pooled(pool, 4 * n));
            OptimizerTensor {
                inputs: vec![param, Region { offset: arena + 64, len: 4 * n }, momentum],
                outputs: vec![param, momentum],
                copy: None,
            }
        };
        Instruction::OptimizerStep {
            optimizer: Optimizer::Sgd(SgdConfig { momentum: 0.9, nesterov: false, weight_decay: 0.0 }),
            dtype: DType::F32,
            scalars: vec![Region { offset: 512, len: 4 }],
            tensors: vec![tensor(0, 0, 5), tensor(128, 64, 3)],
            guard: None,
            label: "node 9 (sgd)".into(),
        }
    }

    #[test]
    fn tiles_cut_tensors_at_the_tile_size_and_pad_to_blocks() {
        let program = bare_program(vec![step()], vec![], 1024);
        let layout = Layout::of(&program, 4).unwrap();
        let tiles = layout.tiles(0).unwrap();
        type Pieces = Vec<(usize, Range<usize>, Vec<(usize, usize)>)>;
        let pieces: Vec<Pieces> = tiles
            .iter()
            .map(|t| t.pieces.iter().map(|p| (p.tensor, p.elements.clone(), p.offloaded.clone())).collect())
            .collect();
        assert_eq!(pieces, [vec![(0, 0..4, vec![(2, 0)])], vec![(0, 4..5, vec![(2, 0)]), (1, 0..3, vec![(2, 64)])]]);
        assert_eq!(tiles.iter().map(|t| (t.file_offset, t.len)).collect::<Vec<_>>(), [(0, BLOCK), (BLOCK, BLOCK)]);
        assert_eq!(
            (layout.file_bytes, layout.tile_bytes, layout.state_bytes, layout.elements),
            (2 * BLOCK, BLOCK, 32, 8)
        );
        // The second tensor's momentum (pool bytes 64..76) is at the second tile's offset 64.
        let second: Vec<_> = layout.pieces_of(&pooled(64, 12)).collect();
        assert_eq!(second, [(BLOCK + 64, 0..12)]);
        let first: Vec<_> = layout.pieces_of(&pooled(0, 20)).collect();
        assert_eq!(first, [(0, 0..16), (BLOCK, 16..20)]);
    }

    #[test]
    fn only_in_place_optimizer_steps_may_touch_the_file() {
        let copy = Instruction::Kernel {
            kernel: Kernel::Copy,
            inputs: vec![pooled(0, 20)],
            outputs: vec![Region { offset: 256, len: 20 }],
            label: "node 12 (copy)".into(),
        };
        let error = Layout::of(&bare_program(vec![step(), copy], vec![], 1024), 4).unwrap_err();
        assert_eq!(error, "node 12 (copy): reads or writes optimizer state outside the optimizer step");
        let Instruction::OptimizerStep { mut tensors, optimizer, dtype, scalars, guard, label } = step() else {
            unreachable!()
        };
        tensors[1].outputs[1] = Region { offset: 256, len: 12 };
        let moved = Instruction::OptimizerStep { tensors, optimizer, dtype, scalars, guard, label };
        let error = Layout::of(&bare_program(vec![moved], vec![], 1024), 4).unwrap_err();
        assert_eq!(error, "node 9 (sgd): a tensor's offloaded state is not updated in place");
    }
}
