//! Attention as generated code ([`AttentionFunction`]), for x86 and NVPTX from one emitter: the
//! forward and the passes of the backward, each over units of rows `begin..end` (x86: `void
//! f(u8** buffers, i64 begin, i64 end)`; GPU: `define_nvptx`), buffers in the kernel's order
//! (inputs, outputs), then the function's table and a scratch of one f32 per query row
//! (`dout . out`, from `dq`'s pass for `dk`'s and `dv`'s).
//!
//! A row is one query (forward, `dq`) or one key (`dk`, `dv`). On x86 a unit's rows (up to 4)
//! hold their vectors (q, k, v, out, dout) in registers as vectors of `w` lanes (the widest
//! that divides both head dims, up to the host's width), and the keys (or queries) they meet
//! are taken a block of `W` (the host's width) at a time: the block's scores as one vector of
//! `W` lanes (the `W` dot products reduced together), masked lanes and lanes past the range
//! set to -inf, then one vectorised exponential for the block and an online softmax (the
//! running maximum and sum rescaled per block, FlashAttention's), and the probabilities'
//! products accumulated a lane at a time. On a GPU, 16-bit attention whose head dims tensor
//! cores take runs in tiles of rows on them ([`crate::attention_tiles`]; here, for the emulated
//! GPU, a tile's rows one at a time, the tensor cores' operands rounded as they are); other
//! attention a thread per row, one lane wide: its registers hold the row's accumulators,
//! operands are read where they are used and dot products are loops, so that nothing spills.
//! Every row's result depends on its own elements
//! in a fixed order, never on how rows are split among threads. Scores and sums are f32 (the
//! builtin kernel, the oracle, is f64); 16-bit operands load widened and results store rounded
//! to nearest even.
//!
//! The forward keeps each query's log-sum-exp; `dq` recomputes each probability from it (and
//! keeps `dout . out`), and `dk`/`dv` recompute the probability of every query that sees the
//! key, over all query heads that share the key/value head (the table lists them), so no pass
//! writes another's rows and no `Sq x Sk` matrix exists.

use autotp_kernels::attention::{
    AttentionFunction, AttentionMask, AttentionPass, AttentionTarget, TENSOR_CORE_ROW_TILE,
};
use autotp_kernels::DType;
use inkwell::types::VectorType;
use inkwell::values::{FunctionValue, IntValue, PointerValue};
use inkwell::{AddressSpace, FloatPredicate, IntPredicate};

use crate::emit::{counted_loop, Buffer, Emitter, V};
use crate::nvptx::special_register;
use crate::{math, LlvmError};

/// A row of an operand ([`Attention::load_row`]).
struct Row<'ctx> {
    base: PointerValue<'ctx>,
    dtype: DType,
    /// Its first element.
    start: IntValue<'ctx>,
    /// Its vectors of `w` lanes.
    chunks: usize,
    loaded: Option<Vec<V<'ctx>>>,
}

/// The function's buffers, in the kernel's order.
pub(crate) struct Buffers<'ctx> {
    pub q: PointerValue<'ctx>,
    pub k: PointerValue<'ctx>,
    pub v: PointerValue<'ctx>,
    pub bias: Option<PointerValue<'ctx>>,
    pub out: PointerValue<'ctx>,
    pub lse: PointerValue<'ctx>,
    pub d_out: Option<PointerValue<'ctx>>,
    /// The position of each run's first query, where the queries come in runs that do not
    /// start at 0 (a context-parallel rank's: [`autotp_kernels::attention::AttentionDims::query_runs`]); i64s.
    pub query_start: Option<PointerValue<'ctx>>,
    /// The outputs of the backward: dq, dk, dv.
    pub grads: [Option<PointerValue<'ctx>>; 3],
    pub table: PointerValue<'ctx>,
    /// `dout . out` of every query row (f32), written by `dq`'s pass for `dk`'s and `dv`'s.
    pub delta: PointerValue<'ctx>,
}

impl<'ctx> Buffers<'ctx> {
    /// `f`'s buffers from its [`buffer_count`] pointers, in order.
    pub(crate) fn take(f: &AttentionFunction, pointers: impl IntoIterator<Item = PointerValue<'ctx>>) -> Buffers<'ctx> {
        let mut next = pointers.into_iter();
        let mut take = || next.next().expect("buffer_count pointers");
        let (q, k, v) = (take(), take(), take());
        let bias = f.dims.bias.is_some().then(&mut take);
        let backward = f.pass != AttentionPass::Forward;
        let positioned = f.dims.query_runs.is_some();
        // The run's start is the kernel's last input: before the forward's outputs, after the
        // backward's `d_out`.
        let mut query_start = (positioned && !backward).then(&mut take);
        let (out, lse) = (take(), take());
        let d_out = backward.then(&mut take);
        if positioned && backward {
            query_start = Some(take());
        }
        let grads = if backward { [Some(take()), Some(take()), Some(take())] } else { [None; 3] };
        let (table, delta) = (take(), take());
        Buffers { q, k, v, bias, out, lse, d_out, query_start, grads, table, delta }
    }

    /// The position of the first query (0 without [`Buffers::query_start`]).
    pub(crate) fn first_query<'b>(&self, e: &Emitter<'b, 'ctx>) -> Result<IntValue<'ctx>, LlvmError> {
        self.run_start(e, e.ctx.i64_type().const_int(0, false))
    }

    /// The position of run `run`'s first query (0 without [`Buffers::query_start`]).
    fn run_start<'b>(&self, e: &Emitter<'b, 'ctx>, run: IntValue<'ctx>) -> Result<IntValue<'ctx>, LlvmError> {
        let i64t = e.ctx.i64_type();
        match self.query_start {
            Some(start) => {
                // SAFETY (of the generated code): `run` is below the runs the operand holds.
                let at = unsafe { e.b.build_in_bounds_gep(i64t, start, &[run], "")? };
                Ok(e.b.build_load(i64t, at, "")?.into_int_value())
            }
            None => Ok(i64t.const_int(0, false)),
        }
    }
}

