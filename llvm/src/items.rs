//! Kernels of one thread per work item, no shared memory and no atomics ([`crate::axis`]'s
//! top-ks and scatter-elements, [`crate::grouped`]'s expert GEMMs): their two entries, and
//! what their items share (element addresses, values widened to the type computed, the fault
//! words).
//!
//! An entry takes pointers (the builtin kernel's buffers, then any fault words) and integer
//! words (a launch's tag, a rank's first row):
//! - NVPTX: `entry(pointers..., words..., items)`, items on a grid-stride loop of threads;
//! - x86: `void k(u64* args, i64 begin, i64 end)` with `args` the pointers then the words,
//!   running items `begin..end`.

use autotp_kernels::DType;
use inkwell::types::{BasicMetadataTypeEnum, BasicTypeEnum};
use inkwell::values::{FunctionValue, IntValue, PointerValue};
use inkwell::{AddressSpace, IntPredicate};

use crate::emit::{counted_loop, Emitter, V};
use crate::nvptx::{if_then, special_register, BLOCK};
use crate::LlvmError;

/// One entry's arguments, as its items read them.
pub(crate) struct Items<'a, 'b, 'ctx> {
    pub e: &'a Emitter<'b, 'ctx>,
    pub function: FunctionValue<'ctx>,
    /// The type of the values the kernel loads and stores (16-bit floats computed in f32).
    pub dtype: DType,
    pub pointers: Vec<PointerValue<'ctx>>,
    pub words: Vec<IntValue<'ctx>>,
}

/// The shape of an entry: its pointers, integer words and value type.
pub(crate) struct Signature {
    pub pointers: usize,
    pub words: usize,
    pub dtype: DType,
}

/// Which of the two entries to make.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Target {
    Cpu,
    Nvptx,
}

/// The entry `symbol` for `target`, running `item` on each of its items (see the module doc).
pub(crate) fn define<'ctx>(
    e: &Emitter<'_, 'ctx>,
    symbol: &str,
    target: Target,
    signature: Signature,
    item: impl Fn(&Items<'_, '_, 'ctx>, IntValue<'ctx>) -> Result<(), LlvmError>,
) -> Result<FunctionValue<'ctx>, LlvmError> {
    match target {
        Target::Cpu => define_cpu(e, symbol, signature, item),
        Target::Nvptx => define_nvptx(e, symbol, signature, item),
    }
}

/// The x86 entry.
fn define_cpu<'ctx>(
    e: &Emitter<'_, 'ctx>,
    symbol: &str,
    signature: Signature,
    item: impl Fn(&Items<'_, '_, 'ctx>, IntValue<'ctx>) -> Result<(), LlvmError>,
) -> Result<FunctionValue<'ctx>, LlvmError> {
    let i64t = e.ctx.i64_type();
    let entry = crate::cpu::CpuEntry::declare(e, symbol)?;
    let pointers = (0..signature.pointers).map(|n| entry.pointer(e, n)).collect::<Result<_, LlvmError>>()?;
    let words = (signature.pointers..signature.pointers + signature.words)
        .map(|n| Ok(entry.word(e, n, i64t.into())?.into_int_value()))
        .collect::<Result<_, LlvmError>>()?;
    let items = Items { e, function: entry.function, dtype: signature.dtype, pointers, words };
    counted_loop(e, entry.function, entry.begin, entry.end, i64t.const_int(1, false), &[], |w, _| {
        item(&items, w)?;
        Ok(vec![])
    })?;
    e.b.build_return(None)?;
    Ok(entry.function)
}

