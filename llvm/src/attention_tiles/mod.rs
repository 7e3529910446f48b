//! Fused attention on tensor cores, for NVPTX (sm_80 and later): FlashAttention-2's algorithm
//! on `mma.sync.m16n8k16` with 16-bit operands and f32 accumulators, for the
//! [`AttentionFunction`]s whose `tensor_cores` [`AttentionFunction::of`] sets: the forward, the
//! backward's `dq`, and its `dk` and `dv` (in one pass, or a pass each for heads over
//! [`TENSOR_CORE_JOINT_KEY_VALUE_GRAD`]).
//!
//! A block of 8 warps takes a tile of [`TENSOR_CORE_ROW_TILE`] rows of one batch index (a unit;
//! block `b` takes units `b, b + gridDim.x, ...`): queries for the forward and `dq`, keys for
//! `dk` and `dv`. Warp `w` takes rows `16w..16w+16`, whose operands (q and dout; k and v) stay in
//! registers as `mma` A fragments for the whole tile. Over the columns the rows see (keys; or
//! queries, of every query head sharing the key's head), [`TENSOR_CORE_COLUMN_TILE`] at a time:
//!
//! 1. the block copies the columns' two operands (k and v; or q and dout) into shared memory
//!    (16 bytes per thread at a time; rows past the sequence are zeros), rows padded by 8
//!    elements so that the fragments' reads meet no bank conflicts; where two tiles fit in
//!    shared memory, the next tile's copy is issued (`cp.async`) before this one's work;
//! 2. each warp's products with them (`q k^T`, `dout v^T`; `k q^T`, `v dout^T`: 16 x 64, f32)
//!    are `mma`s whose B fragments `ldmatrix` loads from shared memory; scores are scaled,
//!    biased and masked (-inf) as the row kernels do;
//! 3. the forward's online softmax: each row's maximum over the quad of threads that hold it
//!    (two warp shuffles), the running sums and the output rescaled by `exp(old max - new
//!    max)`; the backward recomputes `p = exp(s - lse)` and `ds = p (dp - dout . out)`;
//! 4. `p` (or `ds`), rounded to the dtype, is an A fragment as it is (an `mma`'s C fragment of
//!    two adjacent 8-column tiles is the A fragment of 16 columns), multiplied by the shared
//!    tile's other operand (`p v`, `ds k`; `p^T dout`, `ds^T q`), whose B fragments
//!    `ldmatrix.trans` loads transposed.
//!
//! The forward gathers each row's sum over its quad at the end, divides the output by it and
//! stores it rounded, with the log-sum-exp for the backward; `dq` stores `dout . out` of its
//! rows for the `dk` pass. Thread `lane` of a warp holds rows `lane / 4` and `lane / 4 + 8` of its
//! 16, and of every 8 columns (or head dims) the two from `2 (lane % 4)`: the `mma` fragment
//! layout of PTX's ISA. Sums over columns are f32; the exponentials are the hardware's
//! `ex2.approx` (2 ulps, where the row kernels and x86 use [`crate::math`]'s polynomial of 1
//! ulp: FlashAttention's choice, as the probabilities are rounded to 16 bits for the next
//! product anyway), and the products inside an `mma` are summed in the hardware's order. The emulated
//! GPU runs the rows of a tile one at a time (`crate::attention`), rounding the same operands;
//! the tests run these passes as they are, built for the host with the warp operations simulated
//! (`define_simulated`, [`crate::warp_simulator`]).
//!
//! Every buffer starts 16-byte aligned (the memory plan aligns every region to 64 bytes and a
//! GPU allocation to 256), and a row of `d` 16-bit elements with `d` a multiple of 16 is 32
//! bytes long, so the vector accesses are aligned.

#[cfg(doc)]
use autotp_kernels::attention::TENSOR_CORE_JOINT_KEY_VALUE_GRAD;
use autotp_kernels::attention::{AttentionFunction, AttentionPass, TENSOR_CORE_COLUMN_TILE, TENSOR_CORE_ROW_TILE};
use inkwell::module::Linkage;
use inkwell::types::{BasicType, VectorType};
use inkwell::values::{FunctionValue, IntValue, PointerValue};
use inkwell::{AddressSpace, IntPredicate};

mod passes;
mod warp;

