//! Scaled dot-product attention as one kernel, forward and backward, without the scores.
//!
//! `out = softmax(q k^T * scale + bias + mask) v` for every index of the leading dims (batch,
//! heads, ...), with `q [.., Sq, D]`, `k [.., Sk, D]`, `v [.., Sk, Dv]`; the leading dims of `k`
//! and `v` are 1 where they broadcast (one key/value head serving several query heads, as
//! multi-query and grouped-query attention do). The forward also writes each query's
//! log-sum-exp (f32; f64 for f64), from which the backward recomputes every probability
//! instead of reading a stored `Sq x Sk` matrix (FlashAttention-2's algorithm): per query row,
//! `p_j = exp(s_j - lse)`, `dP_j = dout . v_j`, `dS_j = p_j (dP_j - dout . out)`, then
//! `dq = scale sum_j dS_j k_j`, `dk_j = scale sum_i dS_ij q_i`, `dv_j = sum_i p_ij dout_i`.
//! Memory beyond the operands is one row of scores per task: linear in the sequence.
//!
//! The masks compare a query's position with a key's. Queries are at positions `0..Sq` unless
//! the dims say they come in runs ([`AttentionDims::query_runs`]: a context-parallel rank's
//! share of a sequence): then an i64 operand, the last input, holds the position of each run's
//! first query, and the run's queries follow it one by one.
//!
//! These are the builtin kernels, the oracle of generated ones: operands are widened to f64 and
//! scores, sums and products computed in f64. Query rows run in parallel for `out`, `lse` and
//! `dq`; key rows in parallel for `dk` and `dv` (each sums over the query heads that share it),
//! so results never depend on the thread count.

use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use std::borrow::Cow;

use crate::scalar::{narrow, widen};
use crate::shape::rows_per_task;
use crate::{view, view_mut, DType, KernelError};

/// Which keys a query may attend to, beyond an additive bias (positions from 0 in both).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum AttentionMask {
    /// Every key.
    None,
    /// Keys at or before the query: `j <= i`.
    Causal,
    /// The `window` keys ending at the query: `i - window < j <= i` (Mistral's sliding window).
    SlidingWindow { window: usize },
}

impl AttentionMask {
    /// The keys the query at position `i` attends to, of `kv_len` at positions `0..kv_len`. A
    /// query before them all (a ring's block of keys later in the sequence) sees none under a
    /// positional mask.
    pub fn keys(self, i: i64, kv_len: usize) -> std::ops::Range<usize> {
        let kv_len = kv_len as i64;
        let after = i.saturating_add(1);
        let (lo, hi) = match self {
            AttentionMask::None => (0, kv_len),
            AttentionMask::Causal => (0, after),
            AttentionMask::SlidingWindow { window } => (after.saturating_sub(window as i64), after),
        };
        let hi = hi.clamp(0, kv_len);
        lo.clamp(0, hi) as usize..hi as usize
    }

    /// The queries, of `q_len`, that attend to key `j`.
    pub fn queries(self, j: usize, q_len: usize) -> std::ops::Range<usize> {
        self.queries_in_run(j, 0, q_len)
    }

    /// Of `len` queries at positions `first..first + len`, those (counted from the run's first)
    /// that attend to key `j`.
    pub fn queries_in_run(self, j: usize, first: i64, len: usize) -> std::ops::Range<usize> {
        let j = j as i64;
        let (lo, hi) = match self {
            AttentionMask::None => (i64::MIN, i64::MAX),
            AttentionMask::Causal => (j, i64::MAX),
            AttentionMask::SlidingWindow { window } => (j, j.saturating_add(window as i64)),
        };
        let end = first.saturating_add(len as i64);
        let lo = lo.clamp(first, end) - first;
        lo as usize..(hi.clamp(first, end) - first).max(lo) as usize
    }

    /// Whether the mask depends on where the queries are in the sequence.
    pub fn is_positional(self) -> bool {
        self != AttentionMask::None
    }
}

/// The shapes of one attention.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AttentionDims {
    /// The query's leading dims; `out` and `lse` have them too.
    pub lead: Vec<usize>,
    /// The key's and value's leading dims: each 1 (broadcast) or `lead`'s.
    pub kv_lead: Vec<usize>,
    pub q_len: usize,
    pub kv_len: usize,
    /// The query's and key's last dim.
    pub head_dim: usize,
    /// The value's and output's last dim.
    pub value_dim: usize,
    /// The additive bias's shape, broadcasting to `[lead.., q_len, kv_len]` (same rank).
    pub bias: Option<Vec<usize>>,
    /// Where the queries are not at positions `0..q_len`: they come in this many runs of
    /// `q_len / runs` queries at consecutive positions, and the last input (i64) holds each
    /// run's first position.
    #[serde(default)]
    pub query_runs: Option<usize>,
    /// Where the queries and keys come in blocks along the sequence (a context-parallel ring's
    /// pairs of a rank's queries and the keys it holds): this many equal blocks of each, the
    /// queries of a block attending only to the keys of the same block, at positions from 0 in
    /// it (the query runs, which divide among the blocks, say where the queries are). `None`
    /// is one block.
    #[serde(default)]
    pub key_blocks: Option<usize>,
}

impl AttentionDims {
    pub fn batch(&self) -> usize {
        crate::numel(&self.lead)
    }

