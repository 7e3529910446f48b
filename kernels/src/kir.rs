//! The kernel IR: what a generated kernel computes, independent of the target it runs on.
//!
//! A kernel is one loop nest over an outer, parallel dimension and an inner, vectorised one:
//!
//! ```text
//! for o in begin..end:                       (threads on CPU, blocks on CUDA)
//!     for stage in stages:
//!         Reduce: acc_k = fold over i in 0..inner of value(o, i)
//!         Map:    for i in 0..inner: store values(o, i)
//!         Row:    store values(o)            (once per o)
//! ```
//!
//! The stages of one `o` run in order, so a row reduction is followed by the elementwise work
//! that uses it without the row leaving the cache (Inductor's outer-loop fusion): softmax is a
//! max reduce, a sum reduce of `exp(x - max)` and a map that divides. Every `o` is independent,
//! which is what makes the outer dimension parallel and every row's result independent of how
//! rows are split among threads (so runs are deterministic at any thread count).
//!
//! Values are scalars of three types ([`ScalarType`]): `f32` (every float buffer is computed in
//! f32; bf16 and f16 buffers load widened and store rounded to nearest even, and
//! [`Expr::Round`] rounds an intermediate value whose op has a 16-bit result), `i64` (indices, labels) and `bool`. A stage's expressions form a list in which each
//! refers to earlier ones by position ([`ExprRef`]), so a shared subexpression is computed once.
//! Memory is addressed by [`Index`]: a base plus terms `((((var / div) % modulo) + offset) %
//! wrap) * stride` over the two loop variables, which express contiguous rows, broadcasting,
//! transposed and sliced reads and padding (a wrapped coordinate, read only where a
//! [`Expr::Coord`] comparison says it is inside) without any data-dependent address, so
//! [`Kernel::check`] proves every access in bounds before a kernel runs. The one
//! data-dependent read, [`Expr::Pick`] (a row's element chosen by a value, as cross-entropy
//! reads its label's score), clamps its value into a range the check bounds too.
//!
//! A stage reads inputs, and also an output that an earlier `Map` stage stored at the very same
//! index ([`Stage::reads_outputs`]: each element of it read where it was written, as softmax
//! keeps its exponentials in its output to scale them afterwards rather than compute them
//! twice); a GPU's block synchronises before such a stage.
//!
//! The targets (x86 through the LLVM JIT, NVPTX for CUDA) live in the `autotp-llvm` crate; both
//! lower this one description.

use serde::{Deserialize, Serialize};

use crate::{BinaryOp, DType, UnaryOp};

/// One generated kernel.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Kernel {
    /// A readable name (the ops it was made from), for profiles and dumps.
    pub name: String,
    /// The buffers it reads (the first `num_inputs`) and writes (the rest), in call order.
    pub buffers: Vec<Buffer>,
    pub num_inputs: usize,
    /// The parallel extent: rows, or blocks of a flat tensor.
    pub outer: usize,
    /// The vectorised extent of every `Reduce` and `Map` stage.
    pub inner: usize,
    pub stages: Vec<Stage>,
}

/// A buffer argument: its element type and length in elements.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Buffer {
    pub dtype: DType,
    pub len: usize,
}

/// One step of a row's work.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Stage {
    /// Folds `value` over the inner dimension into the row's next accumulator
    /// ([`Expr::Acc`] numbers them from 0 in stage order).
    Reduce { fold: Fold, exprs: Vec<Expr>, value: ExprRef },
    /// Stores values at every inner position.
    Map { exprs: Vec<Expr>, stores: Vec<Store> },
    /// Stores values once per row; its expressions may not use the inner variable.
    Row { exprs: Vec<Expr>, stores: Vec<Store> },
}

impl Stage {
    pub fn exprs(&self) -> &[Expr] {
        match self {
            Stage::Reduce { exprs, .. } | Stage::Map { exprs, .. } | Stage::Row { exprs, .. } => exprs,
        }
    }

    /// Whether the stage loads one of the kernel's outputs (stored by an earlier stage: checked).
    pub fn reads_outputs(&self, num_inputs: usize) -> bool {
        self.exprs().iter().any(|e| matches!(e, Expr::Load { buffer, .. } if *buffer >= num_inputs))
    }
}