/// The NVPTX entry.
fn define_nvptx<'ctx>(
    e: &Emitter<'_, 'ctx>,
    symbol: &str,
    signature: Signature,
    item: impl Fn(&Items<'_, '_, 'ctx>, IntValue<'ctx>) -> Result<(), LlvmError>,
) -> Result<FunctionValue<'ctx>, LlvmError> {
    let (ptr, i64t) = (e.ctx.ptr_type(AddressSpace::default()), e.ctx.i64_type());
    let mut params: Vec<BasicMetadataTypeEnum> = vec![ptr.into(); signature.pointers];
    params.extend(vec![BasicMetadataTypeEnum::from(i64t); signature.words + 1]);
    let function = e.module.add_function(symbol, e.ctx.void_type().fn_type(&params, false), None);
    e.b.position_at_end(e.ctx.append_basic_block(function, "entry"));
    let param = |n: usize| function.get_nth_param(n as u32).expect("declared");
    let pointers = (0..signature.pointers).map(|n| param(n).into_pointer_value()).collect();
    let words = (signature.pointers..signature.pointers + signature.words).map(|n| param(n).into_int_value()).collect();
    let count = param(params.len() - 1).into_int_value();
    let block = i64t.const_int(BLOCK as u64, false);
    let thread = special_register(e, "tid.x")?;
    let first = e.b.build_int_add(e.b.build_int_mul(special_register(e, "ctaid.x")?, block, "")?, thread, "")?;
    let stride = e.b.build_int_mul(special_register(e, "nctaid.x")?, block, "")?;
    let items = Items { e, function, dtype: signature.dtype, pointers, words };
    counted_loop(e, function, first, count, stride, &[], |w, _| {
        item(&items, w)?;
        Ok(vec![])
    })?;
    e.b.build_return(None)?;
    Ok(function)
}

