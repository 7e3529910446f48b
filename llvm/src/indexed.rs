//! Gathers and scatter-adds on the GPU: the embedding lookup and its gradient, whose rows an
//! index buffer picks (data-dependent addresses, which the kernel IR does not express).
//!
//! Over `[outer, indices, inner]`, as `autotp_kernels`' `gather` and `scatter_add`, with a table
//! of `held` rows starting at global row `start` of `global` (one rank's block of a
//! vocabulary-parallel table, or all of it): work item `w` (on blocks, striding over them) is
//! index row `(o, i)`; its `inner` elements run on the block's threads.
//! - gather: `out[o, i, :] = table[o, j - start, :]` where `j = indices[i]` (negative indices
//!   count back from `global`), zeros where another rank holds row `j`;
//! - scatter-add: the runtime zeroes the output first (in stream order); the work item of the
//!   first `i` naming row `j` writes the sum of `updates[o, i', :]` over every `i' >= i` naming
//!   `j`, in increasing `i'`, starting from 0: the CPU kernel's order, so its sums are
//!   bit-identical to the CPU's, and no atomics make them depend on timing.
//!
//! An index outside `[-global, global)` is an error on the CPU. Here its row is zeros (gather)
//! or skipped (scatter-add), and thread 0 stores the index and the launch's tag into the two
//! i64 at `fault` unless a tag is there already, which the runtime reads once the step's streams
//! are done, and reports.
//!
//! Entry `i` of a module is `autotp_indexed_<i>(a, b, out, fault, tag, start)`: `a`, `b` the
//! table and the indices (gather) or the indices and the updates (scatter-add); `tag` and
//! `start` i64, `start` the global index of the rank's first row (ranks of one plan share the
//! entry).

pub use autotp_kernels::indexed::{IndexedKernel, IndexedOp};
use autotp_kernels::DType;
use inkwell::values::{FunctionValue, IntValue, PointerValue};
use inkwell::{AddressSpace, IntPredicate};

use crate::emit::{counted_loop, Emitter};
use crate::nvptx::{if_then, special_register, Arch, BLOCK};
use crate::LlvmError;

/// The entry point of kernel `index` in a module made by [`ptx`].
pub fn entry_name(index: usize) -> String {
    format!("autotp_indexed_{index}")
}

/// The PTX of `kernels` for `arch`, kernel `i` as [`entry_name`]`(i)`.
pub fn ptx(kernels: &[IndexedKernel], arch: Arch) -> Result<String, LlvmError> {
    crate::nvptx::program_ptx(&crate::nvptx::GpuEntries { indexed: kernels, ..Default::default() }, arch)
}

/// The integer type of `dtype`'s size (2, 4 or 8 bytes, as [`IndexedKernel::of`] allows).
fn integer_of(ctx: &inkwell::context::Context, dtype: DType) -> inkwell::types::IntType<'_> {
    match dtype.size() {
        2 => ctx.i16_type(),
        4 => ctx.i32_type(),
        _ => ctx.i64_type(),
    }
}