/// How a `Reduce` stage combines its values (f32).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Fold {
    /// Starts from 0.
    Sum,
    /// Starts from -inf; a NaN propagates (as `torch.max` and the builtin reduce).
    Max,
}

/// The position of an expression in its stage's list.
pub type ExprRef = u32;

/// An element-wise expression.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Expr {
    /// A constant, serialised as its bits (JSON has no NaN or infinities).
    F32(#[serde(with = "f32_bits")] f32),
    I64(i64),
    /// An element of an input buffer, converted to its scalar type.
    Load {
        buffer: usize,
        index: Index,
    },
    /// The element of input `buffer` at `index` plus the i64 value `offset` clamped to
    /// `0..bound` (the caller tells a value outside apart itself): a row's element chosen by a
    /// value, such as the score of a row's label.
    Pick {
        buffer: usize,
        index: Index,
        offset: ExprRef,
        bound: usize,
    },
    /// The `k`-th accumulator of this row (from an earlier `Reduce` stage).
    Acc(usize),
    /// A loop variable, as i64.
    Var(Var),
    /// The value of an index expression of the loop variables, as i64 (a coordinate).
    Coord(Index),
    Unary(UnaryOp, ExprRef),
    /// Arithmetic (`add`...`min`) on two values of one type, comparisons to bool, and
    /// `and`/`or`/`xor` on bools.
    Binary(BinaryOp, ExprRef, ExprRef),
    /// `cond ? a : b`.
    Select(ExprRef, ExprRef, ExprRef),
    /// A bool or i64 as f32 (true is 1).
    ToF32(ExprRef),
    /// An f32 rounded to the nearest value of a 16-bit float type (bf16 or f16; to nearest
    /// even, NaN kept), as f32: what an op with a 16-bit result gives (mixed precision).
    Round(DType, ExprRef),
}

mod f32_bits {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(x: &f32, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u32(x.to_bits())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<f32, D::Error> {
        u32::deserialize(d).map(f32::from_bits)
    }
}

/// A store of a value (converted to the buffer's element type) into an output buffer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Store {
    pub buffer: usize,
    pub index: Index,
    pub value: ExprRef,
}

/// The two loop variables.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Var {
    Outer,
    Inner,
}

/// An element offset: `base` plus the sum of the terms.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Index {
    #[serde(default)]
    pub base: usize,
    pub terms: Vec<Term>,
}

/// `((((var / div) % modulo) + offset) % wrap) * stride`; a `None` modulo or wrap is skipped.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Term {
    pub var: Var,
    pub div: usize,
    pub modulo: Option<usize>,
    pub stride: usize,
    #[serde(default)]
    pub offset: usize,
    #[serde(default)]
    pub wrap: Option<usize>,
}

impl Term {
    /// `((var / div) % modulo) * stride`.
    pub fn new(var: Var, div: usize, modulo: Option<usize>, stride: usize) -> Term {
        Term { var, div, modulo, stride, offset: 0, wrap: None }
    }

    /// The term's value before the stride, for a variable value `at`.
    pub fn coordinate(&self, at: usize) -> usize {
        let v = at / self.div.max(1);
        let v = self.modulo.map_or(v, |m| v % m) + self.offset;
        self.wrap.map_or(v, |w| v % w)
    }

    /// The largest [`Term::coordinate`] for variable values below `extent` (at least 1).
    fn max_coordinate(&self, extent: usize) -> usize {
        let top = (extent - 1) / self.div.max(1);
        let top = self.modulo.map_or(top, |m| top.min(m.saturating_sub(1))) + self.offset;
        self.wrap.map_or(top, |w| top.min(w.saturating_sub(1)))
    }
}

/// The type of a kernel value.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ScalarType {
    F32,
    I64,
    Bool,
}

/// Why a kernel is not well formed.
#[derive(Debug, thiserror::Error, PartialEq)]
#[error("kernel {kernel}: {what}")]
pub struct KirError {
    pub kernel: String,
    pub what: String,
}

impl Index {
    /// `var * stride`: a contiguous walk for stride 1.
    pub fn linear(var: Var, stride: usize) -> Index {
        Index { base: 0, terms: vec![Term::new(var, 1, None, stride)] }
    }