/// The keys query `i` sees under `mask`, of `kv_len`, the first query at position `first`:
/// `[lo, hi)`.
pub(crate) fn mask_keys<'ctx>(
    e: &Emitter<'_, 'ctx>,
    mask: AttentionMask,
    kv_len: usize,
    i: IntValue<'ctx>,
    first: IntValue<'ctx>,
) -> Result<(IntValue<'ctx>, IntValue<'ctx>), LlvmError> {
    let int = |x: usize| e.ctx.i64_type().const_int(x as u64, false);
    let after = e.b.build_int_add(e.b.build_int_add(i, first, "")?, int(1), "")?;
    // `after` clamped into `[0, kv_len]` (signed: a query before every key sees none).
    let hi = int_min(e, int_max(e, after, int(0))?, int(kv_len))?;
    Ok(match mask {
        AttentionMask::None => (int(0), int(kv_len)),
        AttentionMask::Causal => (int(0), hi),
        AttentionMask::SlidingWindow { window } => {
            let lo = int_max(e, e.b.build_int_sub(after, int(window), "")?, int(0))?;
            (int_min(e, lo, hi)?, hi)
        }
    })
}

/// The queries, of `q_len` from position `first` on, that see key `j` under `mask`: `[lo,
/// hi)`, counted from the first.
pub(crate) fn mask_queries<'ctx>(
    e: &Emitter<'_, 'ctx>,
    mask: AttentionMask,
    q_len: usize,
    j: IntValue<'ctx>,
    first: IntValue<'ctx>,
) -> Result<(IntValue<'ctx>, IntValue<'ctx>), LlvmError> {
    let int = |x: usize| e.ctx.i64_type().const_int(x as u64, false);
    // `x - first` clamped into `[0, q_len]` (signed: a key before the first query).
    let local = |x: IntValue<'ctx>| -> Result<IntValue<'ctx>, LlvmError> {
        int_min(e, int_max(e, e.b.build_int_sub(x, first, "")?, int(0))?, int(q_len))
    };
    Ok(match mask {
        AttentionMask::None => (int(0), int(q_len)),
        AttentionMask::Causal => (local(j)?, int(q_len)),
        AttentionMask::SlidingWindow { window } => (local(j)?, local(e.b.build_int_add(j, int(window), "")?)?),
    })
}

/// The smaller of two signed integers.
pub(crate) fn int_min<'ctx>(
    e: &Emitter<'_, 'ctx>,
    a: IntValue<'ctx>,
    b: IntValue<'ctx>,
) -> Result<IntValue<'ctx>, LlvmError> {
    let less = e.b.build_int_compare(IntPredicate::SLT, a, b, "")?;
    Ok(e.b.build_select(less, a, b, "")?.into_int_value())
}

/// The larger of two signed integers.
pub(crate) fn int_max<'ctx>(
    e: &Emitter<'_, 'ctx>,
    a: IntValue<'ctx>,
    b: IntValue<'ctx>,
) -> Result<IntValue<'ctx>, LlvmError> {
    let greater = e.b.build_int_compare(IntPredicate::SGT, a, b, "")?;
    Ok(e.b.build_select(greater, a, b, "")?.into_int_value())
}

struct Attention<'a, 'b, 'ctx> {
    e: &'a Emitter<'b, 'ctx>,
    function: FunctionValue<'ctx>,
    f: &'a AttentionFunction,
    buffers: Buffers<'ctx>,
    /// Lanes of a head-dim vector.
    w: u32,
    /// Keys (or queries) per block.
    block: u32,
    /// Whether the function is for NVPTX (else x86, where a GPU's cut of the work runs too: the
    /// emulated GPU).
    nvptx: bool,
}

/// The entry point of attention function `index` in a plan's PTX module.
pub fn entry_name(index: usize) -> String {
    format!("autotp_attention_{index}")
}

/// How many buffers `f`'s entry takes: the kernel's inputs and outputs, the table, the scratch.
pub fn buffer_count(f: &AttentionFunction) -> usize {
    let extra = usize::from(f.dims.bias.is_some()) + usize::from(f.dims.query_runs.is_some());
    let kernel = if f.pass == AttentionPass::Forward { 3 + extra + 2 } else { 6 + extra + 3 };
    kernel + 2
}

fn check(f: &AttentionFunction) -> Result<(), LlvmError> {
    if !matches!(f.dtype, DType::F32 | DType::BF16 | DType::F16) || !f.dims.is_valid() {
        return Err(LlvmError::llvm("attention", format!("no generated attention for {} or these shapes", f.dtype)));
    }
    Ok(())
}

/// Appends the function `symbol` computing `f` for a host with `width` f32 lanes (one for a
/// GPU's cut of the work, which then runs here as on a GPU's thread):
/// `void f(u8** buffers, i64 begin, i64 end)` over units `begin..end`.
pub(crate) fn define_cpu<'ctx>(
    e: &Emitter<'_, 'ctx>,
    symbol: &str,
    f: &AttentionFunction,
    width: u32,
) -> Result<FunctionValue<'ctx>, LlvmError> {
    check(f)?;
    let entry = crate::cpu::CpuEntry::declare(e, symbol)?;
    let pointers = (0..buffer_count(f)).map(|n| entry.pointer(e, n)).collect::<Result<Vec<_>, LlvmError>>()?;
    let width = if f.target == AttentionTarget::Gpu { 1 } else { width };
    let a = Attention::new(e, entry.function, f, &pointers, width, false);
    a.units((entry.begin, entry.end), e.ctx.i64_type().const_int(1, false))?;
    Ok(entry.function)
}

/// Declares the GPU entry `symbol` of `f`, `void f(b0, b1, ..., i64 units)` (a generic pointer
/// per buffer of [`buffer_count`]), positioned at its start: it, its buffers and its units.
pub(crate) fn declare_gpu_entry<'ctx>(
    e: &Emitter<'_, 'ctx>,
    symbol: &str,
    f: &AttentionFunction,
) -> (FunctionValue<'ctx>, Vec<PointerValue<'ctx>>, IntValue<'ctx>) {
    let (ctx, count) = (e.ctx, buffer_count(f));
    let mut params: Vec<inkwell::types::BasicMetadataTypeEnum> =
        vec![ctx.ptr_type(AddressSpace::default()).into(); count];
    params.push(ctx.i64_type().into());
    let function = e.module.add_function(symbol, ctx.void_type().fn_type(&params, false), None);
    e.b.position_at_end(ctx.append_basic_block(function, "entry"));
    let pointers = (0..count as u32).map(|n| function.get_nth_param(n).expect("declared").into_pointer_value());
    let units = function.get_nth_param(count as u32).expect("declared").into_int_value();
    (function, pointers.collect(), units)
}