use crate::attention::Buffers;
use crate::emit::{counted_loop, Emitter, V};
use crate::lanes::Lanes;
use crate::nvptx::{if_then, special_register, BLOCK};
use crate::LlvmError;

const WARPS: usize = BLOCK as usize / 32;
const _: () = assert!(WARPS * 16 == TENSOR_CORE_ROW_TILE, "a warp takes 16 rows of a tile");

/// Groups of 8 columns (an `mma`'s N) per column tile.
const COLUMN_GROUPS: usize = TENSOR_CORE_COLUMN_TILE / 8;

/// Elements of padding after each row of an operand in shared memory (16 bytes).
const ROW_PADDING: usize = 8;

/// The most static shared memory a block may have.
const MAX_SHARED_BYTES: usize = 48 * 1024;

/// The column tiles a pass holds in shared memory at once: two where they fit (the next one's
/// copy, `cp.async`, overlaps the work on this one), else one.
fn stages(f: &AttentionFunction) -> usize {
    let tile = 2 * TENSOR_CORE_COLUMN_TILE * (f.dims.head_dim + ROW_PADDING) * 2;
    if 2 * tile <= MAX_SHARED_BYTES {
        2
    } else {
        1
    }
}

/// The bytes of shared memory a pass's block takes: its stages of both operands' tiles.
pub(crate) fn shared_bytes(f: &AttentionFunction) -> usize {
    stages(f) * 2 * TENSOR_CORE_COLUMN_TILE * (f.dims.head_dim + ROW_PADDING) * 2
}

/// Whether `f` is a tensor-core pass these shapes allow.
fn check(f: &AttentionFunction) -> Result<(), LlvmError> {
    if !(f.tensor_cores && AttentionFunction::fits_tensor_cores(f.dtype, &f.dims)) {
        return Err(LlvmError::llvm("attention", format!("no tensor-core attention for {} or these shapes", f.dtype)));
    }
    Ok(())
}

/// Appends the GPU entry `symbol` computing `f` (a tensor-core pass): `void f(b0, b1, ...,
/// i64 units)` with the buffers of [`crate::attention::buffer_count`], launched with
/// [`BLOCK`] threads per block.
pub(crate) fn define_nvptx<'ctx>(
    e: &Emitter<'_, 'ctx>,
    symbol: &str,
    f: &AttentionFunction,
) -> Result<FunctionValue<'ctx>, LlvmError> {
    check(f)?;
    let (function, pointers, units) = crate::attention::declare_gpu_entry(e, symbol, f);
    let ops = Buffers::take(f, pointers);
    let ty = e.ctx.i16_type().array_type((shared_bytes(f) / 2) as u32);
    let global = e.module.add_global(ty, Some(AddressSpace::from(3u16)), &format!("{symbol}_column_tile"));
    global.set_linkage(Linkage::Internal);
    global.set_initializer(&ty.get_undef());
    global.set_alignment(16);
    let place = Place { thread: special_register(e, "tid.x")?, shared: global.as_pointer_value(), lanes: Lanes::Nvptx };
    let tiles = Tiles::new(e, function, f, ops, place)?;
    let first = special_register(e, "ctaid.x")?;
    let blocks = special_register(e, "nctaid.x")?;
    counted_loop(e, function, first, units, blocks, &[], |unit, _| {
        tiles.unit(unit)?;
        Ok(vec![])
    })?;
    e.b.build_return(None)?;
    Ok(function)
}

/// Appends `f` (a tensor-core pass) as the host function `symbol` that one thread of a
/// simulated GPU block runs ([`crate::attention::declare_simulated_entry`]).
pub(crate) fn define_simulated<'ctx>(
    e: &Emitter<'_, 'ctx>,
    symbol: &str,
    f: &AttentionFunction,
) -> Result<FunctionValue<'ctx>, LlvmError> {
    check(f)?;
    let (entry, pointers, simulated) = crate::attention::declare_simulated_entry(e, symbol, f)?;
    let ops = Buffers::take(f, pointers);
    let (shared, lanes, blocks) = (simulated.shared, simulated.lanes, simulated.blocks);
    let place = Place { thread: entry.end, shared, lanes };
    let tiles = Tiles::new(e, entry.function, f, ops, place)?;
    let units = e.ctx.i64_type().const_int(f.units() as u64, false);
    counted_loop(e, entry.function, entry.begin, units, blocks, &[], |unit, _| {
        tiles.unit(unit)?;
        Ok(vec![])
    })?;
    e.b.build_return(None)?;
    Ok(entry.function)
}

