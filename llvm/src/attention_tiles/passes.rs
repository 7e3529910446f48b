//! The passes a tile of rows runs: the forward's online softmax, `dq`, and `dk`/`dv` (together
//! or one of them), each over the column tiles its rows see ([`Tiles::column_tiles`]).

use autotp_kernels::attention::AttentionPass;
use inkwell::values::PointerValue;
use inkwell::FloatPredicate;

use super::{Columns, Rows, Tiles};
use crate::emit::{counted_loop, V};
use crate::{math, LlvmError};

impl<'ctx> Tiles<'_, '_, 'ctx> {
    /// `out` and `lse` of a tile of queries: an online softmax over tiles of keys.
    pub(super) fn forward(&self, rows: &Rows<'ctx>) -> Result<(), LlvmError> {
        let (e, dims) = (self.e, &self.f.dims);
        let q = self.fragments(self.ops.q, rows)?;
        let kv_head_start = self.mul(self.table(rows.head)?, dims.kv_len)?;
        let mut init = vec![e.f32(2, f32::NEG_INFINITY), e.f32(2, 0.0)];
        init.extend(std::iter::repeat_n(e.f32(4, 0.0), dims.value_dim / 8));
        let sources = [self.ops.k, self.ops.v];
        let range = self.column_range(rows)?;
        let done = self.column_tiles(
            range,
            sources,
            kv_head_start,
            dims.kv_len,
            &init,
            |start, [k_tile, v_tile], carried| {
                let columns = Columns { start, query_head: rows.head };
                let scores: Vec<V<'ctx>> = (self.products(&q, k_tile)?.into_iter().enumerate())
                    .map(|(group, acc)| self.scores(acc, rows, &columns, group))
                    .collect::<Result<_, _>>()?;
                let (max, sum) = (carried[0], carried[1]);
                let tile_max = self.row_fold(&scores, |x, y| e.fmax(x, y))?;
                let new_max = e.fmax(max, self.quad_fold(tile_max, |x, y| e.fmax(x, y))?)?;
                // A row that has seen only masked keys subtracts 0, not -inf (its exponentials are 0).
                let none = e.fcmp(FloatPredicate::OEQ, new_max, e.f32(2, f32::NEG_INFINITY))?;
                let base = e.select(none, e.f32(2, 0.0), new_max)?;
                let correction = self.exp(e.fsub(max, base)?)?;
                let base = self.shuffle(base, base, &[0, 0, 1, 1])?;
                let ps: Vec<V<'ctx>> = scores.iter().map(|&s| self.exp(e.fsub(s, base)?)).collect::<Result<_, _>>()?;
                let mut next = vec![new_max, e.fma(sum, correction, self.row_fold(&ps, |x, y| e.fadd(x, y))?)?];
                let correction = self.shuffle(correction, correction, &[0, 0, 1, 1])?;
                let mut outputs: Vec<V<'ctx>> =
                    carried[2..].iter().map(|&o| e.fmul(o, correction)).collect::<Result<_, _>>()?;
                self.accumulate(&ps, v_tile, &mut outputs)?;
                next.extend(outputs);
                Ok(next)
            },
        )?;
        let sum = self.quad_fold(done[1], |x, y| e.fadd(x, y))?;
        // A row that sees no key (a ring's query before its block of keys) stores 0.
        let empty = e.fcmp(FloatPredicate::OEQ, sum, e.f32(2, 0.0))?;
        let inverse = e.select(empty, e.f32(2, 0.0), e.fdiv(e.f32(2, 1.0), sum)?)?;
        let lse = e.fadd(done[0], math::log(e, sum)?)?;
        let scale = [e.broadcast(inverse, 2)?, self.shuffle(inverse, inverse, &[1, 1])?];
        self.store_rows(self.ops.out, rows, &done[2..], scale, |r, row| self.store_per_row(self.ops.lse, r, row, lse))
    }