    /// `outer * row + inner`: row `o` of a `[outer, row]` buffer.
    pub fn row_major(row: usize) -> Index {
        Index::linear(Var::Outer, row).plus(Index::linear(Var::Inner, 1))
    }

    pub fn plus(mut self, other: Index) -> Index {
        self.terms.extend(other.terms);
        self.terms.retain(|t| t.stride != 0);
        self
    }

    /// Whether the index depends on `var`.
    pub fn uses(&self, var: Var) -> bool {
        self.terms.iter().any(|t| t.var == var)
    }

    /// The largest offset the index reaches for variables below these extents (`outer`, `inner`
    /// both at least 1).
    pub fn max_offset(&self, outer: usize, inner: usize) -> usize {
        self.base
            + self
                .terms
                .iter()
                .map(|t| t.max_coordinate(if t.var == Var::Outer { outer } else { inner }) * t.stride)
                .sum::<usize>()
    }

    /// The offset at these loop positions.
    pub fn offset(&self, outer: usize, inner: usize) -> usize {
        self.base
            + self
                .terms
                .iter()
                .map(|t| t.coordinate(if t.var == Var::Outer { outer } else { inner }) * t.stride)
                .sum::<usize>()
    }
}

/// The scalar type a buffer's elements load as, or `None` when kernels cannot use the dtype.
/// 16-bit floats load as f32 and store rounded to nearest even.
pub fn scalar_type(dtype: DType) -> Option<ScalarType> {
    match dtype {
        DType::F32 | DType::BF16 | DType::F16 => Some(ScalarType::F32),
        DType::I64 => Some(ScalarType::I64),
        DType::Bool => Some(ScalarType::Bool),
        _ => None,
    }
}

impl Kernel {
    /// The input buffers, then the output buffers.
    pub fn inputs(&self) -> &[Buffer] {
        &self.buffers[..self.num_inputs]
    }

    pub fn outputs(&self) -> &[Buffer] {
        &self.buffers[self.num_inputs..]
    }

    /// The number of `Reduce` stages (the row's accumulators).
    pub fn accumulators(&self) -> usize {
        self.stages.iter().filter(|s| matches!(s, Stage::Reduce { .. })).count()
    }

