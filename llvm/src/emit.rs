//! The target-independent half of kernel lowering: a stage's expressions, loads and stores
//! as LLVM vector values of a given width (1 for scalar tails, row stages and NVPTX threads).
//!
//! Every value is a vector (`<w x float>`, `<w x i64>`, `<w x i1>`), even at width 1, so one
//! emitter serves the vector body, the tail and every target. Addresses follow the kernel IR's
//! [`Index`]: the outer variable's part is a scalar; an inner part that is `inner * stride`
//! loads a vector (stride 1), splats one element (stride 0) or reads lane by lane, and any
//! other inner part is computed per lane.

use autotp_kernels::kir::{self, Expr, Index, ScalarType, Term, Var};
use autotp_kernels::{BinaryOp, DType, UnaryOp};
use inkwell::basic_block::BasicBlock;
use inkwell::builder::Builder;
use inkwell::context::Context;
use inkwell::module::Module;
use inkwell::types::{BasicTypeEnum, VectorType};
use inkwell::values::{BasicMetadataValueEnum, BasicValueEnum, FunctionValue, IntValue, PointerValue, VectorValue};
use inkwell::{FloatPredicate, IntPredicate};

use crate::{math, LlvmError};

pub type V<'ctx> = VectorValue<'ctx>;

/// Builds instructions on vectors of one element type family.
pub struct Emitter<'a, 'ctx> {
    pub ctx: &'ctx Context,
    pub module: &'a Module<'ctx>,
    pub b: &'a Builder<'ctx>,
}

/// Where a stage is being evaluated: `width` lanes at inner positions `inner..inner + width`
/// (`inner` is `None` in a row stage) of row `outer`; or, with `lanes_on_outer`, at rows
/// `outer..outer + width` and inner position `inner`.
pub struct Position<'ctx> {
    pub width: u32,
    pub outer: IntValue<'ctx>,
    pub inner: Option<IntValue<'ctx>>,
    /// The row's accumulators so far: `<1 x float>`, or one lane per row with `lanes_on_outer`.
    pub accs: Vec<V<'ctx>>,
    pub lanes_on_outer: bool,
    /// Whether the inner position is a multiple of `width` and every buffer starts at a multiple
    /// of `width` elements' bytes: contiguous accesses whose index keeps that alignment are then
    /// aligned to their whole vector ([`vector_aligned`]), which a GPU needs for its 16-byte
    /// loads and stores.
    pub aligned: bool,
}

impl<'ctx> Position<'ctx> {
    /// Lanes along the inner dimension of one row.
    pub fn row(width: u32, outer: IntValue<'ctx>, inner: Option<IntValue<'ctx>>, accs: &[V<'ctx>]) -> Position<'ctx> {
        Position { width, outer, inner, accs: accs.to_vec(), lanes_on_outer: false, aligned: false }
    }

    /// As [`Position::row`], at an inner position that is a multiple of `width`, in buffers
    /// aligned to vectors of `width` elements (see [`Position::aligned`]).
    pub fn aligned_row(width: u32, outer: IntValue<'ctx>, inner: IntValue<'ctx>, accs: &[V<'ctx>]) -> Position<'ctx> {
        Position { aligned: true, ..Position::row(width, outer, Some(inner), accs) }
    }

    /// The alignment in bytes of a contiguous access by `index` to elements of `size` bytes.
    fn alignment(&self, index: &Index, size: usize) -> u32 {
        match self.aligned && !self.lanes_on_outer && vector_aligned(index, self.width as usize) {
            true => self.width * size as u32,
            false => size as u32,
        }
    }

    /// The variable the lanes run along, its value at lane 0, and the other variable's value.
    fn lanes(&self) -> (Var, Option<IntValue<'ctx>>, Option<IntValue<'ctx>>) {
        if self.lanes_on_outer {
            (Var::Outer, Some(self.outer), self.inner)
        } else {
            (Var::Inner, self.inner, Some(self.outer))
        }
    }
}

/// Whether `index` at an inner position that is a multiple of `width` is a multiple of `width`
/// itself: its base and every outer term's stride are (each term is a whole number times its
/// stride), and its inner terms are the plain position.
pub fn vector_aligned(index: &Index, width: usize) -> bool {
    let inner_plain = (index.terms.iter().filter(|t| t.var == Var::Inner))
        .all(|t| t.div <= 1 && t.modulo.is_none() && t.offset == 0 && t.wrap.is_none() && t.stride == 1);
    inner_plain
        && index.base.is_multiple_of(width)
        && index.terms.iter().filter(|t| t.var == Var::Outer).all(|t| t.stride.is_multiple_of(width))
}

impl<'a, 'ctx> Emitter<'a, 'ctx> {
    pub fn f32_type(&self, width: u32) -> VectorType<'ctx> {
        self.ctx.f32_type().vec_type(width)
    }

    fn vector_type(&self, ty: ScalarType, width: u32) -> VectorType<'ctx> {
        match ty {
            ScalarType::F32 => self.ctx.f32_type().vec_type(width),
            ScalarType::I64 => self.ctx.i64_type().vec_type(width),
            ScalarType::Bool => self.ctx.bool_type().vec_type(width),
        }
    }

    pub fn width(v: V<'ctx>) -> u32 {
        v.get_type().get_size()
    }

    pub fn f32(&self, width: u32, x: f32) -> V<'ctx> {
        let c = self.ctx.f32_type().const_float(x as f64);
        VectorType::const_vector(&vec![c; width as usize])
    }

    pub fn i32(&self, width: u32, x: i32) -> V<'ctx> {
        let c = self.ctx.i32_type().const_int(x as i64 as u64, true);
        VectorType::const_vector(&vec![c; width as usize])
    }