    /// The query rows: `out`'s and `lse`'s rows.
    pub fn query_rows(&self) -> usize {
        self.batch() * self.q_len
    }

    pub fn kv_batch(&self) -> usize {
        crate::numel(&self.kv_lead)
    }

    /// The element counts of `q`, `k`, `v`, the bias (0 without), `out` and `lse`.
    pub fn numels(&self) -> [usize; 6] {
        let b = self.batch();
        let kb = self.kv_batch();
        let bias = self.bias.as_deref().map_or(0, crate::numel);
        [
            b * self.q_len * self.head_dim,
            kb * self.kv_len * self.head_dim,
            kb * self.kv_len * self.value_dim,
            bias,
            b * self.q_len * self.value_dim,
            b * self.q_len,
        ]
    }

    /// Whether the leading dims and the bias broadcast as they must.
    pub fn is_valid(&self) -> bool {
        let broadcasts = |from: &[usize], to: &[usize]| {
            from.len() == to.len() && from.iter().zip(to).all(|(&f, &t)| f == 1 || f == t)
        };
        let bias_ok = self.bias.as_deref().is_none_or(|bias| {
            let mut full = self.lead.clone();
            full.extend([self.q_len, self.kv_len]);
            broadcasts(bias, &full)
        });
        let blocks = self.blocks();
        let runs_ok = self.query_runs.is_none_or(|runs| runs > 0 && self.q_len.is_multiple_of(runs));
        let blocks_ok = blocks > 0
            && self.q_len.is_multiple_of(blocks)
            && self.kv_len.is_multiple_of(blocks)
            && self.query_runs.unwrap_or(blocks).is_multiple_of(blocks)
            && (blocks == 1 || self.bias.is_none());
        broadcasts(&self.kv_lead, &self.lead)
            && bias_ok
            && runs_ok
            && blocks_ok
            && self.head_dim > 0
            && self.value_dim > 0
    }

    /// The runs of queries at consecutive positions and their length: one run per block
    /// ([`Self::key_blocks`]) from position 0 without [`Self::query_runs`].
    pub fn runs(&self) -> (usize, usize) {
        let runs = self.query_runs.unwrap_or(self.blocks());
        (runs, self.q_len / runs)
    }

    /// The blocks of queries and keys ([`Self::key_blocks`]; 1 without).
    pub fn blocks(&self) -> usize {
        self.key_blocks.unwrap_or(1)
    }

    /// For each leading index of the query, the index of its element in a broadcast of leading
    /// dims `from` (each 1 or `lead`'s), times `block`.
    fn sources(&self, from: &[usize], block: usize) -> Vec<usize> {
        let strides = crate::shape::broadcast_strides(from, &self.lead);
        (0..self.batch())
            .map(|mut flat| {
                let mut at = 0;
                for d in (0..self.lead.len()).rev() {
                    at += (flat % self.lead[d]) * strides[d];
                    flat /= self.lead[d];
                }
                at * block
            })
            .collect()
    }

    /// Per query batch index, its key/value batch index.
    fn kv_of(&self) -> Vec<usize> {
        self.sources(&self.kv_lead, 1)
    }

    /// Per query batch index, the offset of its `[rows, cols]` block of the bias (0 without).
    fn bias_blocks(&self) -> Vec<usize> {
        match self.bias.as_deref() {
            Some([lead @ .., rows, cols]) => self.sources(lead, rows * cols),
            _ => vec![0; self.batch()],
        }
    }
}

/// The type of the log-sum-exp of an attention of `dtype`: f32, or f64 for f64.
pub fn lse_dtype(dtype: DType) -> DType {
    if dtype == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

/// Which part of an attention a generated function computes, and over which rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum AttentionPass {
    /// `out` and `lse`, one query row at a time.
    Forward,
    /// The backward's `dq`, one query row at a time.
    QueryGrad,
    /// The backward's `dk` and `dv`, one key row at a time (over every query head sharing it).
    KeyValueGrad,
    /// `dk` alone, and `dv` alone (a GPU thread's registers hold one key's accumulators).
    KeyGrad,
    ValueGrad,
}

impl AttentionPass {
    /// Whether its rows are keys (else queries).
    pub fn over_keys(self) -> bool {
        matches!(self, AttentionPass::KeyValueGrad | AttentionPass::KeyGrad | AttentionPass::ValueGrad)
    }
}

/// The target generated attention runs on, which decides how its work is cut.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum AttentionTarget {
    /// x86: units of up to 4 rows sharing their loads; `dk` and `dv` in one pass.
    Cpu,
    /// 16-bit operands with head dims tensor cores take: a block of warps per tile of rows
    /// ([`AttentionFunction::tensor_cores`]); otherwise a GPU thread per row, one lane wide, `dk`
    /// and `dv` in passes of their own. (x86 runs these cuts too, for the emulated GPU.)
    Gpu,
}