    /// The lanes of the groups' fragments folded per row: `<2 x f32>`, row a's then row b's
    /// (the thread's own columns only).
    pub(super) fn row_fold(
        &self,
        groups: &[V<'ctx>],
        fold: impl Fn(V<'ctx>, V<'ctx>) -> Result<V<'ctx>, LlvmError>,
    ) -> Result<V<'ctx>, LlvmError> {
        let mut x = groups[0];
        for &g in &groups[1..] {
            x = fold(x, g)?;
        }
        fold(self.shuffle(x, x, &[0, 2])?, self.shuffle(x, x, &[1, 3])?)
    }

    /// `dq` of a tile of queries: `scale sum_j p_j (dout . v_j - dout . out) k_j`; each row's
    /// `dout . out` stored for the `dk` pass.
    pub(super) fn query_grad(&self, rows: &Rows<'ctx>) -> Result<(), LlvmError> {
        let (e, dims) = (self.e, &self.f.dims);
        let d_out = self.ops.d_out.expect("the backward has d_out");
        let q = self.fragments(self.ops.q, rows)?;
        let g = self.fragments(d_out, rows)?;
        let delta = self.quad_fold(self.row_dot(d_out, self.ops.out, rows)?, |x, y| e.fadd(x, y))?;
        let mut lse = e.f32_type(2).get_undef();
        for r in 0..2 {
            let at = self.add(rows.head_start, rows.clamped[r])?;
            let x = e.b.build_load(e.ctx.f32_type(), self.element(e.ctx.f32_type(), self.ops.lse, at)?, "")?;
            lse = e.b.build_insert_element(lse, x, e.ctx.i32_type().const_int(r as u64, false), "")?;
        }
        let lse = self.shuffle(lse, lse, &[0, 0, 1, 1])?;
        let delta4 = self.shuffle(delta, delta, &[0, 0, 1, 1])?;
        let kv_head_start = self.mul(self.table(rows.head)?, dims.kv_len)?;
        let init = vec![e.f32(4, 0.0); dims.head_dim / 8];
        let (range, sources) = (self.column_range(rows)?, [self.ops.k, self.ops.v]);
        let dq =
            self.column_tiles(range, sources, kv_head_start, dims.kv_len, &init, |start, [k_tile, v_tile], dq| {
                let columns = Columns { start, query_head: rows.head };
                let (scores, dps) = (self.products(&q, k_tile)?, self.products(&g, v_tile)?);
                let mut ds = Vec::new();
                for (group, (acc, dp)) in scores.into_iter().zip(dps).enumerate() {
                    let p = self.exp(e.fsub(self.scores(acc, rows, &columns, group)?, lse)?)?;
                    ds.push(e.fmul(p, e.fsub(dp, delta4)?)?);
                }
                let mut dq = dq.to_vec();
                self.accumulate(&ds, k_tile, &mut dq)?;
                Ok(dq)
            })?;
        let scale = e.f32(2, self.f.scale as f32);
        let dq_out = self.ops.grads[0].expect("the backward has dq");
        self.store_rows(dq_out, rows, &dq, [scale, scale], |r, row| self.store_per_row(self.ops.delta, r, row, delta))
    }