/// A thread's place: its index in the block, the block's shared memory, and the lanes' kind.
struct Place<'ctx> {
    thread: IntValue<'ctx>,
    shared: PointerValue<'ctx>,
    lanes: Lanes<'ctx>,
}

/// A warp's 16 rows of a unit: the thread's two (`lane / 4` and `+ 8`), as positions in the
/// head and clamped into it for loads, and the head's first row in its operands.
struct Rows<'ctx> {
    head: IntValue<'ctx>,
    /// The head's first row: `head * len`.
    head_start: IntValue<'ctx>,
    positions: [IntValue<'ctx>; 2],
    clamped: [IntValue<'ctx>; 2],
    /// The tile's first and last row (clamped).
    tile: (IntValue<'ctx>, IntValue<'ctx>),
    /// The columns each row sees: `[lo, hi)`.
    ranges: [(IntValue<'ctx>, IntValue<'ctx>); 2],
}

/// A tile of columns in shared memory: its first column, and the query head the columns (or,
/// for the forward and `dq`, the rows) belong to.
struct Columns<'ctx> {
    start: IntValue<'ctx>,
    query_head: IntValue<'ctx>,
}

/// The emitter of one tensor-core pass, with the thread's place in its block.
struct Tiles<'a, 'b, 'ctx> {
    e: &'a Emitter<'b, 'ctx>,
    function: FunctionValue<'ctx>,
    f: &'a AttentionFunction,
    ops: Buffers<'ctx>,
    /// Shared memory: the column tile's two operands, one after the other (i16 elements, rows
    /// of `stride`).
    shared: PointerValue<'ctx>,
    stride: usize,
    lanes: Lanes<'ctx>,
    thread: IntValue<'ctx>,
    warp: IntValue<'ctx>,
    lane: IntValue<'ctx>,
    /// `lane / 4`: the first of the thread's two rows of a fragment.
    group: IntValue<'ctx>,
    /// `lane % 4`: its pair of columns in every 8.
    pair: IntValue<'ctx>,
}

impl<'a, 'b, 'ctx> Tiles<'a, 'b, 'ctx> {
    fn new(
        e: &'a Emitter<'b, 'ctx>,
        function: FunctionValue<'ctx>,
        f: &'a AttentionFunction,
        ops: Buffers<'ctx>,
        place: Place<'ctx>,
    ) -> Result<Tiles<'a, 'b, 'ctx>, LlvmError> {
        let i64t = e.ctx.i64_type();
        let Place { thread, shared, lanes } = place;
        let lane = e.b.build_and(thread, i64t.const_int(31, false), "")?;
        Ok(Tiles {
            e,
            function,
            f,
            ops,
            shared,
            stride: f.dims.head_dim + ROW_PADDING,
            lanes,
            thread,
            warp: e.b.build_right_shift(thread, i64t.const_int(5, false), false, "")?,
            lane,
            group: e.b.build_right_shift(lane, i64t.const_int(2, false), false, "")?,
            pair: e.b.build_and(lane, i64t.const_int(3, false), "")?,
        })
    }
}