    pub fn i64(&self, width: u32, x: i64) -> V<'ctx> {
        let c = self.ctx.i64_type().const_int(x as u64, true);
        VectorType::const_vector(&vec![c; width as usize])
    }

    /// `width` copies of lane 0 of `v`.
    pub fn broadcast(&self, v: V<'ctx>, width: u32) -> Result<V<'ctx>, LlvmError> {
        if Self::width(v) == width && width == 1 {
            return Ok(v);
        }
        let mask = VectorType::const_vector(&vec![self.ctx.i32_type().const_zero(); width as usize]);
        Ok(self.b.build_shuffle_vector(v, v.get_type().get_undef(), mask, "")?)
    }

    /// A scalar as a `width`-lane vector.
    pub fn splat(&self, scalar: BasicValueEnum<'ctx>, width: u32) -> Result<V<'ctx>, LlvmError> {
        let one = scalar.get_type().vec_type_of(1);
        let v = self.b.build_insert_element(one.get_undef(), scalar, self.ctx.i32_type().const_zero(), "")?;
        self.broadcast(v, width)
    }

    pub fn lane(&self, v: V<'ctx>, lane: u32) -> Result<BasicValueEnum<'ctx>, LlvmError> {
        Ok(self.b.build_extract_element(v, self.ctx.i32_type().const_int(lane as u64, false), "")?)
    }

    pub fn fadd(&self, a: V<'ctx>, b: V<'ctx>) -> Result<V<'ctx>, LlvmError> {
        Ok(self.b.build_float_add(a, b, "")?)
    }

    pub fn fsub(&self, a: V<'ctx>, b: V<'ctx>) -> Result<V<'ctx>, LlvmError> {
        Ok(self.b.build_float_sub(a, b, "")?)
    }

    pub fn fmul(&self, a: V<'ctx>, b: V<'ctx>) -> Result<V<'ctx>, LlvmError> {
        Ok(self.b.build_float_mul(a, b, "")?)
    }

    pub fn fdiv(&self, a: V<'ctx>, b: V<'ctx>) -> Result<V<'ctx>, LlvmError> {
        Ok(self.b.build_float_div(a, b, "")?)
    }

    pub fn fcmp(&self, predicate: FloatPredicate, a: V<'ctx>, b: V<'ctx>) -> Result<V<'ctx>, LlvmError> {
        Ok(self.b.build_float_compare(predicate, a, b, "")?)
    }

    pub fn icmp(&self, predicate: IntPredicate, a: V<'ctx>, b: V<'ctx>) -> Result<V<'ctx>, LlvmError> {
        Ok(self.b.build_int_compare(predicate, a, b, "")?)
    }

    pub fn select(&self, cond: V<'ctx>, a: V<'ctx>, b: V<'ctx>) -> Result<V<'ctx>, LlvmError> {
        Ok(self.b.build_select(cond, a, b, "")?.into_vector_value())
    }

    /// A call of the overloaded intrinsic `name` on values of `v`'s type.
    pub fn intrinsic(&self, name: &str, args: &[V<'ctx>]) -> Result<V<'ctx>, LlvmError> {
        let intrinsic =
            inkwell::intrinsics::Intrinsic::find(name).ok_or_else(|| LlvmError::llvm("intrinsic lookup", name))?;
        let ty: BasicTypeEnum = args[0].get_type().into();
        let function = intrinsic
            .get_declaration(self.module, &[ty])
            .ok_or_else(|| LlvmError::llvm("intrinsic declaration", name))?;
        let args: Vec<BasicMetadataValueEnum> = args.iter().map(|&a| a.into()).collect();
        let call = self.b.build_call(function, &args, "")?;
        call.try_as_basic_value()
            .basic()
            .map(|v| v.into_vector_value())
            .ok_or_else(|| LlvmError::llvm("intrinsic call", name))
    }

    /// `a * b + c`, rounded once.
    pub fn fma(&self, a: V<'ctx>, b: V<'ctx>, c: V<'ctx>) -> Result<V<'ctx>, LlvmError> {
        self.intrinsic("llvm.fma", &[a, b, c])
    }

    /// `max(a, b)` with NaN propagating from either side (the builtin kernels' `max_of`).
    pub fn fmax(&self, a: V<'ctx>, b: V<'ctx>) -> Result<V<'ctx>, LlvmError> {
        let greater = self.fcmp(FloatPredicate::OGT, a, b)?;
        let nan = self.fcmp(FloatPredicate::UNO, a, a)?;
        let take_a = self.b.build_or(greater, nan, "")?;
        self.select(take_a, a, b)
    }

    pub fn fmin(&self, a: V<'ctx>, b: V<'ctx>) -> Result<V<'ctx>, LlvmError> {
        let less = self.fcmp(FloatPredicate::OLT, a, b)?;
        let nan = self.fcmp(FloatPredicate::UNO, a, a)?;
        let take_a = self.b.build_or(less, nan, "")?;
        self.select(take_a, a, b)
    }

    /// `fold` applied to every lane of `v` in lane order, starting from `start` (`<1 x float>`).
    pub fn fold_lanes(&self, fold: kir::Fold, v: V<'ctx>, start: V<'ctx>) -> Result<V<'ctx>, LlvmError> {
        let mut acc = start;
        for lane in 0..Self::width(v) {
            let x = self.splat(self.lane(v, lane)?, 1)?;
            acc = self.fold(fold, acc, x)?;
        }
        Ok(acc)
    }

    pub fn fold(&self, fold: kir::Fold, acc: V<'ctx>, x: V<'ctx>) -> Result<V<'ctx>, LlvmError> {
        match fold {
            kir::Fold::Sum => self.fadd(acc, x),
            kir::Fold::Max => self.fmax(x, acc),
        }
    }

    pub fn fold_start(&self, fold: kir::Fold, width: u32) -> V<'ctx> {
        match fold {
            kir::Fold::Sum => self.f32(width, 0.0),
            kir::Fold::Max => self.f32(width, f32::NEG_INFINITY),
        }
    }

    /// The scalar offset of `terms` at loop variable value `at`.
    fn term_offset(&self, terms: &[&Term], at: IntValue<'ctx>) -> Result<IntValue<'ctx>, LlvmError> {
        let i64t = self.ctx.i64_type();
        let mut sum = i64t.const_zero();
        for t in terms {
            let mut v = at;
            if t.div > 1 {
                v = self.b.build_int_unsigned_div(v, i64t.const_int(t.div as u64, false), "")?;
            }
            if let Some(m) = t.modulo {
                v = self.b.build_int_unsigned_rem(v, i64t.const_int(m as u64, false), "")?;
            }
            if t.offset > 0 {
                v = self.b.build_int_add(v, i64t.const_int(t.offset as u64, false), "")?;
            }
            if let Some(w) = t.wrap {
                v = self.b.build_int_unsigned_rem(v, i64t.const_int(w as u64, false), "")?;
            }
            v = self.b.build_int_mul(v, i64t.const_int(t.stride as u64, false), "")?;
            sum = self.b.build_int_add(sum, v, "")?;
        }
        Ok(sum)
    }

    /// The element offsets of `index` at `at`, as an outer scalar plus an inner access pattern.
    fn address(&self, index: &Index, at: &Position<'ctx>) -> Result<Address<'ctx>, LlvmError> {
        let (lane_var, lane_start, fixed) = at.lanes();
        let fixed_terms: Vec<&Term> = index.terms.iter().filter(|t| t.var != lane_var).collect();
        let lane_terms: Vec<&Term> = index.terms.iter().filter(|t| t.var == lane_var).collect();
        let i64t = self.ctx.i64_type();
        // A row stage has no inner terms (checked), so a missing inner value is never read.
        let base = self.term_offset(&fixed_terms, fixed.unwrap_or(at.outer))?;
        let base = self.b.build_int_add(base, i64t.const_int(index.base as u64, false), "")?;
        let Some(start) = lane_start.filter(|_| !lane_terms.is_empty()) else {
            return Ok(Address::Splat(base));
        };
        if lane_terms.iter().all(|t| t.div <= 1 && t.modulo.is_none() && t.offset == 0 && t.wrap.is_none()) {
            let stride: usize = lane_terms.iter().map(|t| t.stride).sum();
            if stride == 1 {
                return Ok(Address::Contiguous(self.b.build_int_add(base, start, "")?));
            }
        }
        let lanes = (0..at.width)
            .map(|lane| {
                let position = self.b.build_int_add(start, i64t.const_int(lane as u64, false), "")?;
                Ok(self.b.build_int_add(base, self.term_offset(&lane_terms, position)?, "")?)
            })
            .collect::<Result<Vec<_>, LlvmError>>()?;
        Ok(Address::Lanes(lanes))
    }

    pub(crate) fn element_pointer(
        &self,
        buffer: &Buffer<'ctx>,
        offset: IntValue<'ctx>,
    ) -> Result<PointerValue<'ctx>, LlvmError> {
        // SAFETY (of the generated code): `Kernel::check` proved every offset in bounds.
        Ok(unsafe {
            self.b.build_in_bounds_gep(
                self.memory_type(buffer.dtype, 1).get_element_type(),
                buffer.pointer,
                &[offset],
                "",
            )?
        })
    }

    /// How `dtype` elements sit in memory (`u8` for bool, `i16` for bf16).
    pub(crate) fn memory_type(&self, dtype: DType, width: u32) -> VectorType<'ctx> {
        match dtype {
            DType::F32 => self.ctx.f32_type().vec_type(width),
            DType::I64 => self.ctx.i64_type().vec_type(width),
            DType::F16 => self.ctx.f16_type().vec_type(width),
            DType::BF16 => self.ctx.i16_type().vec_type(width),
            _ => self.ctx.i8_type().vec_type(width),
        }
    }

    /// bf16 bits (i16 lanes) as f32: the high half of an f32.
    fn widen_bf16(&self, bits: V<'ctx>) -> Result<V<'ctx>, LlvmError> {
        let width = Self::width(bits);
        let wide = self.b.build_int_z_extend(bits, self.ctx.i32_type().vec_type(width), "")?;
        let shifted = self.b.build_left_shift(wide, self.i32(width, 16), "")?;
        Ok(self.b.build_bit_cast(shifted, self.f32_type(width), "")?.into_vector_value())
    }

    /// f32 lanes rounded to bf16 (to nearest even; a NaN stays a quiet NaN), as the f32 whose
    /// low half is zero.
    fn round_bf16(&self, x: V<'ctx>) -> Result<V<'ctx>, LlvmError> {
        let width = Self::width(x);
        let bits = self.b.build_bit_cast(x, self.ctx.i32_type().vec_type(width), "")?.into_vector_value();
        let high = self.i32(width, 0xFFFF_0000u32 as i32);
        let lsb = self.b.build_right_shift(bits, self.i32(width, 16), false, "")?;
        let lsb = self.b.build_and(lsb, self.i32(width, 1), "")?;
        let biased = self.b.build_int_add(bits, self.i32(width, 0x7FFF), "")?;
        let biased = self.b.build_int_add(biased, lsb, "")?;
        let rounded = self.b.build_and(biased, high, "")?;
        let quiet = self.b.build_or(bits, self.i32(width, 0x0040_0000), "")?;
        let quiet = self.b.build_and(quiet, high, "")?;
        let nan = self.fcmp(FloatPredicate::UNO, x, x)?;
        let result = self.select(nan, quiet, rounded)?;
        Ok(self.b.build_bit_cast(result, self.f32_type(width), "")?.into_vector_value())
    }

    /// f32 lanes rounded to `dtype` (bf16 or f16) and back: [`Expr::Round`].
    fn round(&self, dtype: DType, x: V<'ctx>) -> Result<V<'ctx>, LlvmError> {
        let width = Self::width(x);
        match dtype {
            DType::BF16 => self.round_bf16(x),
            _ => {
                let half = self.b.build_float_trunc(x, self.ctx.f16_type().vec_type(width), "")?;
                Ok(self.b.build_float_ext(half, self.f32_type(width), "")?)
            }
        }
    }

    fn load(&self, buffer: &Buffer<'ctx>, index: &Index, at: &Position<'ctx>) -> Result<V<'ctx>, LlvmError> {
        let width = at.width;
        let element = self.memory_type(buffer.dtype, 1).get_element_type();
        let align = buffer.dtype.size() as u32;
        let scalar_at = |offset| -> Result<BasicValueEnum<'ctx>, LlvmError> {
            let load = self.b.build_load(element, self.element_pointer(buffer, offset)?, "")?;
            set_alignment(load, align);
            Ok(load)
        };
        let raw = match self.address(index, at)? {
            Address::Splat(offset) => self.splat(scalar_at(offset)?, width)?,
            Address::Contiguous(offset) => {
                let load = self.b.build_load(
                    self.memory_type(buffer.dtype, width),
                    self.element_pointer(buffer, offset)?,
                    "",
                )?;
                set_alignment(load, at.alignment(index, buffer.dtype.size()));
                load.into_vector_value()
            }
            Address::Lanes(offsets) => {
                let mut v = self.memory_type(buffer.dtype, width).get_undef();
                for (lane, offset) in offsets.into_iter().enumerate() {
                    let x = scalar_at(offset)?;
                    v = self.b.build_insert_element(v, x, self.ctx.i32_type().const_int(lane as u64, false), "")?;
                }
                v
            }
        };
        self.widen(buffer.dtype, raw)
    }

    /// [`Expr::Pick`]: per lane, the element at the lane's `index` plus its `offset` clamped to
    /// `0..bound`, loaded one lane at a time.
    fn pick(
        &self,
        buffer: &Buffer<'ctx>,
        index: &Index,
        offset: V<'ctx>,
        bound: usize,
        at: &Position<'ctx>,
    ) -> Result<V<'ctx>, LlvmError> {
        let width = at.width;
        let i64t = self.ctx.i64_type();
        let starts: Vec<IntValue<'ctx>> = match self.address(index, at)? {
            Address::Splat(start) => vec![start; width as usize],
            Address::Contiguous(start) => (0..width)
                .map(|l| self.b.build_int_add(start, i64t.const_int(l as u64, false), ""))
                .collect::<Result<_, _>>()?,
            Address::Lanes(starts) => starts,
        };
        let element = self.memory_type(buffer.dtype, 1).get_element_type();
        let mut raw = self.memory_type(buffer.dtype, width).get_undef();
        for (lane, start) in starts.into_iter().enumerate() {
            let lane_index = i64t.const_int(lane as u64, false);
            let chosen = self.b.build_extract_element(offset, lane_index, "")?.into_int_value();
            let negative = self.b.build_int_compare(IntPredicate::SLT, chosen, i64t.const_zero(), "")?;
            let chosen = self.b.build_select(negative, i64t.const_zero(), chosen, "")?.into_int_value();
            let last = i64t.const_int(bound as u64 - 1, false);
            let past = self.b.build_int_compare(IntPredicate::SGT, chosen, last, "")?;
            let chosen = self.b.build_select(past, last, chosen, "")?.into_int_value();
            let at = self.b.build_int_add(start, chosen, "")?;
            let load = self.b.build_load(element, self.element_pointer(buffer, at)?, "")?;
            set_alignment(load, buffer.dtype.size() as u32);
            raw = self.b.build_insert_element(raw, load, self.ctx.i32_type().const_int(lane as u64, false), "")?;
        }
        self.widen(buffer.dtype, raw)
    }

    /// `dtype` elements as they sit in memory ([`Emitter::memory_type`] lanes) as the values
    /// expressions compute with: f32 for the 16-bit floats, bool for bool.
    pub(crate) fn widen(&self, dtype: DType, raw: V<'ctx>) -> Result<V<'ctx>, LlvmError> {
        let width = Self::width(raw);
        match dtype {
            DType::Bool => self.icmp(IntPredicate::NE, raw, self.memory_type(DType::Bool, width).const_zero()),
            DType::F16 => Ok(self.b.build_float_ext(raw, self.f32_type(width), "")?),
            DType::BF16 => self.widen_bf16(raw),
            _ => Ok(raw),
        }
    }

    /// The inverse of [`Emitter::widen`]: computed values as `dtype`'s memory lanes, 16-bit
    /// floats rounded to nearest even.
    pub(crate) fn narrow(&self, dtype: DType, value: V<'ctx>) -> Result<V<'ctx>, LlvmError> {
        let width = Self::width(value);
        Ok(match dtype {
            DType::Bool => self.b.build_int_z_extend(value, self.memory_type(DType::Bool, width), "")?,
            DType::F16 => self.b.build_float_trunc(value, self.memory_type(DType::F16, width), "")?,
            DType::BF16 => {
                let rounded = self.round_bf16(value)?;
                let bits = self.b.build_bit_cast(rounded, self.ctx.i32_type().vec_type(width), "")?;
                let high = self.b.build_right_shift(bits.into_vector_value(), self.i32(width, 16), false, "")?;
                self.b.build_int_truncate(high, self.memory_type(DType::BF16, width), "")?
            }
            _ => value,
        })
    }

    fn store(
        &self,
        buffer: &Buffer<'ctx>,
        index: &Index,
        at: &Position<'ctx>,
        value: V<'ctx>,
    ) -> Result<(), LlvmError> {
        let value = self.narrow(buffer.dtype, value)?;
        let align = buffer.dtype.size() as u32;
        match self.address(index, at)? {
            Address::Contiguous(offset) => {
                let store = self.b.build_store(self.element_pointer(buffer, offset)?, value)?;
                let _ = store.set_alignment(at.alignment(index, buffer.dtype.size()));
            }
            Address::Splat(offset) => {
                let last = self.lane(value, at.width - 1)?;
                let store = self.b.build_store(self.element_pointer(buffer, offset)?, last)?;
                let _ = store.set_alignment(align);
            }
            Address::Lanes(offsets) => {
                for (lane, offset) in offsets.into_iter().enumerate() {
                    let x = self.lane(value, lane as u32)?;
                    let store = self.b.build_store(self.element_pointer(buffer, offset)?, x)?;
                    let _ = store.set_alignment(align);
                }
            }
        }
        Ok(())
    }

    /// Prefetches, for reading into every cache level, the elements that `exprs`' loads
    /// contiguous along the inner dimension read at `at`, issued for a row ahead of the one a
    /// kernel works on: that row's fetch from memory then overlaps the work on this one.
    pub fn prefetch_loads(&self, kernel: &Buffers<'ctx>, exprs: &[Expr], at: &Position<'ctx>) -> Result<(), LlvmError> {
        let (i32t, ptr) = (self.ctx.i32_type(), self.ctx.ptr_type(inkwell::AddressSpace::default()));
        let prefetch = inkwell::intrinsics::Intrinsic::find("llvm.prefetch")
            .and_then(|i| i.get_declaration(self.module, &[ptr.into()]))
            .ok_or_else(|| LlvmError::llvm("intrinsic declaration", "llvm.prefetch"))?;
        for expr in exprs {
            let Expr::Load { buffer, ref index } = *expr else { continue };
            let Address::Contiguous(offset) = self.address(index, at)? else { continue };
            let buffer = &kernel.0[buffer];
            let element = self.memory_type(buffer.dtype, 1).get_element_type();
            // Not `inbounds`: the row ahead may lie past the buffer, where a prefetch, which
            // never faults, does nothing.
            // SAFETY (of the generated code): the pointer is only prefetched, never dereferenced.
            let pointer = unsafe { self.b.build_gep(element, buffer.pointer, &[offset], "")? };
            let (read, keep_in_all_levels, data) =
                (i32t.const_zero(), i32t.const_int(3, false), i32t.const_int(1, false));
            self.b.build_call(prefetch, &[pointer.into(), read.into(), keep_in_all_levels.into(), data.into()], "")?;
        }
        Ok(())
    }

    /// Evaluates a stage's expressions at `at`.
    pub fn exprs(
        &self,
        kernel: &Buffers<'ctx>,
        exprs: &[Expr],
        at: &Position<'ctx>,
    ) -> Result<Vec<V<'ctx>>, LlvmError> {
        let width = at.width;
        let mut values: Vec<V<'ctx>> = Vec::with_capacity(exprs.len());
        for expr in exprs {
            let v = |r: kir::ExprRef| values[r as usize];
            let value = match *expr {
                Expr::F32(x) => self.f32(width, x),
                Expr::I64(x) => self.i64(width, x),
                Expr::Load { buffer, ref index } => self.load(&kernel.0[buffer], index, at)?,
                Expr::Pick { buffer, ref index, offset, bound } => {
                    self.pick(&kernel.0[buffer], index, v(offset), bound, at)?
                }
                Expr::Acc(k) if at.lanes_on_outer => at.accs[k],
                Expr::Acc(k) => self.broadcast(at.accs[k], width)?,
                Expr::Var(var) => {
                    let (lane_var, lane_start, fixed) = at.lanes();
                    let value = if var == lane_var { lane_start } else { fixed };
                    let value = value.expect("checked: row stages do not use the inner variable");
                    let splat = self.splat(value.into(), width)?;
                    if var == lane_var {
                        let lanes: Vec<IntValue> =
                            (0..width).map(|l| self.ctx.i64_type().const_int(l as u64, false)).collect();
                        self.b.build_int_add(splat, VectorType::const_vector(&lanes), "")?
                    } else {
                        splat
                    }
                }
                Expr::Coord(ref index) => match self.address(index, at)? {
                    Address::Splat(offset) => self.splat(offset.into(), width)?,
                    Address::Contiguous(start) => {
                        let lanes: Vec<IntValue> =
                            (0..width).map(|l| self.ctx.i64_type().const_int(l as u64, false)).collect();
                        self.b.build_int_add(self.splat(start.into(), width)?, VectorType::const_vector(&lanes), "")?
                    }
                    Address::Lanes(offsets) => {
                        let mut lanes = self.ctx.i64_type().vec_type(width).get_undef();
                        for (lane, offset) in offsets.into_iter().enumerate() {
                            let at = self.ctx.i32_type().const_int(lane as u64, false);
                            lanes = self.b.build_insert_element(lanes, offset, at, "")?;
                        }
                        lanes
                    }
                },
                Expr::Unary(op, a) => self.unary(op, v(a))?,
                Expr::Binary(op, a, b) => self.binary(op, v(a), v(b))?,
                Expr::Select(c, a, b) => self.select(v(c), v(a), v(b))?,
                Expr::Round(dtype, a) => self.round(dtype, v(a))?,
                Expr::ToF32(a) => {
                    let a = v(a);
                    let f = self.f32_type(width);
                    if a.get_type().get_element_type().into_int_type().get_bit_width() == 1 {
                        self.b.build_unsigned_int_to_float(a, f, "")?
                    } else {
                        self.b.build_signed_int_to_float(a, f, "")?
                    }
                }
            };
            values.push(value);
        }
        Ok(values)
    }

    /// A `Map` or `Row` stage's work at `at`: its expressions, then its stores.
    pub fn store_stage(
        &self,
        kernel: &Buffers<'ctx>,
        exprs: &[Expr],
        stores: &[kir::Store],
        at: &Position<'ctx>,
    ) -> Result<(), LlvmError> {
        let values = self.exprs(kernel, exprs, at)?;
        self.stores(kernel, stores, &values, at)
    }

    /// The stores of a stage at `at`.
    pub fn stores(
        &self,
        kernel: &Buffers<'ctx>,
        stores: &[kir::Store],
        values: &[V<'ctx>],
        at: &Position<'ctx>,
    ) -> Result<(), LlvmError> {
        for s in stores {
            self.store(&kernel.0[s.buffer], &s.index, at, values[s.value as usize])?;
        }
        Ok(())
    }

    fn is_float(v: V<'ctx>) -> bool {
        v.get_type().get_element_type().is_float_type()
    }

    fn unary(&self, op: UnaryOp, a: V<'ctx>) -> Result<V<'ctx>, LlvmError> {
        let width = Self::width(a);
        if !Self::is_float(a) {
            let zero = a.get_type().const_zero();
            return match op {
                UnaryOp::Not => Ok(self.b.build_not(a, "")?),
                UnaryOp::Neg => Ok(self.b.build_int_sub(zero, a, "")?),
                UnaryOp::Abs => {
                    let negative = self.icmp(IntPredicate::SLT, a, zero)?;
                    self.select(negative, self.b.build_int_sub(zero, a, "")?, a)
                }
                _ => Err(LlvmError::llvm("lowering", format!("{} on integers", op.name()))),
            };
        }
        let (zero, one) = (self.f32(width, 0.0), self.f32(width, 1.0));
        match op {
            UnaryOp::Neg => Ok(self.b.build_float_neg(a, "")?),
            UnaryOp::Abs => self.intrinsic("llvm.fabs", &[a]),
            UnaryOp::Exp => math::exp(self, a),
            UnaryOp::Log => math::log(self, a),
            UnaryOp::Sqrt => self.intrinsic("llvm.sqrt", &[a]),
            UnaryOp::Rsqrt => self.fdiv(one, self.intrinsic("llvm.sqrt", &[a])?),
            UnaryOp::Reciprocal => self.fdiv(one, a),
            UnaryOp::Tanh => math::tanh(self, a),
            UnaryOp::Erf => math::erf(self, a),
            UnaryOp::Sigmoid => math::sigmoid(self, a),
            UnaryOp::Softplus => math::softplus(self, a),
            // No fast-math flag lets LLVM fold `x - x` to 0.
            UnaryOp::FiniteZero => self.fsub(a, a),
            UnaryOp::Relu => self.select(self.fcmp(FloatPredicate::OGT, a, zero)?, a, zero),
            UnaryOp::Floor => self.intrinsic("llvm.floor", &[a]),
            UnaryOp::Ceil => self.intrinsic("llvm.ceil", &[a]),
            UnaryOp::Round => self.intrinsic("llvm.roundeven", &[a]),
            UnaryOp::Sign => {
                let negative = self.select(self.fcmp(FloatPredicate::OLT, a, zero)?, self.f32(width, -1.0), a)?;
                self.select(self.fcmp(FloatPredicate::OGT, a, zero)?, one, negative)
            }
            UnaryOp::Not | UnaryOp::Sin | UnaryOp::Cos => {
                Err(LlvmError::llvm("lowering", format!("{} on f32", op.name())))
            }
        }
    }

    fn binary(&self, op: BinaryOp, a: V<'ctx>, b: V<'ctx>) -> Result<V<'ctx>, LlvmError> {
        use BinaryOp::*;
        if Self::is_float(a) {
            let predicate = |p| self.fcmp(p, a, b);
            return match op {
                Add => self.fadd(a, b),
                Sub => self.fsub(a, b),
                Mul => self.fmul(a, b),
                Div => self.fdiv(a, b),
                Max => self.fmax(a, b),
                Min => self.fmin(a, b),
                Equal => predicate(FloatPredicate::OEQ),
                Less => predicate(FloatPredicate::OLT),
                LessEqual => predicate(FloatPredicate::OLE),
                Greater => predicate(FloatPredicate::OGT),
                GreaterEqual => predicate(FloatPredicate::OGE),
                Pow | Mod | And | Or | Xor => Err(LlvmError::llvm("lowering", format!("{} on f32", op.name()))),
            };
        }
        let predicate = |p| self.icmp(p, a, b);
        match op {
            Add => Ok(self.b.build_int_add(a, b, "")?),
            Sub => Ok(self.b.build_int_sub(a, b, "")?),
            Mul => Ok(self.b.build_int_mul(a, b, "")?),
            Max => self.select(predicate(IntPredicate::SGT)?, a, b),
            Min => self.select(predicate(IntPredicate::SLT)?, a, b),
            Equal => predicate(IntPredicate::EQ),
            Less => predicate(IntPredicate::SLT),
            LessEqual => predicate(IntPredicate::SLE),
            Greater => predicate(IntPredicate::SGT),
            GreaterEqual => predicate(IntPredicate::SGE),
            And => Ok(self.b.build_and(a, b, "")?),
            Or => Ok(self.b.build_or(a, b, "")?),
            Xor => Ok(self.b.build_xor(a, b, "")?),
            Div | Pow | Mod => Err(LlvmError::llvm("lowering", format!("{} on integers", op.name()))),
        }
    }

    /// The vector type of `ty` at `width` lanes.
    pub fn value_type(&self, ty: ScalarType, width: u32) -> VectorType<'ctx> {
        self.vector_type(ty, width)
    }
}