    /// `a . b` of the thread's rows over its own elements of them (`<2 x f32>`; summed over the
    /// quad, the rows' whole dot products).
    pub(super) fn row_dot(
        &self,
        a: PointerValue<'ctx>,
        b: PointerValue<'ctx>,
        rows: &Rows<'ctx>,
    ) -> Result<V<'ctx>, LlvmError> {
        let e = self.e;
        let memory = e.memory_type(self.f.dtype, 2);
        let column = self.mul(self.pair, 2)?;
        let mut sums = Vec::new();
        for r in 0..2 {
            let start = self.add(self.row_start(rows, r)?, column)?;
            let mut acc = e.f32(2, 0.0);
            for offset in (0..self.f.dims.head_dim).step_by(8) {
                let at = self.add_const(start, offset)?;
                let load = |base: PointerValue<'ctx>| -> Result<V<'ctx>, LlvmError> {
                    let raw = e.b.build_load(memory, self.element(memory.get_element_type(), base, at)?, "")?;
                    if let Some(instruction) = inkwell::values::BasicValue::as_instruction_value(&raw) {
                        let _ = instruction.set_alignment(4);
                    }
                    e.widen(self.f.dtype, raw.into_vector_value())
                };
                acc = e.fma(load(a)?, load(b)?, acc)?;
            }
            sums.push(acc);
        }
        let both = self.shuffle(sums[0], sums[1], &[0, 2])?;
        e.fadd(both, self.shuffle(sums[0], sums[1], &[1, 3])?)
    }

    /// `dk` and `dv` (or one of them, as the pass says) of a tile of keys, over the queries of
    /// every query head sharing their head: `dv = sum_i p_i dout_i`,
    /// `dk = scale sum_i p_i (dout_i . v - dout_i . out_i) q_i`.
    pub(super) fn key_value_grad(&self, rows: &Rows<'ctx>) -> Result<(), LlvmError> {
        let (e, dims) = (self.e, &self.f.dims);
        let d_out = self.ops.d_out.expect("the backward has d_out");
        let (with_dk, with_dv) = match self.f.pass {
            AttentionPass::KeyGrad => (true, false),
            AttentionPass::ValueGrad => (false, true),
            _ => (true, true),
        };
        let k = self.fragments(self.ops.k, rows)?;
        let v = if with_dk { self.fragments(self.ops.v, rows)? } else { Vec::new() };
        let groups = dims.head_dim / 8;
        let dk_len = if with_dk { groups } else { 0 };
        let init = vec![e.f32(4, 0.0); dk_len + if with_dv { groups } else { 0 }];
        let sharing = self.add(self.int(2 * dims.batch()), self.mul(rows.head, self.f.group())?)?;
        let (range, sources) = (self.column_range(rows)?, [self.ops.q, d_out]);
        let done =
            counted_loop(e, self.function, self.int(0), self.int(self.f.group()), self.int(1), &init, |g, carried| {
                let query_head = self.table(self.add(sharing, g)?)?;
                let head_start = self.mul(query_head, dims.q_len)?;
                self.column_tiles(
                    range,
                    sources,
                    head_start,
                    dims.q_len,
                    carried,
                    |start, [q_tile, d_out_tile], carried| {
                        let columns = Columns { start, query_head };
                        let mut ps = Vec::new();
                        for (group, acc) in self.products(&k, q_tile)?.into_iter().enumerate() {
                            let lse = self.column_values(self.ops.lse, &columns, group)?;
                            ps.push(self.exp(e.fsub(self.scores(acc, rows, &columns, group)?, lse)?)?);
                        }
                        let (mut dk, mut dv) = (carried[..dk_len].to_vec(), carried[dk_len..].to_vec());
                        if with_dk {
                            let mut ds = Vec::new();
                            for (group, (p, dp)) in ps.iter().zip(self.products(&v, d_out_tile)?).enumerate() {
                                let delta = self.column_values(self.ops.delta, &columns, group)?;
                                ds.push(e.fmul(*p, e.fsub(dp, delta)?)?);
                            }
                            self.accumulate(&ds, q_tile, &mut dk)?;
                        }
                        if with_dv {
                            self.accumulate(&ps, d_out_tile, &mut dv)?;
                        }
                        Ok([dk, dv].concat())
                    },
                )
            })?;
        let [_, dk_out, dv_out] = self.ops.grads.map(|g| g.expect("the backward has its gradients"));
        let (scale, one) = (e.f32(2, self.f.scale as f32), e.f32(2, 1.0));
        if with_dk {
            self.store_rows(dk_out, rows, &done[..dk_len], [scale, scale], |_, _| Ok(()))?;
        }
        if with_dv {
            self.store_rows(dv_out, rows, &done[dk_len..], [one, one], |_, _| Ok(()))?;
        }
        Ok(())
    }
}