impl<'ctx> Items<'_, '_, 'ctx> {
    pub fn constant(&self, v: usize) -> IntValue<'ctx> {
        self.e.ctx.i64_type().const_int(v as u64, false)
    }

    /// The address of element `index` of `buffer`, of `ty`.
    pub fn element(
        &self,
        buffer: PointerValue<'ctx>,
        index: IntValue<'ctx>,
        ty: BasicTypeEnum<'ctx>,
    ) -> Result<PointerValue<'ctx>, LlvmError> {
        // SAFETY (of the generated code): every kernel's items index inside their buffers by
        // construction of their coordinates (its `buffer_bytes`).
        Ok(unsafe { self.e.b.build_in_bounds_gep(ty, buffer, &[index], "")? })
    }

    /// How the kernel's values sit in memory.
    pub fn stored(&self) -> BasicTypeEnum<'ctx> {
        match self.dtype {
            DType::F64 => self.e.ctx.f64_type().into(),
            other => self.e.memory_type(other, 1).get_element_type(),
        }
    }

    /// Element `index` of `buffer` as the value computed with (16-bit floats widened to f32),
    /// one lane wide.
    pub fn value(&self, buffer: PointerValue<'ctx>, index: IntValue<'ctx>) -> Result<V<'ctx>, LlvmError> {
        let raw = self.e.b.build_load(self.stored(), self.element(buffer, index, self.stored())?, "")?;
        let raw = self.e.splat(raw, 1)?;
        match self.dtype {
            DType::F64 | DType::F32 => Ok(raw),
            other => self.e.widen(other, raw),
        }
    }

    /// Stores `value` (rounded to a 16-bit type) as element `index` of `buffer`.
    pub fn store(&self, buffer: PointerValue<'ctx>, index: IntValue<'ctx>, value: V<'ctx>) -> Result<(), LlvmError> {
        let e = self.e;
        let stored = match self.dtype {
            DType::F64 | DType::F32 => value,
            other => e.narrow(other, value)?,
        };
        e.b.build_store(self.element(buffer, index, self.stored())?, e.lane(stored, 0)?)?;
        Ok(())
    }

    /// 0 in the type computed with.
    pub fn zero(&self) -> V<'ctx> {
        match self.dtype {
            DType::F64 => self.e.ctx.f64_type().vec_type(1).const_zero(),
            _ => self.e.f32(1, 0.0),
        }
    }

    /// `then()` where `condition` holds, `otherwise` where not, branching around `then`'s work.
    pub fn if_taken(
        &self,
        condition: IntValue<'ctx>,
        otherwise: V<'ctx>,
        then: impl FnOnce() -> Result<V<'ctx>, LlvmError>,
    ) -> Result<V<'ctx>, LlvmError> {
        let e = self.e;
        let before = e.b.get_insert_block().expect("positioned");
        let taken = e.ctx.append_basic_block(self.function, "taken");
        let after = e.ctx.append_basic_block(self.function, "joined");
        e.b.build_conditional_branch(condition, taken, after)?;
        e.b.position_at_end(taken);
        let value = then()?;
        let taken_end = e.b.get_insert_block().expect("positioned");
        e.b.build_unconditional_branch(after)?;
        e.b.position_at_end(after);
        let phi = e.b.build_phi(value.get_type(), "")?;
        phi.add_incoming(&[(&value, taken_end), (&otherwise, before)]);
        Ok(phi.as_basic_value().into_vector_value())
    }

    /// Index `at` of an index buffer of `index_dtype` (i64 or i32), as an i64.
    pub fn index(
        &self,
        buffer: PointerValue<'ctx>,
        at: IntValue<'ctx>,
        index_dtype: DType,
    ) -> Result<IntValue<'ctx>, LlvmError> {
        let (e, i64t) = (self.e, self.e.ctx.i64_type());
        let index_type = match index_dtype {
            DType::I32 => e.ctx.i32_type(),
            _ => i64t,
        };
        let raw = e.b.build_load(index_type, self.element(buffer, at, index_type.into())?, "")?;
        Ok(e.b.build_int_s_extend_or_bit_cast(raw.into_int_value(), i64t, "")?)
    }

    /// The position `raw` names along an axis of `bound` (negatives counted back from it), and
    /// whether it lies outside the axis (then the position is at least `bound`, unsigned).
    pub fn resolved(&self, raw: IntValue<'ctx>, bound: usize) -> Result<(IntValue<'ctx>, IntValue<'ctx>), LlvmError> {
        let e = self.e;
        let negative = e.b.build_int_compare(IntPredicate::SLT, raw, self.constant(0), "")?;
        let wrapped = e.b.build_int_add(raw, self.constant(bound), "")?;
        let named = e.b.build_select(negative, wrapped, raw, "")?.into_int_value();
        let outside = e.b.build_int_compare(IntPredicate::UGE, named, self.constant(bound), "")?;
        Ok((named, outside))
    }

    /// Stores `index` and `tag` in the two i64 at `fault` unless a tag is there already.
    pub fn report(
        &self,
        fault: PointerValue<'ctx>,
        index: IntValue<'ctx>,
        tag: IntValue<'ctx>,
    ) -> Result<(), LlvmError> {
        let e = self.e;
        let i64t = e.ctx.i64_type();
        let tag_at = self.element(fault, self.constant(1), i64t.into())?;
        let earlier = e.b.build_load(i64t, tag_at, "")?.into_int_value();
        if_then(e, self.function, e.b.build_int_compare(IntPredicate::EQ, earlier, self.constant(0), "")?, || {
            e.b.build_store(fault, index)?;
            e.b.build_store(tag_at, tag)?;
            Ok(())
        })
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use autotp_kernels::{AlignedBuf, DType};

    /// `values` as `dtype`'s bytes (bf16: the high half of each f32, exact for the tests' values
    /// of few bits).
    pub(crate) fn bytes(dtype: DType, values: &[f64]) -> AlignedBuf {
        let raw: Vec<u8> = match dtype {
            DType::F64 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
            DType::F32 => values.iter().flat_map(|&v| (v as f32).to_le_bytes()).collect(),
            DType::BF16 => values.iter().flat_map(|&v| (((v as f32).to_bits() >> 16) as u16).to_le_bytes()).collect(),
            DType::I32 => values.iter().flat_map(|&v| (v as i32).to_le_bytes()).collect(),
            _ => values.iter().flat_map(|&v| (v as i64).to_le_bytes()).collect(),
        };
        AlignedBuf::from_bytes(&raw)
    }
}