/// A kernel's buffers as the generated function sees them.
pub struct Buffers<'ctx>(pub Vec<Buffer<'ctx>>);

pub struct Buffer<'ctx> {
    pub pointer: PointerValue<'ctx>,
    pub dtype: DType,
}

enum Address<'ctx> {
    /// One element for every lane.
    Splat(IntValue<'ctx>),
    /// `width` consecutive elements from here.
    Contiguous(IntValue<'ctx>),
    /// One element per lane.
    Lanes(Vec<IntValue<'ctx>>),
}

fn set_alignment(value: BasicValueEnum, align: u32) {
    use inkwell::values::BasicValue;
    if let Some(instruction) = value.as_instruction_value() {
        let _ = instruction.set_alignment(align);
    }
}

/// `vec_type_of` for any basic type (inkwell has `vec_type` per concrete type).
trait VecTypeOf<'ctx> {
    fn vec_type_of(self, width: u32) -> VectorType<'ctx>;
}

impl<'ctx> VecTypeOf<'ctx> for BasicTypeEnum<'ctx> {
    fn vec_type_of(self, width: u32) -> VectorType<'ctx> {
        match self {
            BasicTypeEnum::FloatType(t) => t.vec_type(width),
            BasicTypeEnum::IntType(t) => t.vec_type(width),
            BasicTypeEnum::PointerType(t) => t.vec_type(width),
            other => panic!("no vectors of {other:?} in kernels"),
        }
    }
}