pub(crate) fn define<'ctx>(
    e: &Emitter<'_, 'ctx>,
    symbol: &str,
    k: &IndexedKernel,
) -> Result<FunctionValue<'ctx>, LlvmError> {
    let (ctx, b) = (e.ctx, e.b);
    let (ptr, i64t) = (ctx.ptr_type(AddressSpace::default()), ctx.i64_type());
    let fn_type =
        ctx.void_type().fn_type(&[ptr.into(), ptr.into(), ptr.into(), ptr.into(), i64t.into(), i64t.into()], false);
    let function = e.module.add_function(symbol, fn_type, None);
    b.position_at_end(ctx.append_basic_block(function, "entry"));
    let pointer = |n: u32| function.get_nth_param(n).expect("declared").into_pointer_value();
    let (a, second, out, fault) = (pointer(0), pointer(1), pointer(2), pointer(3));
    let tag = function.get_nth_param(4).expect("declared").into_int_value();
    let start = function.get_nth_param(5).expect("declared").into_int_value();
    let c = |v: usize| i64t.const_int(v as u64, false);
    let thread = special_register(e, "tid.x")?;
    let block = special_register(e, "ctaid.x")?;
    let blocks = special_register(e, "nctaid.x")?;
    let indices = match k.op {
        IndexedOp::Gather => second,
        IndexedOp::ScatterAdd => a,
    };
    let index_type = integer_of(ctx, k.index_dtype);
    // The raw index `i` and the row it names (negatives counted back from `global`).
    let resolve = |i: IntValue<'ctx>| -> Result<(IntValue<'ctx>, IntValue<'ctx>), LlvmError> {
        // SAFETY (of the generated code): i < indices, the index buffer's length.
        let at = unsafe { b.build_in_bounds_gep(index_type, indices, &[i], "")? };
        let raw = b.build_load(index_type, at, "")?.into_int_value();
        let raw = b.build_int_s_extend_or_bit_cast(raw, i64t, "")?;
        let negative = b.build_int_compare(IntPredicate::SLT, raw, c(0), "")?;
        let wrapped = b.build_int_add(raw, c(k.global), "")?;
        Ok((raw, b.build_select(negative, wrapped, raw, "")?.into_int_value()))
    };
    let element = |buffer: PointerValue<'ctx>, index: IntValue<'ctx>, ty: inkwell::types::BasicTypeEnum<'ctx>| {
        // SAFETY (of the generated code): the callers' indices lie inside the buffers.
        unsafe { b.build_in_bounds_gep(ty, buffer, &[index], "") }
    };
    // The scatter-add's sums: f64 for f64, else f32; its elements in memory, and the
    // conversions between the two (16-bit elements widened on load, rounded once on store).
    let float = match k.dtype {
        DType::F64 => ctx.f64_type(),
        _ => ctx.f32_type(),
    };
    let sixteen_bit = matches!(k.dtype, DType::BF16 | DType::F16);
    let stored: inkwell::types::BasicTypeEnum<'ctx> = match sixteen_bit {
        true => e.memory_type(k.dtype, 1).get_element_type(),
        false => float.into(),
    };
    let widened = |raw: inkwell::values::BasicValueEnum<'ctx>| -> Result<_, LlvmError> {
        Ok(match sixteen_bit {
            true => e.lane(e.widen(k.dtype, e.splat(raw, 1)?)?, 0)?.into_float_value(),
            false => raw.into_float_value(),
        })
    };
    let narrowed = |value: inkwell::values::FloatValue<'ctx>| match sixteen_bit {
        true => e.lane(e.narrow(k.dtype, e.splat(value.into(), 1)?)?, 0),
        false => Ok(value.into()),
    };
    // Loop state of the scatter-add, promoted to registers by the optimiser.
    let named_before = b.build_alloca(ctx.bool_type(), "named_before")?;
    let sum = b.build_alloca(float, "sum")?;
    counted_loop(e, function, block, c(k.rows()), blocks, &[], |w, _| {
        let o = b.build_int_unsigned_div(w, c(k.indices), "")?;
        let i = b.build_int_unsigned_rem(w, c(k.indices), "")?;
        let (raw, row) = resolve(i)?;
        let valid = b.build_int_compare(IntPredicate::ULT, row, c(k.global), "")?;
        let invalid = b.build_not(valid, "")?;
        let first_thread = b.build_int_compare(IntPredicate::EQ, thread, c(0), "")?;
        if_then(e, function, b.build_and(invalid, first_thread, "")?, || {
            let tag_at = element(fault, c(1), i64t.into())?;
            let earlier = b.build_load(i64t, tag_at, "")?.into_int_value();
            if_then(e, function, b.build_int_compare(IntPredicate::EQ, earlier, c(0), "")?, || {
                b.build_store(fault, raw)?;
                b.build_store(tag_at, tag)?;
                Ok(())
            })
        })?;
        let local = b.build_int_sub(row, start, "")?;
        let held = b.build_and(valid, b.build_int_compare(IntPredicate::ULT, local, c(k.held), "")?, "")?;
        // The held row's first element (row `o * held + local` of the table or the output).
        let held_row =
            b.build_int_mul(b.build_int_add(b.build_int_mul(o, c(k.held), "")?, local, "")?, c(k.inner), "")?;
        match k.op {
            IndexedOp::Gather => {
                let bits = integer_of(ctx, k.dtype);
                let first = b.build_select(held, held_row, c(0), "")?.into_int_value();
                let out_row = b.build_int_mul(w, c(k.inner), "")?;
                counted_loop(e, function, thread, c(k.inner), c(BLOCK as usize), &[], |t, _| {
                    // A row this kernel does not hold reads element 0 (in bounds) and writes 0.
                    let from = b.build_select(held, b.build_int_add(first, t, "")?, c(0), "")?.into_int_value();
                    let value = b.build_load(bits, element(a, from, bits.into())?, "")?.into_int_value();
                    let value = b.build_select(held, value, bits.const_zero(), "")?;
                    b.build_store(element(out, b.build_int_add(out_row, t, "")?, bits.into())?, value)?;
                    Ok(vec![])
                })?;
            }
            IndexedOp::ScatterAdd => {
                if_then(e, function, held, || {
                    b.build_store(named_before, ctx.bool_type().const_zero())?;
                    counted_loop(e, function, c(0), i, c(1), &[], |earlier, _| {
                        let same = b.build_int_compare(IntPredicate::EQ, resolve(earlier)?.1, row, "")?;
                        let so_far = b.build_load(ctx.bool_type(), named_before, "")?.into_int_value();
                        b.build_store(named_before, b.build_or(so_far, same, "")?)?;
                        Ok(vec![])
                    })?;
                    let named = b.build_load(ctx.bool_type(), named_before, "")?.into_int_value();
                    if_then(e, function, b.build_not(named, "")?, || {
                        counted_loop(e, function, thread, c(k.inner), c(BLOCK as usize), &[], |t, _| {
                            b.build_store(sum, float.const_zero())?;
                            counted_loop(e, function, i, c(k.indices), c(1), &[], |later, _| {
                                let same = b.build_int_compare(IntPredicate::EQ, resolve(later)?.1, row, "")?;
                                if_then(e, function, same, || {
                                    let update_row =
                                        b.build_int_add(b.build_int_mul(o, c(k.indices), "")?, later, "")?;
                                    let at = b.build_int_add(b.build_int_mul(update_row, c(k.inner), "")?, t, "")?;
                                    let raw = b.build_load(stored, element(second, at, stored)?, "")?;
                                    let so_far = b.build_load(float, sum, "")?.into_float_value();
                                    b.build_store(sum, b.build_float_add(so_far, widened(raw)?, "")?)?;
                                    Ok(())
                                })?;
                                Ok(vec![])
                            })?;
                            let total = narrowed(b.build_load(float, sum, "")?.into_float_value())?;
                            let at = element(out, b.build_int_add(held_row, t, "")?, stored)?;
                            b.build_store(at, total)?;
                            Ok(vec![])
                        })?;
                        Ok(())
                    })
                })?;
            }
        }
        Ok(vec![])
    })?;
    b.build_return(None)?;
    Ok(function)
}