/// Appends the GPU entry `symbol` computing `f`: `void f(b0, b1, ..., i64 units)`, one
/// generic pointer per buffer; thread `t` of the grid runs units `t, t + threads, ...`, its
/// vectors one lane wide (a thread's registers hold a row). Launched with
/// [`crate::nvptx::BLOCK`] threads per block.
pub(crate) fn define_nvptx<'ctx>(
    e: &Emitter<'_, 'ctx>,
    symbol: &str,
    f: &AttentionFunction,
) -> Result<FunctionValue<'ctx>, LlvmError> {
    check(f)?;
    if f.tensor_cores {
        return crate::attention_tiles::define_nvptx(e, symbol, f);
    }
    let (function, pointers, units) = declare_gpu_entry(e, symbol, f);
    let (block, thread) = (special_register(e, "ctaid.x")?, special_register(e, "tid.x")?);
    let (first, stride) = grid_stride(e, block, thread, special_register(e, "nctaid.x")?)?;
    let a = Attention::new(e, function, f, &pointers, 1, true);
    a.units((first, units), stride)?;
    Ok(function)
}

/// A grid's thread's first unit and its stride over units, a thread per unit: thread `thread`
/// of block `block` of `blocks` (of [`crate::nvptx::BLOCK`] threads) takes units `block *
/// BLOCK + thread`, then every `blocks * BLOCK`.
fn grid_stride<'ctx>(
    e: &Emitter<'_, 'ctx>,
    block: IntValue<'ctx>,
    thread: IntValue<'ctx>,
    blocks: IntValue<'ctx>,
) -> Result<(IntValue<'ctx>, IntValue<'ctx>), LlvmError> {
    let threads = e.ctx.i64_type().const_int(crate::nvptx::BLOCK as u64, false);
    let first = e.b.build_int_add(e.b.build_int_mul(block, threads, "")?, thread, "")?;
    Ok((first, e.b.build_int_mul(blocks, threads, "")?))
}

/// Declares the host function `symbol` that one thread of a simulated GPU block runs for `f`
/// ([`crate::warp_simulator`]): `void f(u8** buffers, i64 block, i64 thread)`, the buffers of
/// [`buffer_count`] followed by the [`SimulatedBlock`](crate::warp_simulator::SimulatedBlock);
/// the entry, its buffers' pointers and the simulated block.
pub(crate) fn declare_simulated_entry<'ctx>(
    e: &Emitter<'_, 'ctx>,
    symbol: &str,
    f: &AttentionFunction,
) -> Result<(crate::cpu::CpuEntry<'ctx>, Vec<PointerValue<'ctx>>, crate::lanes::SimulatedPlace<'ctx>), LlvmError> {
    let entry = crate::cpu::CpuEntry::declare(e, symbol)?;
    let count = buffer_count(f);
    let pointers = (0..count).map(|n| entry.pointer(e, n)).collect::<Result<Vec<_>, LlvmError>>()?;
    let simulated = crate::lanes::Lanes::simulated(e, &entry, count)?;
    Ok((entry, pointers, simulated))
}

/// Appends `f` as the host function `symbol` that one thread of a simulated GPU block runs
/// ([`declare_simulated_entry`]). A tensor-core pass is
/// [`crate::attention_tiles::define_simulated`]'s; any other takes the units a GPU's thread
/// takes in [`define_nvptx`], one lane wide.
pub(crate) fn define_simulated<'ctx>(
    e: &Emitter<'_, 'ctx>,
    symbol: &str,
    f: &AttentionFunction,
) -> Result<FunctionValue<'ctx>, LlvmError> {
    if f.tensor_cores {
        return crate::attention_tiles::define_simulated(e, symbol, f);
    }
    check(f)?;
    let (entry, pointers, simulated) = declare_simulated_entry(e, symbol, f)?;
    let (first, stride) = grid_stride(e, entry.begin, entry.end, simulated.blocks)?;
    let a = Attention::new(e, entry.function, f, &pointers, 1, false);
    a.units((first, e.ctx.i64_type().const_int(f.units() as u64, false)), stride)?;
    Ok(entry.function)
}

impl<'a, 'b, 'ctx> Attention<'a, 'b, 'ctx> {
    /// The emitter of `f` over these buffers ([`buffer_count`] of them, in order), vectors of up
    /// to `width` lanes, for NVPTX or x86.
    fn new(
        e: &'a Emitter<'b, 'ctx>,
        function: FunctionValue<'ctx>,
        f: &'a AttentionFunction,
        pointers: &[PointerValue<'ctx>],
        width: u32,
        nvptx: bool,
    ) -> Attention<'a, 'b, 'ctx> {
        let buffers = Buffers::take(f, pointers.iter().copied());
        let mut w = width;
        while w > 1 && !(f.dims.head_dim.is_multiple_of(w as usize) && f.dims.value_dim.is_multiple_of(w as usize)) {
            w /= 2;
        }
        Attention { e, function, f, buffers, w, block: width, nvptx }
    }

    /// Units `from, from + step, ...` before `to`, then the function's return.
    fn units(&self, (from, to): (IntValue<'ctx>, IntValue<'ctx>), step: IntValue<'ctx>) -> Result<(), LlvmError> {
        counted_loop(self.e, self.function, from, to, step, &[], |unit, _| {
            self.unit(unit)?;
            Ok(vec![])
        })?;
        self.e.b.build_return(None)?;
        Ok(())
    }

    /// One unit of the function's pass.
    fn unit(&self, unit: IntValue<'ctx>) -> Result<(), LlvmError> {
        if self.f.tensor_cores {
            return self.tile(unit);
        }
        self.rows(unit)
    }

    /// A unit of rows of the pass.
    fn rows(&self, unit: IntValue<'ctx>) -> Result<(), LlvmError> {
        match self.f.pass {
            AttentionPass::Forward => self.forward_rows(unit),
            AttentionPass::QueryGrad => self.query_grad_rows(unit),
            AttentionPass::KeyValueGrad | AttentionPass::KeyGrad | AttentionPass::ValueGrad => {
                self.key_value_grad_rows(unit)
            }
        }
    }
}