    /// Checks that the kernel is well formed: every expression typed, every reference to an
    /// earlier expression or accumulator, inputs only read and outputs only written, and every
    /// access in bounds of its buffer for all loop positions. A kernel that passes cannot touch
    /// memory outside its buffers, whatever file it came from.
    pub fn check(&self) -> Result<(), KirError> {
        let fail = |what: String| Err(KirError { kernel: self.name.clone(), what });
        if self.num_inputs > self.buffers.len() {
            return fail(format!("{} inputs but {} buffers", self.num_inputs, self.buffers.len()));
        }
        if self.outer == 0 || self.inner == 0 {
            return fail(format!("empty loop nest {} x {}", self.outer, self.inner));
        }
        for (b, buffer) in self.buffers.iter().enumerate() {
            if scalar_type(buffer.dtype).is_none() {
                return fail(format!("buffer {b} has element type {}, which kernels do not handle", buffer.dtype));
            }
        }
        let in_bounds = |buffer: usize, index: &Index| -> Result<(), KirError> {
            let len = self.buffers[buffer].len;
            if len == 0 || index.max_offset(self.outer, self.inner) >= len {
                return Err(KirError {
                    kernel: self.name.clone(),
                    what: format!("an access to buffer {buffer} reaches past its {len} elements"),
                });
            }
            Ok(())
        };
        let mut accumulators = 0;
        // The outputs' elements earlier map stages stored: (buffer, index).
        let mut stored: Vec<(usize, Index)> = Vec::new();
        for (s, stage) in self.stages.iter().enumerate() {
            let (exprs, row) = match stage {
                Stage::Reduce { exprs, .. } | Stage::Map { exprs, .. } => (exprs, false),
                Stage::Row { exprs, .. } => (exprs, true),
            };
            let mut types = Vec::with_capacity(exprs.len());
            for (e, expr) in exprs.iter().enumerate() {
                let at = |r: ExprRef| types.get(r as usize).copied();
                let ty = match *expr {
                    Expr::F32(_) => Some(ScalarType::F32),
                    Expr::I64(_) => Some(ScalarType::I64),
                    Expr::Load { buffer, ref index } => {
                        let stored_before = stored.iter().any(|(b, at)| *b == buffer && at == index);
                        if buffer >= self.num_inputs && !stored_before {
                            return fail(format!(
                                "stage {s} loads buffer {buffer}, which is not an input nor stored there by an \
                                 earlier map stage"
                            ));
                        }
                        if row && index.uses(Var::Inner) {
                            return fail(format!("row stage {s} reads along the inner dimension"));
                        }
                        in_bounds(buffer, index)?;
                        scalar_type(self.buffers[buffer].dtype)
                    }
                    Expr::Pick { buffer, ref index, offset, bound } => {
                        if buffer >= self.num_inputs {
                            return fail(format!("stage {s} picks from buffer {buffer}, which is not an input"));
                        }
                        if row && index.uses(Var::Inner) {
                            return fail(format!("row stage {s} reads along the inner dimension"));
                        }
                        let last = Index { base: index.base + bound.saturating_sub(1), terms: index.terms.clone() };
                        in_bounds(buffer, &last)?;
                        match (bound, at(offset)) {
                            (1.., Some(ScalarType::I64)) => scalar_type(self.buffers[buffer].dtype),
                            _ => None,
                        }
                    }
                    Expr::Acc(k) => (k < accumulators).then_some(ScalarType::F32),
                    Expr::Var(v) => (!(row && v == Var::Inner)).then_some(ScalarType::I64),
                    Expr::Coord(ref index) => (!(row && index.uses(Var::Inner))).then_some(ScalarType::I64),
                    Expr::Unary(op, a) => match (op, at(a)) {
                        (UnaryOp::Not, Some(ScalarType::Bool)) => Some(ScalarType::Bool),
                        (UnaryOp::Neg | UnaryOp::Abs, Some(ScalarType::I64)) => Some(ScalarType::I64),
                        (UnaryOp::Not | UnaryOp::Sin | UnaryOp::Cos, _) => None,
                        (_, Some(ScalarType::F32)) => Some(ScalarType::F32),
                        _ => None,
                    },
                    Expr::Binary(op, a, b) => match (at(a), at(b)) {
                        (Some(x), Some(y)) if x == y => {
                            if op.is_comparison() {
                                (x != ScalarType::Bool).then_some(ScalarType::Bool)
                            } else if op.is_logical() {
                                (x == ScalarType::Bool).then_some(x)
                            } else {
                                let integer_ok = matches!(
                                    op,
                                    BinaryOp::Add | BinaryOp::Sub | BinaryOp::Mul | BinaryOp::Max | BinaryOp::Min
                                );
                                let float_ok = integer_ok || op == BinaryOp::Div;
                                let ok = match x {
                                    ScalarType::F32 => float_ok,
                                    ScalarType::I64 => integer_ok,
                                    ScalarType::Bool => false,
                                };
                                ok.then_some(x)
                            }
                        }
                        _ => None,
                    },
                    Expr::Select(c, a, b) => match (at(c), at(a), at(b)) {
                        (Some(ScalarType::Bool), Some(x), Some(y)) if x == y => Some(x),
                        _ => None,
                    },
                    Expr::ToF32(a) => match at(a) {
                        Some(ScalarType::Bool | ScalarType::I64) => Some(ScalarType::F32),
                        _ => None,
                    },
                    Expr::Round(dtype, a) => match (dtype, at(a)) {
                        (DType::BF16 | DType::F16, Some(ScalarType::F32)) => Some(ScalarType::F32),
                        _ => None,
                    },
                };
                match ty {
                    Some(ty) => types.push(ty),
                    None => return fail(format!("stage {s} expression {e} ({expr:?}) is ill-typed or refers ahead")),
                }
            }
            let value_type = |r: ExprRef| types.get(r as usize).copied();
            match stage {
                Stage::Reduce { value, .. } => {
                    if value_type(*value) != Some(ScalarType::F32) {
                        return fail(format!("stage {s} reduces a value that is not an f32 expression"));
                    }
                    accumulators += 1;
                }
                Stage::Map { stores, .. } | Stage::Row { stores, .. } => {
                    for store in stores {
                        if store.buffer < self.num_inputs || store.buffer >= self.buffers.len() {
                            return fail(format!(
                                "stage {s} stores to buffer {}, which is not an output",
                                store.buffer
                            ));
                        }
                        if row && store.index.uses(Var::Inner) {
                            return fail(format!("row stage {s} stores along the inner dimension"));
                        }
                        in_bounds(store.buffer, &store.index)?;
                        let want = scalar_type(self.buffers[store.buffer].dtype);
                        if value_type(store.value).is_none() || value_type(store.value) != want {
                            return fail(format!(
                                "stage {s} stores a value of the wrong type to buffer {}",
                                store.buffer
                            ));
                        }
                    }
                    if let Stage::Map { stores: map_stores, .. } = stage {
                        stored.extend(map_stores.iter().map(|store| (store.buffer, store.index.clone())));
                    }
                }
            }
        }
        Ok(())
    }
}