/// One generated attention function (`autotp-llvm` emits it): its entry runs units
/// `begin..end` of its pass (on x86; on a GPU [`AttentionFunction::threads_per_unit`] threads
/// per unit) over the kernel's buffers (inputs, then outputs) followed by
/// [`AttentionFunction::table`] and a scratch of one f32 per query row.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AttentionFunction {
    pub dtype: DType,
    pub dims: AttentionDims,
    pub scale: f64,
    pub mask: AttentionMask,
    pub pass: AttentionPass,
    /// The rows of one unit of work, which share the vectors they load (a divisor of a head's
    /// rows).
    pub unit_rows: usize,
    /// The target the work is cut for.
    pub target: AttentionTarget,
    /// A GPU pass on tensor cores (see [`AttentionFunction::fits_tensor_cores`]): a unit is a
    /// tile of [`TENSOR_CORE_ROW_TILE`] rows (queries, or keys) of one batch index (the last
    /// tile of a head short where the rows run out), computed by one block of warps, 16 rows
    /// each, with `mma.sync` over [`TENSOR_CORE_COLUMN_TILE`] keys (or queries) at a time; the
    /// probabilities and their gradients multiply the next operand rounded to the dtype, as
    /// tensor cores take them. On x86 (the emulated GPU) a tile's rows run one at a time,
    /// rounded the same way.
    pub tensor_cores: bool,
}

/// The rows of one tensor-core tile: 16 per warp of a 256-thread block.
pub const TENSOR_CORE_ROW_TILE: usize = 128;

/// The keys (or queries) a tensor-core pass holds in shared memory at a time.
pub const TENSOR_CORE_COLUMN_TILE: usize = 64;

/// The largest head dim the tensor-core passes hold in registers.
pub const TENSOR_CORE_MAX_HEAD_DIM: usize = 128;

/// The largest head dim whose `dk` and `dv` one tensor-core pass accumulates together (beyond,
/// a pass each).
pub const TENSOR_CORE_JOINT_KEY_VALUE_GRAD: usize = 64;

impl AttentionFunction {
    /// The functions that compute `kernel` on `target` (the forward, or the backward's passes),
    /// when it is an attention the generated code handles (f32 and 16-bit floats). On x86 a
    /// unit is the largest of 4, 2 and 1 rows that divides a head's rows.
    pub fn of(kernel: &crate::Kernel, target: AttentionTarget) -> Option<Vec<AttentionFunction>> {
        use AttentionPass::*;
        let (dtype, dims, scale, mask, forward) = match kernel {
            crate::Kernel::Attention { dtype, dims, scale, mask, .. } => (dtype, dims, scale, mask, true),
            crate::Kernel::AttentionGrad { dtype, dims, scale, mask, .. } => (dtype, dims, scale, mask, false),
            _ => return None,
        };
        // The tensor cores' tiles take one run of queries; several (a load-balanced
        // context-parallel rank's) run a thread per row.
        let one_run = dims.query_runs.is_none_or(|runs| runs == 1);
        let tensor_cores = target == AttentionTarget::Gpu && Self::fits_tensor_cores(*dtype, dims) && one_run;
        let joint =
            target == AttentionTarget::Cpu || (tensor_cores && dims.head_dim <= TENSOR_CORE_JOINT_KEY_VALUE_GRAD);
        let passes: &[AttentionPass] = match (forward, joint) {
            (true, _) => &[Forward],
            (false, true) => &[QueryGrad, KeyValueGrad],
            (false, false) => &[QueryGrad, KeyGrad, ValueGrad],
        };
        let max_unit_rows = match target {
            AttentionTarget::Cpu => 4,
            AttentionTarget::Gpu => 1,
        };
        // Generated code takes a context-parallel rank's runs of queries, at any positions; a
        // unit of rows lies in one run.
        // A ring's blocks are one per rank: several are the reference's global view.
        if !matches!(dtype, DType::F32 | DType::BF16 | DType::F16) || !dims.is_valid() || dims.blocks() != 1 {
            return None;
        }
        let function = |pass: AttentionPass| {
            let len = if pass.over_keys() { dims.kv_len } else { dims.runs().1 };
            let unit_rows = [4, 2, 1].into_iter().find(|&r| r <= max_unit_rows && len.is_multiple_of(r));
            let unit_rows = unit_rows.expect("1 divides");
            let (dtype, dims, scale, mask) = (*dtype, dims.clone(), *scale, *mask);
            AttentionFunction { dtype, dims, scale, mask, pass, unit_rows, target, tensor_cores }
        };
        Some(passes.iter().map(|&p| function(p)).collect())
    }

    /// Whether a GPU runs an attention of `dtype` and `dims` on tensor cores:
    /// 16-bit operands (`mma.sync` m16n8k16 takes bf16 and f16), equal head dims that are a
    /// multiple of 16 (an `mma`'s depth) up to [`TENSOR_CORE_MAX_HEAD_DIM`].
    pub fn fits_tensor_cores(dtype: DType, dims: &AttentionDims) -> bool {
        matches!(dtype, DType::BF16 | DType::F16)
            && dims.head_dim == dims.value_dim
            && dims.head_dim.is_multiple_of(16)
            && dims.head_dim <= TENSOR_CORE_MAX_HEAD_DIM
    }

    /// The tiles of a head's rows a tensor-core pass runs.
    pub fn tiles_per_head(&self) -> usize {
        self.rows().1.div_ceil(TENSOR_CORE_ROW_TILE)
    }

    /// The rows (queries, or keys) of the pass: batch indices and rows per index.
    pub fn rows(&self) -> (usize, usize) {
        match self.pass.over_keys() {
            false => (self.dims.batch(), self.dims.q_len),
            true => (self.dims.kv_batch(), self.dims.kv_len),
        }
    }