impl<'ctx> Attention<'_, '_, 'ctx> {
    fn int(&self, x: usize) -> IntValue<'ctx> {
        self.e.ctx.i64_type().const_int(x as u64, false)
    }

    fn add(&self, a: IntValue<'ctx>, b: IntValue<'ctx>) -> Result<IntValue<'ctx>, LlvmError> {
        Ok(self.e.b.build_int_add(a, b, "")?)
    }

    fn mul(&self, a: IntValue<'ctx>, b: usize) -> Result<IntValue<'ctx>, LlvmError> {
        Ok(self.e.b.build_int_mul(a, self.int(b), "")?)
    }

    fn min(&self, a: IntValue<'ctx>, b: IntValue<'ctx>) -> Result<IntValue<'ctx>, LlvmError> {
        int_min(self.e, a, b)
    }

    /// Entry `at` of the table.
    fn table(&self, at: IntValue<'ctx>) -> Result<IntValue<'ctx>, LlvmError> {
        let i64t = self.e.ctx.i64_type();
        // SAFETY (of the generated code): the table has the entries `AttentionFunction::table` lists.
        let slot = unsafe { self.e.b.build_in_bounds_gep(i64t, self.buffers.table, &[at], "")? };
        Ok(self.e.b.build_load(i64t, slot, "")?.into_int_value())
    }

    /// `width` elements of `dtype` at element `offset` of `base`, as f32.
    fn load(
        &self,
        base: PointerValue<'ctx>,
        dtype: DType,
        offset: IntValue<'ctx>,
        width: u32,
    ) -> Result<V<'ctx>, LlvmError> {
        let e = self.e;
        let at = e.element_pointer(&Buffer { pointer: base, dtype }, offset)?;
        let raw = e.b.build_load(e.memory_type(dtype, width), at, "")?;
        if let Some(instruction) = inkwell::values::BasicValue::as_instruction_value(&raw) {
            let _ = instruction.set_alignment(dtype.size() as u32);
        }
        e.widen(dtype, raw.into_vector_value())
    }

    fn store(
        &self,
        base: PointerValue<'ctx>,
        dtype: DType,
        offset: IntValue<'ctx>,
        value: V<'ctx>,
    ) -> Result<(), LlvmError> {
        let at = self.e.element_pointer(&Buffer { pointer: base, dtype }, offset)?;
        let _ = self.e.b.build_store(at, self.e.narrow(dtype, value)?)?.set_alignment(dtype.size() as u32);
        Ok(())
    }

    /// Row `row` of a `[rows, len]` operand: loaded now as vectors of `w` lanes on x86 (the
    /// unit's rows reuse them), where each vector is used on a GPU (a thread's registers hold
    /// its accumulators; the cache serves the reloads).
    fn load_row(
        &self,
        base: PointerValue<'ctx>,
        dtype: DType,
        row: IntValue<'ctx>,
        len: usize,
    ) -> Result<Row<'ctx>, LlvmError> {
        let start = self.mul(row, len)?;
        let chunks = len / self.w as usize;
        let mut row = Row { base, dtype, start, chunks, loaded: None };
        if self.block > 1 {
            row.loaded = Some((0..chunks).map(|c| self.chunk(&row, c)).collect::<Result<_, _>>()?);
        }
        Ok(row)
    }

    /// Vector `c` of `row`.
    fn chunk(&self, row: &Row<'ctx>, c: usize) -> Result<V<'ctx>, LlvmError> {
        match &row.loaded {
            Some(vectors) => Ok(vectors[c]),
            None => {
                let at = self.opaque(self.add(row.start, self.int(c * self.w as usize))?)?;
                self.load(row.base, row.dtype, at, self.w)
            }
        }
    }

    /// `x`, through an assembly move the optimiser cannot see through: a load at it stays
    /// where it is used instead of being hoisted out of the loop into a register for good.
    fn opaque(&self, x: IntValue<'ctx>) -> Result<IntValue<'ctx>, LlvmError> {
        if !self.nvptx {
            return Ok(x);
        }
        let (ctx, i64t) = (self.e.ctx, self.e.ctx.i64_type());
        let ty = i64t.fn_type(&[i64t.into()], false);
        let asm = ctx.create_inline_asm(ty, "mov.b64 $0, $1;".into(), "=l,l".into(), true, false, None, false);
        let call = self.e.b.build_indirect_call(ty, asm, &[x.into()], "")?;
        Ok(call.try_as_basic_value().basic().expect("returns i64").into_int_value())
    }

    fn store_row(
        &self,
        base: PointerValue<'ctx>,
        row: IntValue<'ctx>,
        len: usize,
        values: &[V<'ctx>],
    ) -> Result<(), LlvmError> {
        let start = self.mul(row, len)?;
        for (c, &value) in values.iter().enumerate() {
            self.store(base, self.f.dtype, self.add(start, self.int(c * self.w as usize))?, value)?;
        }
        Ok(())
    }

    /// The lanes of `v` folded into one (`<1 x float>`) as a tree of halves.
    fn tree(
        &self,
        v: V<'ctx>,
        fold: impl Fn(V<'ctx>, V<'ctx>) -> Result<V<'ctx>, LlvmError>,
    ) -> Result<V<'ctx>, LlvmError> {
        let e = self.e;
        let mut v = v;
        while Emitter::width(v) > 1 {
            let half = Emitter::width(v) / 2;
            let lanes = |from: u32| {
                let i32t = e.ctx.i32_type();
                inkwell::types::VectorType::const_vector(
                    &(from..from + half).map(|l| i32t.const_int(l as u64, false)).collect::<Vec<_>>(),
                )
            };
            let low = e.b.build_shuffle_vector(v, v, lanes(0), "")?;
            let high = e.b.build_shuffle_vector(v, v, lanes(half), "")?;
            v = fold(low, high)?;
        }
        Ok(v)
    }

    fn sum(&self, v: V<'ctx>) -> Result<V<'ctx>, LlvmError> {
        self.tree(v, |a, b| self.e.fadd(a, b))
    }

    /// `a . b` (`<1 x float>`).
    fn dot(&self, a: &Row<'ctx>, b: &Row<'ctx>) -> Result<V<'ctx>, LlvmError> {
        self.sum(self.partial_dot(a, b)?)
    }

    /// `acc + a * x` for a scalar `a` (`<1 x float>`).
    fn axpy(&self, acc: &[V<'ctx>], a: V<'ctx>, x: &Row<'ctx>) -> Result<Vec<V<'ctx>>, LlvmError> {
        let a = self.e.broadcast(a, self.w)?;
        acc.iter().enumerate().map(|(c, &acc)| self.e.fma(a, self.chunk(x, c)?, acc)).collect()
    }

    fn scaled(&self, values: &[V<'ctx>], by: V<'ctx>) -> Result<Vec<V<'ctx>>, LlvmError> {
        let by = self.e.broadcast(by, self.w)?;
        values.iter().map(|&v| self.e.fmul(v, by)).collect()
    }

    /// The scalars `lane(c)` for `c` in `0..block`, as one vector.
    fn gather(&self, lanes: &[V<'ctx>]) -> Result<V<'ctx>, LlvmError> {
        let e = self.e;
        let mut v = e.f32_type(lanes.len() as u32).get_undef();
        for (c, &x) in lanes.iter().enumerate() {
            v = e.b.build_insert_element(v, e.lane(x, 0)?, e.ctx.i32_type().const_int(c as u64, false), "")?;
        }
        Ok(v)
    }

    fn lane(&self, v: V<'ctx>, c: usize) -> Result<V<'ctx>, LlvmError> {
        self.e.splat(self.e.lane(v, c as u32)?, 1)
    }

    /// `a . b` before its lanes are summed (`w` lanes): over rows in registers, a chain of
    /// multiply-adds; over rows in memory (GPU), a loop that loads a pair of elements per step,
    /// so that a thread's registers hold no operand row.
    fn partial_dot(&self, a: &Row<'ctx>, b: &Row<'ctx>) -> Result<V<'ctx>, LlvmError> {
        let e = self.e;
        if a.loaded.is_none() && b.loaded.is_none() {
            let w = self.int(self.w as usize);
            let end = self.int(a.chunks * self.w as usize);
            let sum = counted_loop(e, self.function, self.int(0), end, w, &[e.f32(self.w, 0.0)], |at, acc| {
                let x = self.load(a.base, a.dtype, self.add(a.start, at)?, self.w)?;
                let y = self.load(b.base, b.dtype, self.add(b.start, at)?, self.w)?;
                Ok(vec![e.fma(x, y, acc[0])?])
            })?;
            return Ok(sum[0]);
        }
        let mut acc = e.fmul(self.chunk(a, 0)?, self.chunk(b, 0)?)?;
        for c in 1..a.chunks {
            acc = e.fma(self.chunk(a, c)?, self.chunk(b, c)?, acc)?;
        }
        Ok(acc)
    }

    /// One dot product per lane of a block (`pairs[c]` for lane `c`). With as many lanes per
    /// head-dim vector as the block has, the partial sums are reduced together, a block of
    /// vectors into one (halves of pairs added level by level: `W - 1` additions for `W` dots
    /// instead of `W log W`); otherwise each dot is summed alone.
    fn dots(&self, pairs: &[(&Row<'ctx>, &Row<'ctx>)]) -> Result<V<'ctx>, LlvmError> {
        let partials: Vec<V<'ctx>> = pairs.iter().map(|(a, b)| self.partial_dot(a, b)).collect::<Result<_, _>>()?;
        if self.w != self.block || pairs.len() != self.block as usize {
            let sums: Vec<V<'ctx>> = partials.into_iter().map(|p| self.sum(p)).collect::<Result<_, _>>()?;
            return self.gather(&sums);
        }
        let (e, n) = (self.e, self.block as usize);
        let i32t = e.ctx.i32_type();
        let indices = |lanes: &[usize]| {
            VectorType::const_vector(&lanes.iter().map(|&l| i32t.const_int(l as u64, false)).collect::<Vec<_>>())
        };
        // Each vector with the dots its segments hold, in order.
        let mut level: Vec<(V<'ctx>, Vec<usize>)> =
            partials.into_iter().enumerate().map(|(c, v)| (v, vec![c])).collect();
        while level.len() > 1 {
            let mut next = Vec::new();
            for pair in level.chunks(2) {
                let ((s, s_dots), (t, t_dots)) = (&pair[0], &pair[1]);
                let size = n / s_dots.len();
                let half = size / 2;
                let (mut low, mut high, mut dots) = (Vec::new(), Vec::new(), Vec::new());
                for k in 0..s_dots.len() {
                    let start = k * size;
                    low.extend((start..start + half).chain(n + start..n + start + half));
                    high.extend((start + half..start + size).chain(n + start + half..n + start + size));
                    dots.extend([s_dots[k], t_dots[k]]);
                }
                let x = e.b.build_shuffle_vector(*s, *t, indices(&low), "")?;
                let y = e.b.build_shuffle_vector(*s, *t, indices(&high), "")?;
                next.push((e.fadd(x, y)?, dots));
            }
            level = next;
        }
        let (sums, dots) = &level[0];
        let lane_of: Vec<usize> = (0..n).map(|c| dots.iter().position(|&d| d == c).expect("every dot")).collect();
        Ok(e.b.build_shuffle_vector(*sums, *sums, indices(&lane_of), "")?)
    }

    /// The scores of a block: `dots * scale + bias`, the bias of query `queries[c]` (or the
    /// one query) and key `keys[c]` (or the one key) in lane `c`.
    fn scores(
        &self,
        dots: V<'ctx>,
        b: IntValue<'ctx>,
        queries: &[IntValue<'ctx>],
        keys: &[IntValue<'ctx>],
    ) -> Result<V<'ctx>, LlvmError> {
        let e = self.e;
        let s = e.fmul(dots, e.f32(self.block, self.f.scale as f32))?;
        let (Some(bias), Some(shape)) = (self.buffers.bias, self.f.dims.bias.as_deref()) else { return Ok(s) };
        let (rows, cols) = (shape[shape.len() - 2], shape[shape.len() - 1]);
        let block_start = self.table(self.add(self.int(self.f.dims.batch()), b)?)?;
        let mut lanes = Vec::new();
        for c in 0..self.block as usize {
            let (i, j) = (queries[c.min(queries.len() - 1)], keys[c.min(keys.len() - 1)]);
            let row = if rows == 1 { self.int(0) } else { self.mul(i, cols)? };
            let col = if cols == 1 { self.int(0) } else { j };
            lanes.push(self.load(bias, self.f.dtype, self.add(self.add(block_start, row)?, col)?, 1)?);
        }
        e.fadd(s, self.gather(&lanes)?)
    }

    /// Element `at` of an f32 buffer for every lane.
    fn lanes_of(&self, base: PointerValue<'ctx>, at: &[IntValue<'ctx>]) -> Result<V<'ctx>, LlvmError> {
        let values: Vec<V<'ctx>> = at.iter().map(|&a| self.load(base, DType::F32, a, 1)).collect::<Result<_, _>>()?;
        self.gather(&values)
    }

    /// The keys query `i` sees: `[lo, hi)`.
    fn keys(&self, i: IntValue<'ctx>) -> Result<(IntValue<'ctx>, IntValue<'ctx>), LlvmError> {
        let (runs, len) = self.f.dims.runs();
        if runs == 1 {
            return mask_keys(self.e, self.f.mask, self.f.dims.kv_len, i, self.buffers.first_query(self.e)?);
        }
        let b = &self.e.b;
        let (run, in_run) =
            (b.build_int_unsigned_div(i, self.int(len), "")?, b.build_int_unsigned_rem(i, self.int(len), "")?);
        mask_keys(self.e, self.f.mask, self.f.dims.kv_len, in_run, self.buffers.run_start(self.e, run)?)
    }

    /// The queries of run `run` that see key `j`: `[lo, hi)`, counted from the first query of
    /// all.
    fn queries(&self, j: IntValue<'ctx>, run: usize) -> Result<(IntValue<'ctx>, IntValue<'ctx>), LlvmError> {
        let (_, len) = self.f.dims.runs();
        let first = self.buffers.run_start(self.e, self.int(run))?;
        let (lo, hi) = mask_queries(self.e, self.f.mask, len, j, first)?;
        let skipped = self.int(run * len);
        Ok((self.add(lo, skipped)?, self.add(hi, skipped)?))
    }

    /// Runs `body` over blocks of `self.block` positions of `[lo, hi)`: the positions, each
    /// clamped into the range (a lane past it is masked by the caller), and the block's first
    /// position; with `carried` values.
    fn blocks(
        &self,
        (lo, hi): (IntValue<'ctx>, IntValue<'ctx>),
        carried: &[V<'ctx>],
        mut body: impl FnMut(&[IntValue<'ctx>], IntValue<'ctx>, &[V<'ctx>]) -> Result<Vec<V<'ctx>>, LlvmError>,
    ) -> Result<Vec<V<'ctx>>, LlvmError> {
        let e = self.e;
        let last = e.b.build_int_sub(hi, self.int(1), "")?;
        let step = self.int(self.block as usize);
        counted_loop(e, self.function, lo, hi, step, carried, |start, carried| {
            let positions: Vec<IntValue<'ctx>> = (0..self.block as usize)
                .map(|c| self.min(self.add(start, self.int(c))?, last))
                .collect::<Result<_, _>>()?;
            body(&positions, start, carried)
        })
    }

    /// `scores` where the block from `start` lies in `[lo, hi)`, -inf elsewhere.
    fn masked(
        &self,
        scores: V<'ctx>,
        start: IntValue<'ctx>,
        (lo, hi): (IntValue<'ctx>, IntValue<'ctx>),
    ) -> Result<V<'ctx>, LlvmError> {
        let e = self.e;
        let i64t = e.ctx.i64_type();
        let steps =
            VectorType::const_vector(&(0..self.block).map(|c| i64t.const_int(c as u64, false)).collect::<Vec<_>>());
        let at = e.b.build_int_add(e.splat(start.into(), self.block)?, steps, "")?;
        let above = e.icmp(IntPredicate::SGE, at, e.splat(lo.into(), self.block)?)?;
        let below = e.icmp(IntPredicate::SLT, at, e.splat(hi.into(), self.block)?)?;
        let valid = e.b.build_and(above, below, "")?;
        e.select(valid, scores, e.f32(self.block, f32::NEG_INFINITY))
    }

    /// The rows of unit `unit` of a pass over `len`-long rows of `rows_per_unit` each: the
    /// batch index they share and their positions.
    fn unit_rows(&self, unit: IntValue<'ctx>, len: usize) -> Result<(IntValue<'ctx>, Vec<IntValue<'ctx>>), LlvmError> {
        let per_unit = self.f.unit_rows;
        let first = self.mul(unit, per_unit)?;
        let batch = self.e.b.build_int_unsigned_div(first, self.int(len), "")?;
        let at = self.e.b.build_int_unsigned_rem(first, self.int(len), "")?;
        let positions = (0..per_unit).map(|r| self.add(at, self.int(r))).collect::<Result<_, _>>()?;
        Ok((batch, positions))
    }

    fn kv_row(&self, kb: IntValue<'ctx>, j: IntValue<'ctx>) -> Result<IntValue<'ctx>, LlvmError> {
        self.add(self.mul(kb, self.f.dims.kv_len)?, j)
    }

    fn query(&self, b: IntValue<'ctx>, i: IntValue<'ctx>) -> Result<IntValue<'ctx>, LlvmError> {
        self.add(self.mul(b, self.f.dims.q_len)?, i)
    }

    /// `[lo, hi)` of the first range and the last: the union of ranges that move forward.
    fn union(ranges: &[(IntValue<'ctx>, IntValue<'ctx>)]) -> (IntValue<'ctx>, IntValue<'ctx>) {
        (ranges[0].0, ranges[ranges.len() - 1].1)
    }

    /// `out` and `lse` of a unit of queries: an online softmax over blocks of keys, each key's
    /// vectors loaded once for the unit's queries.
    fn forward_rows(&self, unit: IntValue<'ctx>) -> Result<(), LlvmError> {
        let (e, dims, dtype) = (self.e, &self.f.dims, self.f.dtype);
        let (b, queries) = self.unit_rows(unit, dims.q_len)?;
        let kb = self.table(b)?;
        let rows: Vec<IntValue<'ctx>> = queries.iter().map(|&i| self.query(b, i)).collect::<Result<_, _>>()?;
        let qs: Vec<Row<'ctx>> = rows
            .iter()
            .map(|&row| self.load_row(self.buffers.q, dtype, row, dims.head_dim))
            .collect::<Result<_, _>>()?;
        let ranges: Vec<_> = queries.iter().map(|&i| self.keys(i)).collect::<Result<_, _>>()?;
        let values = dims.value_dim / self.w as usize;
        let per_row = 2 + values;
        let mut init = Vec::new();
        for _ in &rows {
            init.extend([e.f32(1, f32::NEG_INFINITY), e.f32(1, 0.0)]);
            init.extend(std::iter::repeat_n(e.f32(self.w, 0.0), values));
        }
        let done = self.blocks(Self::union(&ranges), &init, |keys, start, carried| {
            let ks: Vec<Row<'ctx>> = (keys.iter())
                .map(|&j| self.load_row(self.buffers.k, dtype, self.kv_row(kb, j)?, dims.head_dim))
                .collect::<Result<_, _>>()?;
            let (mut next, mut ps) = (Vec::new(), Vec::new());
            for (r, q) in qs.iter().enumerate() {
                let (max, sum, acc) =
                    (carried[r * per_row], carried[r * per_row + 1], &carried[r * per_row + 2..(r + 1) * per_row]);
                let pairs: Vec<_> = ks.iter().map(|k| (q, k)).collect();
                let scores = self.masked(self.scores(self.dots(&pairs)?, b, &[queries[r]], keys)?, start, ranges[r])?;
                let new_max = e.fmax(max, self.tree(scores, |a, b| e.fmax(a, b))?)?;
                // A row that has seen only masked keys subtracts 0, not -inf (its exponentials
                // are 0).
                let none = e.fcmp(FloatPredicate::OEQ, new_max, e.f32(1, f32::NEG_INFINITY))?;
                let base = e.select(none, e.f32(1, 0.0), new_max)?;
                let correction = math::exp(e, e.fsub(max, base)?)?;
                let p = math::exp(e, e.fsub(scores, e.broadcast(base, self.block)?)?)?;
                next.extend([new_max, e.fma(sum, correction, self.sum(p)?)?]);
                next.extend(self.scaled(acc, correction)?);
                ps.push(p);
            }
            let ps: Vec<V<'ctx>> = ps.into_iter().map(|p| self.operand(p)).collect::<Result<_, _>>()?;
            for (c, &j) in keys.iter().enumerate() {
                let v = self.load_row(self.buffers.v, dtype, self.kv_row(kb, j)?, dims.value_dim)?;
                for (r, p) in ps.iter().enumerate() {
                    let acc = self.axpy(&next[r * per_row + 2..(r + 1) * per_row], self.lane(*p, c)?, &v)?;
                    next.splice(r * per_row + 2..(r + 1) * per_row, acc);
                }
            }
            Ok(next)
        })?;
        for (r, &row) in rows.iter().enumerate() {
            let (max, sum) = (done[r * per_row], done[r * per_row + 1]);
            // A row that sees no key (a ring's query before its block of keys) stores 0.
            let empty = e.fcmp(FloatPredicate::OEQ, sum, e.f32(1, 0.0))?;
            let inverse = e.select(empty, e.f32(1, 0.0), e.fdiv(e.f32(1, 1.0), sum)?)?;
            let out = self.scaled(&done[r * per_row + 2..(r + 1) * per_row], inverse)?;
            self.store_row(self.buffers.out, row, dims.value_dim, &out)?;
            self.store(self.buffers.lse, DType::F32, row, e.fadd(max, math::log(e, sum)?)?)?;
        }
        Ok(())
    }

    /// The rows of a tensor-core pass's tile (a unit), one at a time (x86: the emulated GPU's
    /// form of [`crate::attention_tiles`]).
    fn tile(&self, unit: IntValue<'ctx>) -> Result<(), LlvmError> {
        let (_, len) = self.f.rows();
        let tiles = self.f.tiles_per_head();
        let b = self.e.b.build_int_unsigned_div(unit, self.int(tiles), "")?;
        let first = self.mul(self.e.b.build_int_unsigned_rem(unit, self.int(tiles), "")?, TENSOR_CORE_ROW_TILE)?;
        let end = self.min(self.add(first, self.int(TENSOR_CORE_ROW_TILE))?, self.int(len))?;
        counted_loop(self.e, self.function, first, end, self.int(1), &[], |i, _| {
            self.rows(self.add(self.mul(b, len)?, i)?)?;
            Ok(vec![])
        })?;
        Ok(())
    }

    /// `x` as a tensor core's operand: rounded to the dtype where the pass runs on them.
    fn operand(&self, x: V<'ctx>) -> Result<V<'ctx>, LlvmError> {
        match self.f.tensor_cores {
            true => self.e.widen(self.f.dtype, self.e.narrow(self.f.dtype, x)?),
            false => Ok(x),
        }
    }

    /// `dq` of a unit of queries: `scale * sum_j p_j (dout . v_j - dout . out) k_j`; each
    /// query's `dout . out` kept for the next pass.
    fn query_grad_rows(&self, unit: IntValue<'ctx>) -> Result<(), LlvmError> {
        let (e, dims, dtype) = (self.e, &self.f.dims, self.f.dtype);
        let d_out = self.buffers.d_out.expect("the backward has d_out");
        let (b, queries) = self.unit_rows(unit, dims.q_len)?;
        let kb = self.table(b)?;
        let (mut qs, mut gs, mut deltas, mut lses, mut rows) = (vec![], vec![], vec![], vec![], vec![]);
        for &i in &queries {
            let row = self.query(b, i)?;
            let (q, g) = (
                self.load_row(self.buffers.q, dtype, row, dims.head_dim)?,
                self.load_row(d_out, dtype, row, dims.value_dim)?,
            );
            let delta = self.dot(&g, &self.load_row(self.buffers.out, dtype, row, dims.value_dim)?)?;
            self.store(self.buffers.delta, DType::F32, row, delta)?;
            deltas.push(e.broadcast(delta, self.block)?);
            lses.push(e.broadcast(self.load(self.buffers.lse, DType::F32, row, 1)?, self.block)?);
            qs.push(q);
            gs.push(g);
            rows.push(row);
        }
        let ranges: Vec<_> = queries.iter().map(|&i| self.keys(i)).collect::<Result<_, _>>()?;
        let heads = dims.head_dim / self.w as usize;
        let init = vec![e.f32(self.w, 0.0); heads * rows.len()];
        let dq = self.blocks(Self::union(&ranges), &init, |keys, start, dq| {
            let (mut ks, mut vs) = (Vec::new(), Vec::new());
            for &j in keys {
                let at = self.kv_row(kb, j)?;
                ks.push(self.load_row(self.buffers.k, dtype, at, dims.head_dim)?);
                vs.push(self.load_row(self.buffers.v, dtype, at, dims.value_dim)?);
            }
            let mut dq = dq.to_vec();
            for r in 0..rows.len() {
                let qk: Vec<_> = ks.iter().map(|k| (&qs[r], k)).collect();
                let gv: Vec<_> = vs.iter().map(|v| (&gs[r], v)).collect();
                let scores = self.masked(self.scores(self.dots(&qk)?, b, &[queries[r]], keys)?, start, ranges[r])?;
                let p = math::exp(e, e.fsub(scores, lses[r])?)?;
                let ds = self.operand(e.fmul(p, e.fsub(self.dots(&gv)?, deltas[r])?)?)?;
                let mut acc = dq[r * heads..(r + 1) * heads].to_vec();
                for (c, k) in ks.iter().enumerate() {
                    acc = self.axpy(&acc, self.lane(ds, c)?, k)?;
                }
                dq.splice(r * heads..(r + 1) * heads, acc);
            }
            Ok(dq)
        })?;
        let dq_out = self.buffers.grads[0].expect("the backward has dq");
        for (r, &row) in rows.iter().enumerate() {
            let dq = self.scaled(&dq[r * heads..(r + 1) * heads], e.f32(1, self.f.scale as f32))?;
            self.store_row(dq_out, row, dims.head_dim, &dq)?;
        }
        Ok(())
    }

    /// `dk` and `dv` (or one of them, as the pass says) of a unit of keys, over the queries of
    /// every query head sharing their head: `dv = sum_i p_i dout_i`, `dk = scale * sum_i p_i (dout_i . v - dout_i . out_i) q_i`;
    /// each query's vectors loaded once for the unit's keys.
    fn key_value_grad_rows(&self, unit: IntValue<'ctx>) -> Result<(), LlvmError> {
        let (e, dims, dtype) = (self.e, &self.f.dims, self.f.dtype);
        let (kb, keys) = self.unit_rows(unit, dims.kv_len)?;
        let rows: Vec<IntValue<'ctx>> = keys.iter().map(|&j| self.kv_row(kb, j)).collect::<Result<_, _>>()?;
        let ks: Vec<Row<'ctx>> = rows
            .iter()
            .map(|&row| self.load_row(self.buffers.k, dtype, row, dims.head_dim))
            .collect::<Result<_, _>>()?;
        let vs: Vec<Row<'ctx>> = rows
            .iter()
            .map(|&row| self.load_row(self.buffers.v, dtype, row, dims.value_dim))
            .collect::<Result<_, _>>()?;
        let (with_dk, with_dv) = match self.f.pass {
            AttentionPass::KeyGrad => (true, false),
            AttentionPass::ValueGrad => (false, true),
            _ => (true, true),
        };
        let heads = if with_dk { dims.head_dim / self.w as usize } else { 0 };
        let values = if with_dv { dims.value_dim / self.w as usize } else { 0 };
        let per_key = heads + values;
        let group = self.f.group();
        let sharing = self.add(self.int(2 * dims.batch()), self.mul(kb, group)?)?;
        let init = vec![e.f32(self.w, 0.0); per_key * rows.len()];
        let done = counted_loop(e, self.function, self.int(0), self.int(group), self.int(1), &init, |g, carried| {
            let b = self.table(self.add(sharing, g)?)?;
            let mut carried = carried.to_vec();
            for run in 0..dims.runs().0 {
                let ranges: Vec<_> = keys.iter().map(|&j| self.queries(j, run)).collect::<Result<_, _>>()?;
                carried = self.key_value_blocks(b, &keys, &ks, &vs, &ranges, (heads, values), &carried)?;
            }
            Ok(carried)
        })?;
        let [_, dk_out, dv_out] = self.buffers.grads.map(|g| g.expect("the backward has its gradients"));
        for (r, &row) in rows.iter().enumerate() {
            if with_dk {
                let dk = self.scaled(&done[r * per_key..r * per_key + heads], e.f32(1, self.f.scale as f32))?;
                self.store_row(dk_out, row, dims.head_dim, &dk)?;
            }
            if with_dv {
                self.store_row(dv_out, row, dims.value_dim, &done[r * per_key + heads..(r + 1) * per_key])?;
            }
        }
        Ok(())
    }

    /// [`Self::key_value_grad_rows`]' sums for a unit of keys (`ks`, `vs`) over the blocks of
    /// queries in `ranges` (one run's) of query head `b`: `dk` (`heads` vectors a key, none
    /// without) and `dv` (`values`), added to `carried`.
    #[allow(clippy::too_many_arguments)]
    fn key_value_blocks(
        &self,
        b: IntValue<'ctx>,
        keys: &[IntValue<'ctx>],
        ks: &[Row<'ctx>],
        vs: &[Row<'ctx>],
        ranges: &[(IntValue<'ctx>, IntValue<'ctx>)],
        (heads, values): (usize, usize),
        carried: &[V<'ctx>],
    ) -> Result<Vec<V<'ctx>>, LlvmError> {
        let (e, dims, dtype) = (self.e, &self.f.dims, self.f.dtype);
        let d_out = self.buffers.d_out.expect("the backward has d_out");
        let (with_dk, with_dv) = (heads > 0, values > 0);
        let per_key = heads + values;
        self.blocks(Self::union(ranges), carried, |positions, start, carried| {
            let (mut query_rows, mut qs, mut gs) = (Vec::new(), Vec::new(), Vec::new());
            for &i in positions {
                let query = self.query(b, i)?;
                qs.push(self.load_row(self.buffers.q, dtype, query, dims.head_dim)?);
                gs.push(self.load_row(d_out, dtype, query, dims.value_dim)?);
                query_rows.push(query);
            }
            let lse = self.lanes_of(self.buffers.lse, &query_rows)?;
            let delta = self.lanes_of(self.buffers.delta, &query_rows)?;
            let mut next = carried.to_vec();
            for r in 0..keys.len() {
                let qk: Vec<_> = qs.iter().map(|q| (q, &ks[r])).collect();
                let gv: Vec<_> = gs.iter().map(|g| (g, &vs[r])).collect();
                let scores = self.masked(self.scores(self.dots(&qk)?, b, positions, &[keys[r]])?, start, ranges[r])?;
                let p = math::exp(e, e.fsub(scores, lse)?)?;
                let (mut dk, mut dv) = (
                    next[r * per_key..r * per_key + heads].to_vec(),
                    next[r * per_key + heads..(r + 1) * per_key].to_vec(),
                );
                if with_dk {
                    let ds = self.operand(e.fmul(p, e.fsub(self.dots(&gv)?, delta)?)?)?;
                    for (c, q) in qs.iter().enumerate() {
                        dk = self.axpy(&dk, self.lane(ds, c)?, q)?;
                    }
                }
                let p = self.operand(p)?;
                for (c, g) in gs.iter().enumerate().filter(|_| with_dv) {
                    dv = self.axpy(&dv, self.lane(p, c)?, g)?;
                }
                next.splice(r * per_key..(r + 1) * per_key, [dk, dv].concat());
            }
            Ok(next)
        })
    }
}

#[cfg(test)]
mod tests;