impl std::fmt::Display for Index {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut terms: Vec<String> = self
            .terms
            .iter()
            .map(|t| {
                let mut s = (if t.var == Var::Outer { "o" } else { "i" }).to_string();
                if t.div > 1 {
                    s = format!("{s}/{}", t.div);
                }
                if let Some(m) = t.modulo {
                    s = format!("({s})%{m}");
                }
                if t.offset > 0 {
                    s = format!("{s}+{}", t.offset);
                }
                if let Some(w) = t.wrap {
                    s = format!("({s})%{w}");
                }
                if t.stride != 1 {
                    s = format!("{s}*{}", t.stride);
                }
                s
            })
            .collect();
        if self.base > 0 || terms.is_empty() {
            terms.insert(0, self.base.to_string());
        }
        write!(f, "{}", terms.join(" + "))
    }
}

impl std::fmt::Display for Expr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Expr::F32(x) => write!(f, "{x:?}"),
            Expr::I64(x) => write!(f, "{x}i64"),
            Expr::Load { buffer, index } => write!(f, "load %b{buffer}[{index}]"),
            Expr::Pick { buffer, index, offset, bound } => {
                write!(f, "pick %b{buffer}[{index} + clamp(%{offset}, 0..{bound})]")
            }
            Expr::Acc(k) => write!(f, "acc{k}"),
            Expr::Var(Var::Outer) => write!(f, "o"),
            Expr::Var(Var::Inner) => write!(f, "i"),
            Expr::Coord(index) => write!(f, "coord {index}"),
            Expr::Unary(op, a) => write!(f, "{} %{a}", op.name()),
            Expr::Binary(op, a, b) => write!(f, "{} %{a}, %{b}", op.name()),
            Expr::Select(c, a, b) => write!(f, "select %{c}, %{a}, %{b}"),
            Expr::ToF32(a) => write!(f, "to_f32 %{a}"),
            Expr::Round(dtype, a) => write!(f, "round_{dtype} %{a}"),
        }
    }
}