    /// The units the entry runs, `begin..end` of `0..units()`.
    pub fn units(&self) -> usize {
        let (batch, len) = self.rows();
        match self.tensor_cores {
            true => batch * self.tiles_per_head(),
            false => batch * len / self.unit_rows,
        }
    }

    /// The GPU threads one unit takes: a block for a tensor-core tile, else one.
    pub fn threads_per_unit(&self) -> usize {
        match self.tensor_cores {
            true => TENSOR_CORE_ROW_TILE / 16 * 32,
            false => 1,
        }
    }

    /// The query heads that share one key/value head.
    pub fn group(&self) -> usize {
        self.dims.batch() / self.dims.kv_batch()
    }

    /// What the generated code looks up instead of computing broadcast indices: per query
    /// batch index its key/value batch index, then per query batch index the offset of its
    /// bias block (0 without a bias), then per key/value batch index the [`Self::group`] query
    /// batch indices that share it, in order.
    pub fn table(&self) -> Vec<i64> {
        let dims = &self.dims;
        let (kv_of, bias_of) = (dims.kv_of(), dims.bias_blocks());
        let mut sharing = vec![Vec::new(); dims.kv_batch()];
        for (b, &kb) in kv_of.iter().enumerate() {
            sharing[kb].push(b);
        }
        let table = kv_of.iter().chain(&bias_of).chain(sharing.iter().flatten());
        table.map(|&x| x as i64).collect()
    }
}

/// The bias, indexable by (query batch index, query, key).
struct Bias<'a> {
    values: &'a [f64],
    /// Per query batch index: the offset of its `[q_len, kv_len]` block.
    offsets: Vec<usize>,
    row_stride: usize,
    col_stride: usize,
}

impl Bias<'_> {
    fn at(&self, b: usize, i: usize, j: usize) -> f64 {
        self.values[self.offsets[b] + i * self.row_stride + j * self.col_stride]
    }
}

/// The operands of one attention, widened to f64.
struct Operands<'a> {
    dims: &'a AttentionDims,
    scale: f64,
    q: &'a [f64],
    k: &'a [f64],
    v: &'a [f64],
    bias: Option<Bias<'a>>,
    /// Per query batch index, its key/value batch index.
    kv_of: Vec<usize>,
    /// The position of each run's first query ([`AttentionDims::runs`]).
    run_starts: Vec<i64>,
}

impl<'a> Operands<'a> {
    fn new(
        dims: &'a AttentionDims,
        scale: f64,
        [q, k, v]: [&'a [f64]; 3],
        bias: Option<&'a [f64]>,
        run_starts: Vec<i64>,
    ) -> Operands<'a> {
        let bias = bias.zip(dims.bias.as_deref()).map(|(values, shape)| {
            let (rows, cols) = (shape[shape.len() - 2], shape[shape.len() - 1]);
            let offsets = dims.bias_blocks();
            Bias { values, offsets, row_stride: if rows == 1 { 0 } else { cols }, col_stride: usize::from(cols != 1) }
        });
        Operands { dims, scale, q, k, v, bias, kv_of: dims.kv_of(), run_starts }
    }

    /// The position of query `i` in the sequence (in its block's).
    fn position(&self, i: usize) -> i64 {
        let (_, len) = self.dims.runs();
        self.run_starts[i / len].saturating_add((i % len) as i64)
    }

    /// The keys query `i` attends to under `mask`, of its block's.
    fn keys(&self, mask: AttentionMask, i: usize) -> std::ops::Range<usize> {
        let blocks = self.dims.blocks();
        let block_len = self.dims.kv_len / blocks;
        let first = i / (self.dims.q_len / blocks) * block_len;
        let keys = mask.keys(self.position(i), block_len);
        first + keys.start..first + keys.end
    }

    /// The queries that attend to key `j` under `mask`, run by run (of its block's).
    fn queries(&self, mask: AttentionMask, j: usize) -> impl Iterator<Item = usize> + '_ {
        let blocks = self.dims.blocks();
        let (runs, run_len) = self.dims.runs();
        let (block_len, runs_per_block) = (self.dims.kv_len / blocks, runs / blocks);
        let block = j / block_len;
        let block_runs = block * runs_per_block..(block + 1) * runs_per_block;
        block_runs.flat_map(move |r| {
            mask.queries_in_run(j % block_len, self.run_starts[r], run_len).map(move |i| r * run_len + i)
        })
    }

    fn q_row(&self, b: usize, i: usize) -> &[f64] {
        let d = self.dims.head_dim;
        &self.q[(b * self.dims.q_len + i) * d..][..d]
    }

    fn k_row(&self, kb: usize, j: usize) -> &[f64] {
        let d = self.dims.head_dim;
        &self.k[(kb * self.dims.kv_len + j) * d..][..d]
    }

    fn v_row(&self, kb: usize, j: usize) -> &[f64] {
        let d = self.dims.value_dim;
        &self.v[(kb * self.dims.kv_len + j) * d..][..d]
    }

    /// The score of query `i` of batch index `b` for key `j`.
    fn score(&self, b: usize, i: usize, j: usize) -> f64 {
        let s = dot(self.q_row(b, i), self.k_row(self.kv_of[b], j)) * self.scale;
        self.bias.as_ref().map_or(s, |bias| s + bias.at(b, i, j))
    }
}

fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(&x, &y)| x * y).sum()
}