/// Emits `for (i = from; i < to; i += step) carried = body(i, carried)` at the builder's
/// position and leaves the builder after the loop; returns the carried values' final state.
pub fn counted_loop<'ctx>(
    e: &Emitter<'_, 'ctx>,
    function: FunctionValue<'ctx>,
    from: IntValue<'ctx>,
    to: IntValue<'ctx>,
    step: IntValue<'ctx>,
    init: &[V<'ctx>],
    mut body: impl FnMut(IntValue<'ctx>, &[V<'ctx>]) -> Result<Vec<V<'ctx>>, LlvmError>,
) -> Result<Vec<V<'ctx>>, LlvmError> {
    let before: BasicBlock = e.b.get_insert_block().expect("positioned");
    let header = e.ctx.append_basic_block(function, "loop");
    let inside = e.ctx.append_basic_block(function, "body");
    let after = e.ctx.append_basic_block(function, "done");
    e.b.build_unconditional_branch(header)?;
    e.b.position_at_end(header);
    let i64t = e.ctx.i64_type();
    let index = e.b.build_phi(i64t, "i")?;
    index.add_incoming(&[(&from, before)]);
    let mut phis = Vec::new();
    for v in init {
        let phi = e.b.build_phi(v.get_type(), "")?;
        phi.add_incoming(&[(v, before)]);
        phis.push(phi);
    }
    let i = index.as_basic_value().into_int_value();
    let carried: Vec<V<'ctx>> = phis.iter().map(|p| p.as_basic_value().into_vector_value()).collect();
    let more = e.b.build_int_compare(IntPredicate::SLT, i, to, "")?;
    e.b.build_conditional_branch(more, inside, after)?;
    e.b.position_at_end(inside);
    let next_values = body(i, &carried)?;
    let next = e.b.build_int_add(i, step, "")?;
    let latch = e.b.get_insert_block().expect("positioned");
    e.b.build_unconditional_branch(header)?;
    index.add_incoming(&[(&next, latch)]);
    for (phi, v) in phis.iter().zip(&next_values) {
        phi.add_incoming(&[(v, latch)]);
    }
    e.b.position_at_end(after);
    Ok(carried)
}
