//! Where an offloaded optimizer's state lives in a file (`--offload-optimizer nvme`, as
//! DeepSpeed's ZeRO-Infinity offloads the optimizer to NVMe): the plan's [`NvmeOffload`]
//! settings, and the [`Layout`] of a program's host pool ([`crate::HOST_POOL`]) in tiles of that
//! file. The runtime's `nvme` module streams the tiles through each step.
//!
//! The offloaded states of one [`Instruction::OptimizerStep`] are cut into tiles of at most
//! `tile_elements` parameter elements (DeepSpeed's `sub_group_size`), in the step's tensor
//! order. For each piece of a tensor it covers, a tile holds each of that tensor's offloaded
//! inputs (the f32 master, the moments) for those elements, one after the other, 64-byte
//! aligned. Tiles follow each other in the file, each padded to 4 KiB so that it is one aligned
//! direct read and one direct write.
//!
//! Only optimizer steps may touch the states, each updated in place (codegen folds fp16/bf16's
//! skip-selects into the step to make it so); [`Layout::of`] refuses other programs. Parameter
//! shards in the host pool (`--offload-param cpu`, placed before the states) stay in memory.

use std::collections::BTreeMap;
use std::ops::Range;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::{Instruction, Program, Region, HOST_POOL};

/// DeepSpeed's default `sub_group_size`: parameter elements per tile.
pub const DEFAULT_TILE_ELEMENTS: usize = 1_000_000_000;
/// DeepSpeed's default `buffer_count` for the optimizer's NVMe offload.
pub const DEFAULT_BUFFER_COUNT: usize = 4;
/// Alignment and granularity of direct I/O: tiles start and end on these boundaries.
pub const BLOCK: usize = 4096;
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
pub struct Piece {
    pub tensor: usize,
    pub elements: Range<usize>,
    /// For each of the tensor's inputs in the host pool: its index among the tensor's inputs
    /// and the byte offset of these elements of it in the tile.
    pub offloaded: Vec<(usize, usize)>,
}

/// One tile of a step's offloaded states.
#[derive(Clone, Debug)]
pub struct Tile {
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
        // The pool's optimizer states; parameters there (`--offload-param cpu`) stay in memory.
        let states: Vec<Region> = program.states.iter().map(|s| s.region).filter(Region::in_host_pool).collect();
        let is_state = |r: &Region| states.iter().any(|s| s.overlaps(r));
        for u in &program.updates {
            if (is_state(&u.from) || is_state(&u.to)) && u.from != u.to {
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
                if inputs.iter().chain(&outputs).any(is_state) {
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
                let offloaded: Vec<usize> = (0..tensor.inputs.len()).filter(|&k| is_state(&tensor.inputs[k])).collect();
                let in_place = |k: usize| {
                    let output = if k == 0 { 0 } else { k - 1 };
                    k != 1 && tensor.outputs.get(output) == Some(&tensor.inputs[k])
                };
                let written = tensor.outputs.iter().chain(tensor.copy.as_ref().map(|(r, _)| r));
                let outside = written.filter(|r| is_state(r)).count() != offloaded.len();
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
    pub fn pieces_of(&self, region: &Region) -> impl Iterator<Item = (usize, Range<usize>)> + '_ {
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

    /// The tiles of every step that offloads, by instruction index.
    pub fn steps(&self) -> impl Iterator<Item = (usize, &[Tile])> {
        self.steps.iter().map(|(&index, tiles)| (index, tiles.as_slice()))
    }

    /// The tiles of the step at instruction `index`, if it offloads.
    pub fn tiles(&self, index: usize) -> Option<&[Tile]> {
        self.steps.get(&index).map(Vec::as_slice)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::OptimizerTensor;
    use autotp_kernels::{DType, Kernel, Optimizer, SgdConfig};

    fn pooled(offset: usize, len: usize) -> Region {
        Region { offset: HOST_POOL + offset, len }
    }

    /// An SGD-with-momentum step over f32 tensors of 5 and 3 elements: parameters and
    /// gradients in the arena, momenta in the host pool.
    /// A copy of `input` to the arena (offset 256), labelled `label`.
    fn copy_to_arena(input: Region, label: &str) -> Instruction {
        let output = Region { offset: 256, len: input.len };
        Instruction::Kernel {
            kernel: Kernel::Copy,
            inputs: vec![input],
            outputs: vec![output],
            label: label.into(),
            gpu: None,
        }
    }

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

    /// A program of `instructions` whose states are [`step`]'s momenta in the host pool.
    fn with_momenta(instructions: Vec<Instruction>) -> Program {
        let mut program = Program::bare(instructions, vec![], 1024);
        let momentum = |name: &str, region: Region| crate::Slot {
            name: name.into(),
            dtype: DType::F32,
            shape: vec![region.len / 4],
            region,
            global_shape: vec![region.len / 4],
            placements: vec![],
        };
        program.states = vec![momentum("m0", pooled(0, 20)), momentum("m1", pooled(64, 12))];
        program
    }

    #[test]
    fn tiles_cut_tensors_at_the_tile_size_and_pad_to_blocks() {
        let layout = Layout::of(&with_momenta(vec![step()]), 4).unwrap();
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
        let copy = copy_to_arena(pooled(0, 20), "node 12 (copy)");
        let error = Layout::of(&with_momenta(vec![step(), copy]), 4).unwrap_err();
        assert_eq!(error, "node 12 (copy): reads or writes optimizer state outside the optimizer step");
        // A parameter shard in the pool (`--offload-param cpu`) may be read: it stays in memory.
        let gather = copy_to_arena(pooled(128, 16), "node 13 (gather)");
        assert!(Layout::of(&with_momenta(vec![step(), gather]), 4).is_ok());
        let Instruction::OptimizerStep { mut tensors, optimizer, dtype, scalars, guard, label } = step() else {
            unreachable!()
        };
        tensors[1].outputs[1] = Region { offset: 256, len: 12 };
        let moved = Instruction::OptimizerStep { tensors, optimizer, dtype, scalars, guard, label };
        let error = Layout::of(&with_momenta(vec![moved]), 4).unwrap_err();
        assert_eq!(error, "node 9 (sgd): a tensor's offloaded state is not updated in place");
    }
}