/// Widens a float buffer to f64 (linear in the operands, against the quadratic work).
fn widened<'b>(kernel: &'static str, dtype: DType, bytes: &'b [u8]) -> Result<Cow<'b, [f64]>, KernelError> {
    let wide = |x: &[f32]| x.iter().map(|&x| x as f64).collect();
    match dtype {
        DType::F64 => Ok(view::<f64>(bytes)),
        DType::F32 => Ok(Cow::Owned(wide(&view::<f32>(bytes)))),
        DType::BF16 | DType::F16 => Ok(Cow::Owned(wide(&widen(dtype, bytes)))),
        other => Err(KernelError::Unsupported { kernel, what: format!("{other}") }),
    }
}

/// Writes f64 values into an output of `dtype` (rounded once).
fn store(dtype: DType, values: &[f64], out: &mut [u8]) -> Result<(), KernelError> {
    match dtype {
        DType::F64 => view_mut::<f64>(out)?.copy_from_slice(values),
        DType::F32 => view_mut::<f32>(out)?.iter_mut().zip(values).for_each(|(o, &x)| *o = x as f32),
        _ => narrow(dtype, &values.iter().map(|&x| x as f32).collect::<Vec<_>>(), out)?,
    }
    Ok(())
}

/// The position of each run's first query: the last input, with [`AttentionDims::query_runs`]
/// (else 0 for each block's run).
fn run_starts(kernel: &'static str, dims: &AttentionDims, inputs: &[&[u8]]) -> Result<Vec<i64>, KernelError> {
    let Some(runs) = dims.query_runs else { return Ok(vec![0; dims.blocks()]) };
    let starts = inputs.last().map(|b| view::<i64>(b)).filter(|s| s.len() == runs).ok_or_else(|| {
        KernelError::Unsupported { kernel, what: format!("query positions: {runs} run starts (i64) expected") }
    })?;
    Ok(starts.into_owned())
}

/// `[q, k, v, bias?, run_starts?] -> [out, lse]`.
pub(crate) fn forward(
    dtype: DType,
    dims: &AttentionDims,
    scale: f64,
    mask: AttentionMask,
    inputs: &[&[u8]],
    out: &mut [u8],
    lse: &mut [u8],
) -> Result<(), KernelError> {
    const KERNEL: &str = "attention";
    let [q, k, v] = [0, 1, 2].map(|i| widened(KERNEL, dtype, inputs[i]));
    let (q, k, v) = (q?, k?, v?);
    let bias = dims.bias.as_ref().map(|_| widened(KERNEL, dtype, inputs[3])).transpose()?;
    let ops = Operands::new(dims, scale, [&q, &k, &v], bias.as_deref(), run_starts(KERNEL, dims, inputs)?);
    let (dv, sq, sk) = (dims.value_dim, dims.q_len, dims.kv_len);
    let mut values = vec![0f64; dims.batch() * sq * dv];
    let mut log_sums = vec![0f64; dims.batch() * sq];
    let rows = rows_per_task(sk * dv);
    values.par_chunks_mut(dv).zip(log_sums.par_iter_mut()).with_min_len(rows).enumerate().for_each(
        |(row, (o, lse))| {
            let (b, i) = (row / sq, row % sq);
            let keys = ops.keys(mask, i);
            let scores: Vec<f64> = keys.clone().map(|j| ops.score(b, i, j)).collect();
            let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let log_sum = max + scores.iter().map(|s| (s - max).exp()).sum::<f64>().ln();
            for (j, s) in keys.zip(&scores) {
                let p = (s - log_sum).exp();
                for (a, &x) in o.iter_mut().zip(ops.v_row(ops.kv_of[b], j)) {
                    *a += p * x;
                }
            }
            *lse = log_sum;
        },
    );
    store(dtype, &values, out)?;
    store(lse_dtype(dtype), &log_sums, lse)
}