#[cfg(test)]
mod tests {
    use super::*;
    use autotp_kernels::{IndexBlock, Kernel};

    fn embedding(dtype: DType, block: Option<IndexBlock>) -> [Kernel; 2] {
        let shape = vec![50257, 768];
        [
            Kernel::Gather { dtype, index_dtype: DType::I64, data: shape.clone(), axis: 0, block },
            Kernel::ScatterAdd { dtype, index_dtype: DType::I64, out: shape, axis: 0, block },
        ]
    }

    #[test]
    fn embeddings_and_their_gradients_have_gpu_forms() {
        let block = IndexBlock { mesh_axis: 0, start: 25129, global_len: 50257 };
        let [gather, scatter] = embedding(DType::F32, Some(block));
        let got = IndexedKernel::of(&gather, 8192 * 8).unwrap();
        assert_eq!((got.outer, got.indices, got.inner, got.rows()), (1, 8192, 768, 8192));
        assert_eq!((IndexedKernel::start(&gather), got.held, got.global), (25129, 50257, 50257));
        assert_eq!(IndexedKernel::of(&scatter, 8192 * 8).unwrap().op, IndexedOp::ScatterAdd);
        let [gather16, scatter16] = embedding(DType::BF16, None);
        assert!(IndexedKernel::of(&gather16, 64).is_some());
        assert!(IndexedKernel::of(&scatter16, 64).is_some());
        let [gather8, scatter8] = [DType::U8, DType::I32].map(|dtype| embedding(dtype, None));
        assert!(IndexedKernel::of(&gather8[0], 64).is_none(), "a one-byte gather stays on the host");
        assert!(IndexedKernel::of(&scatter8[1], 64).is_none(), "an integer scatter-add stays on the host");
    }

    #[test]
    fn gathers_and_scatter_adds_become_ptx() {
        let kernels: Vec<IndexedKernel> = [DType::F32, DType::F64, DType::BF16, DType::F16]
            .into_iter()
            .flat_map(|dtype| embedding(dtype, None))
            .filter_map(|kernel| IndexedKernel::of(&kernel, 4096))
            .collect();
        assert_eq!(kernels.len(), 8);
        for arch in Arch::ALL {
            let ptx = ptx(&kernels, arch).unwrap();
            for i in 0..kernels.len() {
                assert!(ptx.contains(&format!(".entry {}(", entry_name(i))), "{ptx}");
            }
            // Sums in order, no atomics; no calls.
            assert!(!ptx.contains("atom.") && !ptx.contains("red.") && !ptx.contains("call"), "{ptx}");
            assert!(ptx.contains("add.rn.f32") || ptx.contains("add.f32"), "{ptx}");
        }
    }
}