impl<'ctx> Tiles<'_, '_, 'ctx> {
    fn int(&self, x: usize) -> IntValue<'ctx> {
        self.e.ctx.i64_type().const_int(x as u64, false)
    }

    fn add(&self, a: IntValue<'ctx>, b: IntValue<'ctx>) -> Result<IntValue<'ctx>, LlvmError> {
        Ok(self.e.b.build_int_add(a, b, "")?)
    }

    fn add_const(&self, a: IntValue<'ctx>, b: usize) -> Result<IntValue<'ctx>, LlvmError> {
        self.add(a, self.int(b))
    }

    fn mul(&self, a: IntValue<'ctx>, b: usize) -> Result<IntValue<'ctx>, LlvmError> {
        Ok(self.e.b.build_int_mul(a, self.int(b), "")?)
    }

    fn min(&self, a: IntValue<'ctx>, b: IntValue<'ctx>) -> Result<IntValue<'ctx>, LlvmError> {
        crate::attention::int_min(self.e, a, b)
    }

    /// A pointer to element `at` of `T`s at `base` (`T` the element type of `ty`).
    fn element(
        &self,
        ty: impl BasicType<'ctx>,
        base: PointerValue<'ctx>,
        at: IntValue<'ctx>,
    ) -> Result<PointerValue<'ctx>, LlvmError> {
        // SAFETY (of the generated code): every offset is clamped into its buffer.
        Ok(unsafe { self.e.b.build_in_bounds_gep(ty, base, &[at], "")? })
    }

    /// The two 16-bit elements at element `at` (even) of `base` as one i32.
    fn load_pair(&self, base: PointerValue<'ctx>, at: IntValue<'ctx>) -> Result<IntValue<'ctx>, LlvmError> {
        let (i16t, i32t) = (self.e.ctx.i16_type(), self.e.ctx.i32_type());
        let load = self.e.b.build_load(i32t, self.element(i16t, base, at)?, "")?;
        if let Some(instruction) = inkwell::values::BasicValue::as_instruction_value(&load) {
            let _ = instruction.set_alignment(4);
        }
        Ok(load.into_int_value())
    }

    /// Lanes `lanes` of `a` (and `b`, numbered after `a`'s).
    fn shuffle(&self, a: V<'ctx>, b: V<'ctx>, lanes: &[u32]) -> Result<V<'ctx>, LlvmError> {
        let i32t = self.e.ctx.i32_type();
        let mask =
            VectorType::const_vector(&lanes.iter().map(|&l| i32t.const_int(l as u64, false)).collect::<Vec<_>>());
        Ok(self.e.b.build_shuffle_vector(a, b, mask, "")?)
    }

    /// The columns row `i` sees: keys, or (over keys) queries.
    fn columns_of(&self, i: IntValue<'ctx>) -> Result<(IntValue<'ctx>, IntValue<'ctx>), LlvmError> {
        let (mask, dims) = (self.f.mask, &self.f.dims);
        let first = self.ops.first_query(self.e)?;
        match self.f.pass.over_keys() {
            true => crate::attention::mask_queries(self.e, mask, dims.q_len, i, first),
            false => crate::attention::mask_keys(self.e, mask, dims.kv_len, i, first),
        }
    }

    /// The columns' sequence length: queries' over keys, else keys'.
    fn column_len(&self) -> usize {
        match self.f.pass.over_keys() {
            true => self.f.dims.q_len,
            false => self.f.dims.kv_len,
        }
    }

    /// Entry `at` of the table.
    fn table(&self, at: IntValue<'ctx>) -> Result<IntValue<'ctx>, LlvmError> {
        let i64t = self.e.ctx.i64_type();
        Ok(self.e.b.build_load(i64t, self.element(i64t, self.ops.table, at)?, "")?.into_int_value())
    }

    /// One unit: a tile of rows.
    fn unit(&self, unit: IntValue<'ctx>) -> Result<(), LlvmError> {
        let e = self.e;
        let (_, len) = self.f.rows();
        let tiles = self.int(self.f.tiles_per_head());
        let head = e.b.build_int_unsigned_div(unit, tiles, "")?;
        let first = self.mul(e.b.build_int_unsigned_rem(unit, tiles, "")?, TENSOR_CORE_ROW_TILE)?;
        let last = self.int(len - 1);
        let a = self.add(self.add(first, self.mul(self.warp, 16)?)?, self.group)?;
        let positions = [a, self.add_const(a, 8)?];
        let clamped = [self.min(positions[0], last)?, self.min(positions[1], last)?];
        let tile_last = self.min(self.add_const(first, TENSOR_CORE_ROW_TILE - 1)?, last)?;
        let rows = Rows {
            head,
            head_start: self.mul(head, len)?,
            positions,
            clamped,
            tile: (first, tile_last),
            ranges: [self.columns_of(clamped[0])?, self.columns_of(clamped[1])?],
        };
        match self.f.pass {
            AttentionPass::Forward => self.forward(&rows),
            AttentionPass::QueryGrad => self.query_grad(&rows),
            AttentionPass::KeyValueGrad | AttentionPass::KeyGrad | AttentionPass::ValueGrad => {
                self.key_value_grad(&rows)
            }
        }
    }

    /// The columns the tile's rows see: from its first row's first to its last row's end.
    fn column_range(&self, rows: &Rows<'ctx>) -> Result<(IntValue<'ctx>, IntValue<'ctx>), LlvmError> {
        Ok((self.columns_of(rows.tile.0)?.0, self.columns_of(rows.tile.1)?.1))
    }

    /// The first element of the thread's row `r` (clamped) in a `[.., len, d]` operand.
    fn row_start(&self, rows: &Rows<'ctx>, r: usize) -> Result<IntValue<'ctx>, LlvmError> {
        self.mul(self.add(rows.head_start, rows.clamped[r])?, self.f.dims.head_dim)
    }

    /// The rows' elements of a `[.., len, d]` operand as A fragments: per 16 of `d`, the words
    /// of (row a, 2t), (row b, 2t), (row a, 2t + 8), (row b, 2t + 8).
    fn fragments(&self, base: PointerValue<'ctx>, rows: &Rows<'ctx>) -> Result<Vec<[IntValue<'ctx>; 4]>, LlvmError> {
        let starts = [self.row_start(rows, 0)?, self.row_start(rows, 1)?];
        let column = self.mul(self.pair, 2)?;
        (0..self.f.dims.head_dim / 16)
            .map(|step| {
                let at = |r: usize, offset: usize| self.add(starts[r], self.add_const(column, step * 16 + offset)?);
                Ok([
                    self.load_pair(base, at(0, 0)?)?,
                    self.load_pair(base, at(1, 0)?)?,
                    self.load_pair(base, at(0, 8)?)?,
                    self.load_pair(base, at(1, 8)?)?,
                ])
            })
            .collect()
    }

    /// Runs `body` over the column tiles from `lo` before `hi` of the two `[.., len, d]` operands
    /// `sources` (of the head whose first row is `head_start`), each tile in shared memory when
    /// it runs: its first column, where the two operands' tiles start in shared memory, and the
    /// carried values. With two stages, tile `t + 1`'s copy (`cp.async`) is issued before tile
    /// `t`'s work, into the stage tile `t - 1` used, which a barrier after each tile's work frees;
    /// with one, each tile is copied between two barriers.
    #[allow(clippy::too_many_arguments)]
    fn column_tiles(
        &self,
        (lo, hi): (IntValue<'ctx>, IntValue<'ctx>),
        sources: [PointerValue<'ctx>; 2],
        head_start: IntValue<'ctx>,
        len: usize,
        init: &[V<'ctx>],
        mut body: impl FnMut(IntValue<'ctx>, [IntValue<'ctx>; 2], &[V<'ctx>]) -> Result<Vec<V<'ctx>>, LlvmError>,
    ) -> Result<Vec<V<'ctx>>, LlvmError> {
        let e = self.e;
        let operand = TENSOR_CORE_COLUMN_TILE * self.stride;
        let step = self.int(TENSOR_CORE_COLUMN_TILE);
        if stages(self.f) == 1 {
            return counted_loop(e, self.function, lo, hi, step, init, |start, carried| {
                self.barrier()?;
                self.copy_tile(sources, head_start, start, len, self.int(0))?;
                self.barrier()?;
                body(start, [self.int(0), self.int(operand)], carried)
            });
        }
        let any = e.b.build_int_compare(IntPredicate::SLT, lo, hi, "")?;
        if_then(e, self.function, any, || {
            self.copy_tile(sources, head_start, lo, len, self.int(0))?;
            self.async_copies("cp.async.commit_group;")
        })?;
        counted_loop(e, self.function, lo, hi, step, init, |start, carried| {
            let index = e.b.build_int_unsigned_div(e.b.build_int_sub(start, lo, "")?, step, "")?;
            let stage = e.b.build_and(index, self.int(1), "")?;
            let this = self.mul(stage, 2 * operand)?;
            let other = self.mul(e.b.build_xor(stage, self.int(1), "")?, 2 * operand)?;
            let next = self.add(start, step)?;
            let more = e.b.build_int_compare(IntPredicate::SLT, next, hi, "")?;
            if_then(e, self.function, more, || self.copy_tile(sources, head_start, next, len, other))?;
            // An empty group where there is no next tile: waiting for all groups but the newest
            // is then waiting for this tile's.
            self.async_copies("cp.async.commit_group;")?;
            self.async_copies("cp.async.wait_group 1;")?;
            self.barrier()?;
            let done = body(start, [this, self.add_const(this, operand)?], carried)?;
            self.barrier()?;
            Ok(done)
        })
    }

    /// Copies rows `start..start + TENSOR_CORE_COLUMN_TILE` of the two `[.., len, d]` operands
    /// `sources` (of the head whose first row is `head_start`) into the stage at element `stage`
    /// of shared memory, 16 bytes per thread at a time, zeros past `len`: with two stages as
    /// `cp.async` (its source size 0 past `len`), else loads and stores.
    fn copy_tile(
        &self,
        sources: [PointerValue<'ctx>; 2],
        head_start: IntValue<'ctx>,
        start: IntValue<'ctx>,
        len: usize,
        stage: IntValue<'ctx>,
    ) -> Result<(), LlvmError> {
        let (e, d) = (self.e, self.f.dims.head_dim);
        let (i16t, v4) = (e.ctx.i16_type(), e.ctx.i32_type().vec_type(4));
        let asynchronous = stages(self.f) == 2 && matches!(self.lanes, Lanes::Nvptx);
        let chunks_per_row = d / 8;
        let chunks = TENSOR_CORE_COLUMN_TILE * chunks_per_row;
        for round in 0..chunks.div_ceil(BLOCK as usize) {
            let chunk = self.add_const(self.thread, round * BLOCK as usize)?;
            let copy = || -> Result<(), LlvmError> {
                let row = e.b.build_int_unsigned_div(chunk, self.int(chunks_per_row), "")?;
                let column = self.mul(e.b.build_int_unsigned_rem(chunk, self.int(chunks_per_row), "")?, 8)?;
                let position = self.add(start, row)?;
                let inside = e.b.build_int_compare(IntPredicate::SLT, position, self.int(len), "")?;
                let position = self.min(position, self.int(len - 1))?;
                let from = self.add(self.mul(self.add(head_start, position)?, d)?, column)?;
                let to = self.add(self.add(self.mul(row, self.stride)?, column)?, stage)?;
                for (slot, source) in sources.into_iter().enumerate() {
                    let at = self.add_const(to, slot * TENSOR_CORE_COLUMN_TILE * self.stride)?;
                    let (to, from) = (self.element(i16t, self.shared, at)?, self.element(i16t, source, from)?);
                    if asynchronous {
                        self.copy_async(to, from, inside)?;
                        continue;
                    }
                    let load = e.b.build_load(v4, from, "")?;
                    if let Some(instruction) = inkwell::values::BasicValue::as_instruction_value(&load) {
                        let _ = instruction.set_alignment(16);
                    }
                    let value = e.b.build_select(inside, load.into_vector_value(), v4.const_zero(), "")?;
                    let _ = e.b.build_store(to, value)?.set_alignment(16);
                }
                Ok(())
            };
            if (round + 1) * BLOCK as usize <= chunks {
                copy()?;
            } else {
                let inside = e.b.build_int_compare(IntPredicate::ULT, chunk, self.int(chunks), "")?;
                if_then(e, self.function, inside, copy)?;
            }
        }
        Ok(())
    }

    /// The warp's rows times the rows of the shared tile at element `tile`, transposed (`q k^T`): per group of 8
    /// columns, the C fragment (f32). Each `ldmatrix.x4` loads the B fragments of two groups for
    /// one step of 16: matrix `lane / 8` is group `+ lane / 16`'s rows, head dims `+ 8` for odd
    /// `lane / 8`.
    fn products(&self, a: &[[IntValue<'ctx>; 4]], tile: IntValue<'ctx>) -> Result<Vec<V<'ctx>>, LlvmError> {
        let e = self.e;
        let lane_row = self.add(
            self.mul(e.b.build_right_shift(self.lane, self.int(4), false, "")?, 8)?,
            e.b.build_and(self.lane, self.int(7), "")?,
        )?;
        let lane_dim =
            self.mul(e.b.build_and(e.b.build_right_shift(self.lane, self.int(3), false, "")?, self.int(1), "")?, 8)?;
        let mut products = Vec::new();
        for pair in (0..COLUMN_GROUPS).step_by(2) {
            let row = self.add_const(lane_row, pair * 8)?;
            let start = self.add(self.add(self.mul(row, self.stride)?, tile)?, lane_dim)?;
            let (mut low, mut high) = (e.f32(4, 0.0), e.f32(4, 0.0));
            for (step, a) in a.iter().enumerate() {
                let at = self.add_const(start, step * 16)?;
                let [b0, b1, b2, b3] = self.load_matrices(self.element(e.ctx.i16_type(), self.shared, at)?, false)?;
                low = self.mma(a, [b0, b1], low)?;
                high = self.mma(a, [b2, b3], high)?;
            }
            products.extend([low, high]);
        }
        Ok(products)
    }

    /// `acc += x tile` for the shared tile at element `tile` (`p v`): `x` the column groups' C fragments,
    /// rounded into A fragments; `acc` the `d / 8` fragments of the warp's rows.
    fn accumulate(&self, x: &[V<'ctx>], tile: IntValue<'ctx>, acc: &mut [V<'ctx>]) -> Result<(), LlvmError> {
        let e = self.e;
        // Matrix `lane / 8` of an ldmatrix.x4: columns +0 or +8 of 16, head dims +0 or +8.
        let lane_row = self.add(
            self.mul(e.b.build_and(e.b.build_right_shift(self.lane, self.int(3), false, "")?, self.int(1), "")?, 8)?,
            e.b.build_and(self.lane, self.int(7), "")?,
        )?;
        let lane_dim = self.mul(e.b.build_right_shift(self.lane, self.int(4), false, "")?, 8)?;
        for step in 0..TENSOR_CORE_COLUMN_TILE / 16 {
            let (low, high) = (x[2 * step], x[2 * step + 1]);
            let a = [
                self.pack(self.shuffle(low, low, &[0, 1])?)?,
                self.pack(self.shuffle(low, low, &[2, 3])?)?,
                self.pack(self.shuffle(high, high, &[0, 1])?)?,
                self.pack(self.shuffle(high, high, &[2, 3])?)?,
            ];
            let row = self.add_const(lane_row, step * 16)?;
            for dims in (0..acc.len()).step_by(2) {
                let at = self.add(self.add_const(self.add(self.mul(row, self.stride)?, tile)?, dims * 8)?, lane_dim)?;
                let [b0, b1, b2, b3] = self.load_matrices(self.element(e.ctx.i16_type(), self.shared, at)?, true)?;
                acc[dims] = self.mma(&a, [b0, b1], acc[dims])?;
                acc[dims + 1] = self.mma(&a, [b2, b3], acc[dims + 1])?;
            }
        }
        Ok(())
    }

    /// The columns of group `group` of a tile from `start`: lanes row a's `2t`, `2t + 1`, then
    /// row b's (the same two).
    fn group_columns(&self, start: IntValue<'ctx>, group: usize) -> Result<[IntValue<'ctx>; 4], LlvmError> {
        let first = self.add(self.add_const(start, group * 8)?, self.mul(self.pair, 2)?)?;
        let second = self.add_const(first, 1)?;
        Ok([first, second, first, second])
    }

    /// A group's scores: `acc * scale + bias`, -inf where the column is masked for the row.
    fn scores(
        &self,
        acc: V<'ctx>,
        rows: &Rows<'ctx>,
        columns: &Columns<'ctx>,
        group: usize,
    ) -> Result<V<'ctx>, LlvmError> {
        let (e, dims) = (self.e, &self.f.dims);
        let i32t = e.ctx.i32_type();
        let mut s = e.fmul(acc, e.f32(4, self.f.scale as f32))?;
        let cols = self.group_columns(columns.start, group)?;
        if let (Some(bias), Some(shape)) = (self.ops.bias, dims.bias.as_deref()) {
            let (bias_rows, bias_cols) = (shape[shape.len() - 2], shape[shape.len() - 1]);
            let block_start = self.table(self.add_const(columns.query_head, dims.batch())?)?;
            let memory = e.memory_type(self.f.dtype, 1);
            let mut lanes = e.f32_type(4).get_undef();
            for (l, &col) in cols.iter().enumerate() {
                let col = self.min(col, self.int(self.column_len() - 1))?;
                let row = rows.clamped[l / 2];
                let (query, key) = if self.f.pass.over_keys() { (col, row) } else { (row, col) };
                let row_offset = if bias_rows == 1 { self.int(0) } else { self.mul(query, bias_cols)? };
                let col_offset = if bias_cols == 1 { self.int(0) } else { key };
                let at = self.add(self.add(block_start, row_offset)?, col_offset)?;
                let raw = e.b.build_load(memory, self.element(memory, bias, at)?, "")?;
                let x = e.widen(self.f.dtype, raw.into_vector_value())?;
                lanes = e.b.build_insert_element(lanes, e.lane(x, 0)?, i32t.const_int(l as u64, false), "")?;
            }
            s = e.fadd(s, lanes)?;
        }
        let mut valid = e.ctx.bool_type().vec_type(4).get_undef();
        for (l, &col) in cols.iter().enumerate() {
            let (lo, hi) = rows.ranges[l / 2];
            let above = e.b.build_int_compare(IntPredicate::SGE, col, lo, "")?;
            let below = e.b.build_int_compare(IntPredicate::SLT, col, hi, "")?;
            let inside = e.b.build_and(above, below, "")?;
            valid = e.b.build_insert_element(valid, inside, i32t.const_int(l as u64, false), "")?;
        }
        e.select(valid, s, e.f32(4, f32::NEG_INFINITY))
    }

    /// A per-query f32 (lse, `dout . out`) of a group's columns (queries), lanes as
    /// [`Tiles::group_columns`].
    fn column_values(
        &self,
        base: PointerValue<'ctx>,
        columns: &Columns<'ctx>,
        group: usize,
    ) -> Result<V<'ctx>, LlvmError> {
        let (e, q_len) = (self.e, self.f.dims.q_len);
        let head_start = self.mul(columns.query_head, q_len)?;
        let mut lanes = e.f32_type(4).get_undef();
        for (l, &col) in self.group_columns(columns.start, group)?.iter().enumerate() {
            let at = self.add(head_start, self.min(col, self.int(q_len - 1))?)?;
            let x = e.b.build_load(e.ctx.f32_type(), self.element(e.ctx.f32_type(), base, at)?, "")?;
            lanes = e.b.build_insert_element(lanes, x, e.ctx.i32_type().const_int(l as u64, false), "")?;
        }
        Ok(lanes)
    }

    /// `value(r)` (lanes `r` of `values`, scaled by `scale`) stored at the thread's row `r` of a
    /// `[.., len, d]` output, its `d / 8` fragments rounded in pairs; rows past the sequence
    /// store nothing. `also` runs for each stored row (its position in the operand).
    fn store_rows(
        &self,
        base: PointerValue<'ctx>,
        rows: &Rows<'ctx>,
        values: &[V<'ctx>],
        scale: [V<'ctx>; 2],
        also: impl Fn(usize, IntValue<'ctx>) -> Result<(), LlvmError>,
    ) -> Result<(), LlvmError> {
        let (e, dims) = (self.e, &self.f.dims);
        let (_, len) = self.f.rows();
        let column = self.mul(self.pair, 2)?;
        for (r, &position) in rows.positions.iter().enumerate() {
            let inside = e.b.build_int_compare(IntPredicate::SLT, position, self.int(len), "")?;
            if_then(e, self.function, inside, || {
                let row = self.add(rows.head_start, position)?;
                let start = self.add(self.mul(row, dims.head_dim)?, column)?;
                for (group, &value) in values.iter().enumerate() {
                    let lanes = self.shuffle(value, value, &[2 * r as u32, 2 * r as u32 + 1])?;
                    let pair = self.pack(e.fmul(lanes, scale[r])?)?;
                    let at = self.add_const(start, group * 8)?;
                    let _ = e.b.build_store(self.element(e.ctx.i16_type(), base, at)?, pair)?.set_alignment(4);
                }
                also(r, row)
            })?;
        }
        Ok(())
    }

    /// `x` (one f32 per row) stored at `base[row]` by the first thread of the row's quad.
    fn store_per_row(
        &self,
        base: PointerValue<'ctx>,
        r: usize,
        row: IntValue<'ctx>,
        x: V<'ctx>,
    ) -> Result<(), LlvmError> {
        let e = self.e;
        let first_of_quad = e.b.build_int_compare(IntPredicate::EQ, self.pair, self.int(0), "")?;
        if_then(e, self.function, first_of_quad, || {
            let value = e.lane(x, r as u32)?;
            let _ = e.b.build_store(self.element(e.ctx.f32_type(), base, row)?, value)?;
            Ok(())
        })
    }
}