/// `[q, k, v, bias?, out, lse, d_out, run_starts?] -> [dq, dk, dv]`.
pub(crate) fn backward(
    dtype: DType,
    dims: &AttentionDims,
    scale: f64,
    mask: AttentionMask,
    inputs: &[&[u8]],
    outputs: &mut [&mut [u8]],
) -> Result<(), KernelError> {
    const KERNEL: &str = "attention_grad";
    let with_bias = usize::from(dims.bias.is_some());
    let [q, k, v] = [0, 1, 2].map(|i| widened(KERNEL, dtype, inputs[i]));
    let (q, k, v) = (q?, k?, v?);
    let bias = (with_bias == 1).then(|| widened(KERNEL, dtype, inputs[3])).transpose()?;
    let out = widened(KERNEL, dtype, inputs[3 + with_bias])?;
    let lse = widened(KERNEL, lse_dtype(dtype), inputs[4 + with_bias])?;
    let d_out = widened(KERNEL, dtype, inputs[5 + with_bias])?;
    let ops = Operands::new(dims, scale, [&q, &k, &v], bias.as_deref(), run_starts(KERNEL, dims, inputs)?);
    let (d, dv, sq, sk) = (dims.head_dim, dims.value_dim, dims.q_len, dims.kv_len);
    let d_out_row = |b: usize, i: usize| &d_out[(b * sq + i) * dv..][..dv];
    // dout . out per query row (FlashAttention's D).
    let delta: Vec<f64> = (0..dims.batch() * sq).map(|r| dot(&d_out[r * dv..][..dv], &out[r * dv..][..dv])).collect();
    // p and dS of query i of batch index b for key j.
    let probability_and_ds = |b: usize, i: usize, j: usize| {
        let p = (ops.score(b, i, j) - lse[b * sq + i]).exp();
        let dp = dot(d_out_row(b, i), ops.v_row(ops.kv_of[b], j));
        (p, p * (dp - delta[b * sq + i]))
    };

    let mut dq = vec![0f64; dims.batch() * sq * d];
    dq.par_chunks_mut(d).with_min_len(rows_per_task(sk * d)).enumerate().for_each(|(row, dq)| {
        let (b, i) = (row / sq, row % sq);
        for j in ops.keys(mask, i) {
            let (_, ds) = probability_and_ds(b, i, j);
            for (a, &x) in dq.iter_mut().zip(ops.k_row(ops.kv_of[b], j)) {
                *a += ds * x;
            }
        }
        dq.iter_mut().for_each(|a| *a *= scale);
    });

    // Each key/value batch index's query batch indices, in order.
    let mut sharing = vec![Vec::new(); dims.kv_batch()];
    for (b, &kb) in ops.kv_of.iter().enumerate() {
        sharing[kb].push(b);
    }
    let mut dk = vec![0f64; dims.kv_batch() * sk * d];
    let mut dvs = vec![0f64; dims.kv_batch() * sk * dv];
    let rows = rows_per_task(sq * (d + dv));
    dk.par_chunks_mut(d).zip(dvs.par_chunks_mut(dv)).with_min_len(rows).enumerate().for_each(|(row, (dk, dv))| {
        let (kb, j) = (row / sk, row % sk);
        for &b in &sharing[kb] {
            for i in ops.queries(mask, j) {
                let (p, ds) = probability_and_ds(b, i, j);
                dk.iter_mut().zip(ops.q_row(b, i)).for_each(|(a, &x)| *a += ds * x);
                dv.iter_mut().zip(d_out_row(b, i)).for_each(|(a, &x)| *a += p * x);
            }
        }
        dk.iter_mut().for_each(|a| *a *= scale);
    });
    let [dq_out, dk_out, dv_out, ..] = outputs else { unreachable!("arity checked") };
    store(dtype, &dq, dq_out)?;
    store(dtype, &dk, dk_out)?;
    store(dtype, &dvs, dv_out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Attention as the unfused graph computes it: the whole score matrix, masked with -inf,
    /// softmax, then products; gradients through the same matrices.
    struct Unfused {
        out: Vec<f64>,
        dq: Vec<f64>,
        dk: Vec<f64>,
        dv: Vec<f64>,
    }

    fn unfused(dims: &AttentionDims, scale: f64, mask: AttentionMask, x: &[Vec<f32>; 5], starts: &[i64]) -> Unfused {
        let [q, k, v, bias, d_out] = x.clone().map(|t| t.iter().map(|&x| x as f64).collect::<Vec<f64>>());
        let bias = dims.bias.as_ref().map(|_| &bias[..]);
        let ops = Operands::new(dims, scale, [&q, &k, &v], bias, starts.to_vec());
        let (d, dv, sq, sk) = (dims.head_dim, dims.value_dim, dims.q_len, dims.kv_len);
        let kb_len = dims.kv_batch();
        let mut r = Unfused {
            out: vec![0.0; dims.batch() * sq * dv],
            dq: vec![0.0; dims.batch() * sq * d],
            dk: vec![0.0; kb_len * sk * d],
            dv: vec![0.0; kb_len * sk * dv],
        };
        for b in 0..dims.batch() {
            let kb = ops.kv_of[b];
            for i in 0..sq {
                let keys = ops.keys(mask, i);
                if keys.is_empty() {
                    continue;
                }
                let s: Vec<f64> =
                    (0..sk).map(|j| if keys.contains(&j) { ops.score(b, i, j) } else { f64::NEG_INFINITY }).collect();
                let max = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let total: f64 = s.iter().map(|x| (x - max).exp()).sum();
                let p: Vec<f64> = s.iter().map(|x| (x - max).exp() / total).collect();
                let g = &d_out[(b * sq + i) * dv..][..dv];
                let dp: Vec<f64> = (0..sk).map(|j| dot(g, ops.v_row(kb, j))).collect();
                let pdp: f64 = (0..sk).map(|j| p[j] * dp[j]).sum();
                for j in 0..sk {
                    let ds = p[j] * (dp[j] - pdp) * scale;
                    for (e, (&v, &g)) in ops.v_row(kb, j).iter().zip(g).enumerate() {
                        r.out[(b * sq + i) * dv + e] += p[j] * v;
                        r.dv[(kb * sk + j) * dv + e] += p[j] * g;
                    }
                    for (e, (&k, &q)) in ops.k_row(kb, j).iter().zip(ops.q_row(b, i)).enumerate() {
                        r.dq[(b * sq + i) * d + e] += ds * k;
                        r.dk[(kb * sk + j) * d + e] += ds * q;
                    }
                }
            }
        }
        r
    }

    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut state = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (0..n)
            .map(|_| {
                state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    fn bytes(x: &[f32]) -> Vec<u8> {
        bytemuck::cast_slice(x).to_vec()
    }

    fn floats(x: &[u8]) -> Vec<f32> {
        bytemuck::pod_collect_to_vec(x)
    }

    fn assert_close(name: &str, got: &[f32], want: &[f64]) {
        assert_eq!(got.len(), want.len(), "{name}");
        for (n, (&g, &w)) in got.iter().zip(want).enumerate() {
            assert!((g as f64 - w).abs() <= 1e-5 * w.abs().max(1.0), "{name}[{n}]: {g} against {w}");
        }
    }

    fn check(dims: AttentionDims, mask: AttentionMask) {
        check_at(dims, mask, &[0]);
    }

    /// Runs the forward and backward kernels (f32) on `x` (q, k, v, d_out) with the queries in
    /// runs from `starts`: out, lse, dq, dk, dv.
    fn run_both(dims: &AttentionDims, mask: AttentionMask, x: [&[f32]; 4], starts: &[i64]) -> [Vec<f32>; 5] {
        let scale = 0.3;
        let positions: Vec<u8> = starts.iter().flat_map(|s| s.to_le_bytes()).collect();
        let [q, k, v, d_out] = x.map(bytes);
        let [_, _, _, _, out, rows] = dims.numels();
        let (mut o, mut lse) = (vec![0u8; out * 4], vec![0u8; rows * 4]);
        let fwd = Kernel::Attention { dtype: DType::F32, dims: dims.clone(), scale, mask, generated: false };
        fwd.run(&[&q, &k, &v, &positions], &mut [&mut o, &mut lse]).unwrap();
        let bwd = Kernel::AttentionGrad { dtype: DType::F32, dims: dims.clone(), scale, mask, generated: false };
        let (mut dq, mut dk, mut dv) = (vec![0u8; q.len()], vec![0u8; k.len()], vec![0u8; v.len()]);
        bwd.run(&[&q, &k, &v, &o, &lse, &d_out, &positions], &mut [&mut dq, &mut dk, &mut dv]).unwrap();
        [o, lse, dq, dk, dv].map(|b| floats(&b))
    }

    /// Rows `block` of `blocks` of each `[rows, width]` matrix of `x`.
    fn block_of(x: &[f32], matrices: usize, rows: usize, width: usize, blocks: usize, block: usize) -> Vec<f32> {
        let per = rows / blocks;
        (0..matrices).flat_map(|m| x[(m * rows + block * per) * width..][..per * width].to_vec()).collect()
    }

    /// A ring's blocks: each block of queries against its own block of keys is the attention of
    /// those alone, and a query before all of its block's keys (a negative position) sees none:
    /// its output, log-sum-exp and gradients are 0, -inf and 0.
    #[test]
    fn blocks_pair_queries_with_their_own_keys() {
        let (batch, q_len, kv_len, blocks) = (2, 8, 6, 2);
        let starts = [-2, 1, 4, -5];
        for mask in [AttentionMask::None, AttentionMask::Causal, AttentionMask::SlidingWindow { window: 2 }] {
            let whole = AttentionDims {
                query_runs: Some(4),
                key_blocks: Some(blocks),
                ..dims(&[batch], &[batch], q_len, kv_len, None)
            };
            let [q, k, v, _, out, _] = whole.numels();
            let x = [values(q, 1), values(k, 2), values(v, 3), values(out, 5)];
            let got = run_both(&whole, mask, [&x[0], &x[1], &x[2], &x[3]], &starts);
            let one = AttentionDims { query_runs: Some(2), ..dims(&[batch], &[batch], q_len / 2, kv_len / 2, None) };
            let widths = [5, 5, 3, 3];
            let lens = [q_len, kv_len, kv_len, q_len];
            for b in 0..blocks {
                let part: Vec<Vec<f32>> =
                    (0..4).map(|t| block_of(&x[t], batch, lens[t], widths[t], blocks, b)).collect();
                let want = run_both(&one, mask, [&part[0], &part[1], &part[2], &part[3]], &starts[2 * b..2 * b + 2]);
                // out, lse, dq by query rows; dk, dv by key rows.
                let shapes = [(q_len, 3), (q_len, 1), (q_len, 5), (kv_len, 5), (kv_len, 3)];
                for (t, &(rows, width)) in shapes.iter().enumerate() {
                    let got = block_of(&got[t], batch, rows, width, blocks, b);
                    for (n, (g, w)) in got.iter().zip(&want[t]).enumerate() {
                        let same = g == w || (g - w).abs() <= 1e-6 * w.abs().max(1.0);
                        assert!(same, "{mask:?} output {t} block {b} [{n}]: {g} against {w}");
                    }
                }
            }
            // Query 0 (position -2) sees no key under a positional mask.
            if mask.is_positional() {
                assert_eq!((got[0][0], got[1][0], got[2][0]), (0.0, f32::NEG_INFINITY, 0.0), "{mask:?}");
            }
        }
    }

    /// [`check`] with the queries in runs starting at `starts` (one run at 0: the sequence's
    /// first queries, without a positions operand).
    fn check_at(dims: AttentionDims, mask: AttentionMask, starts: &[i64]) {
        let scale = 0.3;
        let [q, k, v, bias, out, _] = dims.numels();
        let x = [values(q, 1), values(k, 2), values(v, 3), values(bias, 4), values(out, 5)];
        let want = unfused(&dims, scale, mask, &x, starts);
        let fwd = Kernel::Attention { dtype: DType::F32, dims: dims.clone(), scale, mask, generated: false };
        let mut inputs = vec![bytes(&x[0]), bytes(&x[1]), bytes(&x[2])];
        if dims.bias.is_some() {
            inputs.push(bytes(&x[3]));
        }
        let positions: Vec<u8> = starts.iter().flat_map(|&s| s.to_le_bytes()).collect();
        if dims.query_runs.is_some() {
            inputs.push(positions.clone());
        }
        let (mut o, mut lse) = (vec![0u8; out * 4], vec![0u8; dims.batch() * dims.q_len * 4]);
        let refs: Vec<&[u8]> = inputs.iter().map(|b| &b[..]).collect();
        fwd.check_buffers(&refs.iter().map(|b| b.len()).collect::<Vec<_>>(), &[o.len(), lse.len()]).unwrap();
        fwd.run(&refs, &mut [&mut o, &mut lse]).unwrap();
        assert_close("out", &floats(&o), &want.out);

        let bwd = Kernel::AttentionGrad { dtype: DType::F32, dims: dims.clone(), scale, mask, generated: false };
        if dims.query_runs.is_some() {
            inputs.pop();
        }
        inputs.extend([o.clone(), lse.clone(), bytes(&x[4])]);
        if dims.query_runs.is_some() {
            inputs.push(positions);
        }
        let refs: Vec<&[u8]> = inputs.iter().map(|b| &b[..]).collect();
        let (mut dq, mut dk, mut dv) = (vec![0u8; q * 4], vec![0u8; k * 4], vec![0u8; v * 4]);
        bwd.check_buffers(&refs.iter().map(|b| b.len()).collect::<Vec<_>>(), &[dq.len(), dk.len(), dv.len()]).unwrap();
        bwd.run(&refs, &mut [&mut dq, &mut dk, &mut dv]).unwrap();
        assert_close("dq", &floats(&dq), &want.dq);
        assert_close("dk", &floats(&dk), &want.dk);
        assert_close("dv", &floats(&dv), &want.dv);
    }

    fn dims(lead: &[usize], kv_lead: &[usize], q_len: usize, kv_len: usize, bias: Option<Vec<usize>>) -> AttentionDims {
        let (lead, kv_lead) = (lead.to_vec(), kv_lead.to_vec());
        AttentionDims {
            lead,
            kv_lead,
            q_len,
            kv_len,
            head_dim: 5,
            value_dim: 3,
            bias,
            query_runs: None,
            key_blocks: None,
        }
    }

    use crate::Kernel;

    #[test]
    fn matches_the_unfused_computation_for_every_mask() {
        for mask in [AttentionMask::None, AttentionMask::Causal, AttentionMask::SlidingWindow { window: 3 }] {
            check(dims(&[2, 3], &[2, 3], 7, 7, None), mask);
        }
        check(dims(&[2], &[2], 4, 6, None), AttentionMask::None);
    }

    #[test]
    fn shared_key_value_heads_and_a_broadcast_bias() {
        // Multi-query (one key/value head for three query heads) and grouped broadcast over
        // the batch; an ALiBi-like bias per head, and a padding mask per batch entry.
        check(dims(&[2, 3], &[2, 1], 6, 6, Some(vec![1, 3, 6, 6])), AttentionMask::Causal);
        check(dims(&[2, 3], &[1, 3], 5, 5, Some(vec![2, 1, 1, 5])), AttentionMask::None);
    }

    /// A context-parallel rank's queries: one run in the middle of the sequence, or two runs
    /// (a chunk from each half), over every key.
    #[test]
    fn queries_in_runs_are_masked_at_their_positions() {
        for mask in [AttentionMask::None, AttentionMask::Causal, AttentionMask::SlidingWindow { window: 3 }] {
            let one = AttentionDims { query_runs: Some(1), ..dims(&[2, 3], &[2, 1], 4, 12, None) };
            check_at(one, mask, &[5]);
            let two = AttentionDims { query_runs: Some(2), ..dims(&[2, 3], &[2, 3], 4, 12, Some(vec![1, 3, 4, 12])) };
            check_at(two, mask, &[2, 9]);
        }
    }

    #[test]
    fn masks_list_the_same_pairs_both_ways() {
        for mask in [AttentionMask::None, AttentionMask::Causal, AttentionMask::SlidingWindow { window: 2 }] {
            for (sq, sk) in [(5, 5), (3, 6), (6, 3)] {
                for i in 0..sq {
                    for j in 0..sk {
                        let at = i as i64;
                        assert_eq!(
                            mask.keys(at, sk).contains(&j),
                            mask.queries(j, sq).contains(&i),
                            "{mask:?} {i} {j}"
                        );
                        for first in [4, -3] {
                            let run = mask.queries_in_run(j, first, sq);
                            assert_eq!(mask.keys(first + at, sk).contains(&j), run.contains(&i), "{mask:?} {i} {j}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn refuses_shapes_that_do_not_broadcast() {
        let bad = dims(&[2, 3], &[2, 2], 4, 4, None);
        let kernel = Kernel::Attention {
            dtype: DType::F32,
            dims: bad.clone(),
            scale: 1.0,
            mask: AttentionMask::None,
            generated: false,
        };
        let [q, k, v, _, out, lse] = bad.numels().map(|n| n * 4);
        assert!(kernel.check_buffers(&[q, k, v], &[out, lse]).is_err());
    }
}