/// The kernel IR as text (`autotp compile --dump-kernels`): buffers, then each stage with its
/// numbered expressions.
impl std::fmt::Display for Kernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "kernel \"{}\" outer {} inner {} {{", self.name, self.outer, self.inner)?;
        for (b, buffer) in self.buffers.iter().enumerate() {
            let role = if b < self.num_inputs { "in" } else { "out" };
            writeln!(f, "  {role} %b{b} : {}[{}]", buffer.dtype, buffer.len)?;
        }
        let mut accumulators = 0;
        for stage in &self.stages {
            let (head, exprs, stores) = match stage {
                Stage::Reduce { fold, exprs, .. } => {
                    let fold = if *fold == Fold::Sum { "sum" } else { "max" };
                    (format!("acc{accumulators} = reduce {fold} over i"), exprs, &[][..])
                }
                Stage::Map { exprs, stores } => ("map over i".to_string(), exprs, &stores[..]),
                Stage::Row { exprs, stores } => ("row".to_string(), exprs, &stores[..]),
            };
            writeln!(f, "  {head} {{")?;
            for (e, expr) in exprs.iter().enumerate() {
                writeln!(f, "    %{e} = {expr}")?;
            }
            if let Stage::Reduce { value, .. } = stage {
                writeln!(f, "    fold %{value}")?;
                accumulators += 1;
            }
            for s in stores {
                writeln!(f, "    store %b{}[{}] = %{}", s.buffer, s.index, s.value)?;
            }
            writeln!(f, "  }}")?;
        }
        writeln!(f, "}}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `max_offset`, which `check` relies on for memory safety, is never below an offset some
    /// loop position reaches (and, for these indices, exactly the largest).
    /// A stage may read an output back only where an earlier map stage stored it, at the same
    /// index.
    #[test]
    fn an_output_is_read_back_only_where_a_map_stage_stored_it() {
        let row = Index::row_major(4);
        let kernel = |stored_at: Index, read_at: Index, map_first: bool| {
            let store = Stage::Map {
                exprs: vec![Expr::Load { buffer: 0, index: row.clone() }],
                stores: vec![Store { buffer: 1, index: stored_at, value: 0 }],
            };
            let read =
                Stage::Reduce { fold: Fold::Sum, exprs: vec![Expr::Load { buffer: 1, index: read_at }], value: 0 };
            Kernel {
                name: "read back".into(),
                buffers: vec![Buffer { dtype: DType::F32, len: 12 }, Buffer { dtype: DType::F32, len: 12 }],
                num_inputs: 1,
                outer: 3,
                inner: 4,
                stages: if map_first { vec![store, read] } else { vec![read, store] },
            }
        };
        let ok = kernel(row.clone(), row.clone(), true);
        assert!(ok.check().is_ok());
        assert!(ok.stages[1].reads_outputs(1) && !ok.stages[0].reads_outputs(1));
        let shifted = Index { base: 1, ..Index::row_major(3) };
        assert!(kernel(row.clone(), shifted, true).check().is_err(), "another index");
        let before = kernel(row.clone(), row.clone(), false).check().unwrap_err();
        assert!(before.what.contains("not an input nor stored there"), "{before:?}");
    }

    /// A pick is bounded by its clamp: one whose last element lies past its buffer, or whose
    /// offset is not an i64, is refused.
    #[test]
    fn a_pick_is_checked_in_bounds_with_an_integer_offset() {
        let kernel = |bound: usize, offset: Expr| Kernel {
            name: "pick".into(),
            buffers: vec![
                Buffer { dtype: DType::F32, len: 12 },
                Buffer { dtype: DType::I64, len: 3 },
                Buffer { dtype: DType::F32, len: 3 },
            ],
            num_inputs: 2,
            outer: 3,
            inner: 4,
            stages: vec![Stage::Row {
                exprs: vec![offset, Expr::Pick { buffer: 0, index: Index::linear(Var::Outer, 4), offset: 0, bound }],
                stores: vec![Store { buffer: 2, index: Index::linear(Var::Outer, 1), value: 1 }],
            }],
        };
        let label = Expr::Load { buffer: 1, index: Index::linear(Var::Outer, 1) };
        assert!(kernel(4, label.clone()).check().is_ok());
        let past = kernel(5, label.clone()).check().unwrap_err();
        assert!(past.what.contains("reaches past its 12 elements"), "{past:?}");
        assert!(kernel(0, label).check().is_err(), "an empty range");
        assert!(kernel(4, Expr::F32(1.0)).check().is_err(), "a float offset");
    }

    #[test]
    fn max_offset_bounds_every_reachable_offset() {
        let mut wrapped = Term::new(Var::Inner, 2, Some(5), 3);
        wrapped.offset = 4;
        wrapped.wrap = Some(6);
        let indices = [
            Index::row_major(7),
            Index { base: 11, terms: vec![Term::new(Var::Outer, 3, Some(4), 10), Term::new(Var::Inner, 1, None, 1)] },
            Index { base: 0, terms: vec![wrapped, Term::new(Var::Outer, 1, None, 100)] },
        ];
        for index in &indices {
            let (outer, inner) = (9, 7);
            let reached = (0..outer).flat_map(|o| (0..inner).map(move |i| index.offset(o, i))).max().unwrap();
            assert_eq!(index.max_offset(outer, inner), reached, "{index}");
        }
    }
}
