//! Top-k and scatter-elements ([`AxisKernel`]) for NVPTX, and for x86 so that the emulated GPU
//! runs the very code a GPU runs. One thread per work item, no shared memory and no atomics:
//!
//! - top-k: item `w` is row `(o, i)` of `[outer, len, inner]`. Selection `j` picks, among the
//!   elements ranked after selection `j - 1`, the first in rank, where `a` ranks before `b`
//!   when it is larger (smaller), NaN counting as the largest value, or equal with the lower
//!   index: the builtin kernel's stable sort, `k` scans of the row (`k` is a router's 1 to 8).
//!   Values are stored as the input's bits.
//! - scatter-elements: item `w` is output element `(o, j, i)`; it sums, from 0 in increasing
//!   `r`, the updates `(o, r, i)` whose index names `j`: the builtin kernel's order, so the
//!   sums are bit-identical to the CPU's. The items of `j = 0` check every index of their
//!   column; one outside `[-out_len, out_len)` is stored with the launch's tag in the fault
//!   words unless a tag is there already (as [`crate::indexed`] does), and names nothing.
//!
//! NVPTX: entry `autotp_axis_<i>(buffers..., [fault, tag,] items)`, the builtin kernel's inputs
//! then outputs, items on a grid-stride loop of threads. x86: `void k(u64* args, i64 begin,
//! i64 end)` with `args` the same words but `items`, running items `begin..end`.

pub use autotp_kernels::axis::{AxisKernel, AxisOp};
use autotp_kernels::DType;
use inkwell::types::{BasicMetadataTypeEnum, BasicTypeEnum};
use inkwell::values::{FunctionValue, IntValue, PointerValue};
use inkwell::{AddressSpace, FloatPredicate, IntPredicate};

use crate::emit::{counted_loop, Emitter, V};
use crate::nvptx::{if_then, special_register, BLOCK};
use crate::LlvmError;

/// The entry point of kernel `index` in a plan's PTX module.
pub fn entry_name(index: usize) -> String {
    format!("autotp_axis_{index}")
}

/// The pointer arguments of `kernel`'s entry: its buffers, then the fault words if it faults.
fn pointer_count(kernel: &AxisKernel) -> usize {
    kernel.buffer_bytes().len() + usize::from(kernel.faults())
}

/// The x86 form (see the module doc).
pub(crate) fn define_cpu<'ctx>(
    e: &Emitter<'_, 'ctx>,
    symbol: &str,
    kernel: &AxisKernel,
) -> Result<FunctionValue<'ctx>, LlvmError> {
    let i64t = e.ctx.i64_type();
    let entry = crate::cpu::CpuEntry::declare(e, symbol)?;
    let (function, begin, end) = (entry.function, entry.begin, entry.end);
    let pointers = (0..pointer_count(kernel)).map(|n| entry.pointer(e, n)).collect::<Result<_, LlvmError>>()?;
    let tag = match kernel.faults() {
        true => entry.word(e, pointer_count(kernel), i64t.into())?.into_int_value(),
        false => i64t.const_zero(),
    };
    let emitter = Axis { e, function, kernel, pointers, tag };
    counted_loop(e, function, begin, end, i64t.const_int(1, false), &[], |w, _| {
        emitter.item(w)?;
        Ok(vec![])
    })?;
    e.b.build_return(None)?;
    Ok(function)
}

/// The NVPTX form (see the module doc).
pub(crate) fn define_nvptx<'ctx>(
    e: &Emitter<'_, 'ctx>,
    symbol: &str,
    kernel: &AxisKernel,
) -> Result<FunctionValue<'ctx>, LlvmError> {
    let (ptr, i64t) = (e.ctx.ptr_type(AddressSpace::default()), e.ctx.i64_type());
    let mut params: Vec<BasicMetadataTypeEnum> = vec![ptr.into(); pointer_count(kernel)];
    if kernel.faults() {
        params.push(i64t.into());
    }
    params.push(i64t.into());
    let function = e.module.add_function(symbol, e.ctx.void_type().fn_type(&params, false), None);
    e.b.position_at_end(e.ctx.append_basic_block(function, "entry"));
    let param = |n: usize| function.get_nth_param(n as u32).expect("declared");
    let pointers = (0..pointer_count(kernel)).map(|n| param(n).into_pointer_value()).collect();
    let tag = match kernel.faults() {
        true => param(pointer_count(kernel)).into_int_value(),
        false => i64t.const_zero(),
    };
    let items = param(params.len() - 1).into_int_value();
    let block = i64t.const_int(BLOCK as u64, false);
    let thread = special_register(e, "tid.x")?;
    let first = e.b.build_int_add(e.b.build_int_mul(special_register(e, "ctaid.x")?, block, "")?, thread, "")?;
    let stride = e.b.build_int_mul(special_register(e, "nctaid.x")?, block, "")?;
    let emitter = Axis { e, function, kernel, pointers, tag };
    counted_loop(e, function, first, items, stride, &[], |w, _| {
        emitter.item(w)?;
        Ok(vec![])
    })?;
    e.b.build_return(None)?;
    Ok(function)
}

/// One kernel's emitter over its entry's pointers.
struct Axis<'a, 'b, 'ctx> {
    e: &'a Emitter<'b, 'ctx>,
    function: FunctionValue<'ctx>,
    kernel: &'a AxisKernel,
    /// The builtin kernel's inputs, then its outputs, then the fault words if it faults.
    pointers: Vec<PointerValue<'ctx>>,
    tag: IntValue<'ctx>,
}

impl<'ctx> Axis<'_, '_, 'ctx> {
    fn constant(&self, v: usize) -> IntValue<'ctx> {
        self.e.ctx.i64_type().const_int(v as u64, false)
    }

    /// The address of element `index` of `buffer`, of `ty`.
    fn element(
        &self,
        buffer: PointerValue<'ctx>,
        index: IntValue<'ctx>,
        ty: BasicTypeEnum<'ctx>,
    ) -> Result<PointerValue<'ctx>, LlvmError> {
        // SAFETY (of the generated code): every index is inside its buffer by construction of
        // the item's coordinates (`AxisKernel::buffer_bytes`).
        Ok(unsafe { self.e.b.build_in_bounds_gep(ty, buffer, &[index], "")? })
    }

    /// How the kernel's values sit in memory.
    fn stored(&self) -> BasicTypeEnum<'ctx> {
        match self.kernel.dtype {
            DType::F64 => self.e.ctx.f64_type().into(),
            other => self.e.memory_type(other, 1).get_element_type(),
        }
    }

    /// Element `index` of `buffer` as the value compared or summed (16-bit floats widened to
    /// f32), one lane wide.
    fn value(&self, buffer: PointerValue<'ctx>, index: IntValue<'ctx>) -> Result<V<'ctx>, LlvmError> {
        let raw = self.e.b.build_load(self.stored(), self.element(buffer, index, self.stored())?, "")?;
        let raw = self.e.splat(raw, 1)?;
        match self.kernel.dtype {
            DType::F64 | DType::F32 => Ok(raw),
            other => self.e.widen(other, raw),
        }
    }

    fn item(&self, w: IntValue<'ctx>) -> Result<(), LlvmError> {
        match self.kernel.op {
            AxisOp::TopK { k, largest } => self.top_k(w, k, largest),
            AxisOp::ScatterElements { index_dtype } => self.scatter(w, index_dtype),
        }
    }

    /// Whether `(a, ia)` ranks before `(b, ib)` (see the module doc), one lane wide.
    fn before(&self, largest: bool, a: (V<'ctx>, V<'ctx>), b: (V<'ctx>, V<'ctx>)) -> Result<V<'ctx>, LlvmError> {
        let e = self.e;
        let (a_nan, b_nan) = (e.fcmp(FloatPredicate::UNO, a.0, a.0)?, e.fcmp(FloatPredicate::UNO, b.0, b.0)?);
        let or = |x: V<'ctx>, y: V<'ctx>| -> Result<V<'ctx>, LlvmError> { Ok(e.b.build_or(x, y, "")?) };
        let and = |x: V<'ctx>, y: V<'ctx>| -> Result<V<'ctx>, LlvmError> { Ok(e.b.build_and(x, y, "")?) };
        let not = |x: V<'ctx>| -> Result<V<'ctx>, LlvmError> { Ok(e.b.build_not(x, "")?) };
        // Strictly before by value, NaN the largest.
        let ahead = match largest {
            true => or(and(a_nan, not(b_nan)?)?, e.fcmp(FloatPredicate::OGT, a.0, b.0)?)?,
            false => or(and(not(a_nan)?, b_nan)?, e.fcmp(FloatPredicate::OLT, a.0, b.0)?)?,
        };
        let equal = or(and(a_nan, b_nan)?, e.fcmp(FloatPredicate::OEQ, a.0, b.0)?)?;
        let lower = e.icmp(IntPredicate::SLT, a.1, b.1)?;
        or(ahead, and(equal, lower)?)
    }

    fn top_k(&self, w: IntValue<'ctx>, k: usize, largest: bool) -> Result<(), LlvmError> {
        let (e, kernel) = (self.e, self.kernel);
        let (input, values, indices) = (self.pointers[0], self.pointers[1], self.pointers[2]);
        let inner = self.constant(kernel.inner);
        let o = e.b.build_int_unsigned_div(w, inner, "")?;
        let i = e.b.build_int_unsigned_rem(w, inner, "")?;
        let row = e.b.build_int_add(e.b.build_int_mul(o, self.constant(kernel.len * kernel.inner), "")?, i, "")?;
        let out_row = e.b.build_int_add(e.b.build_int_mul(o, self.constant(k * kernel.inner), "")?, i, "")?;
        let at = |base: IntValue<'ctx>, r: IntValue<'ctx>| -> Result<IntValue<'ctx>, LlvmError> {
            Ok(e.b.build_int_add(base, e.b.build_int_mul(r, inner, "")?, "")?)
        };
        // No selection yet: index -1 (the value is never compared then, but is a defined one).
        let nothing = [self.value(input, row)?.get_type().const_zero(), e.i64(1, -1)];
        let (zero, one) = (self.constant(0), self.constant(1));
        counted_loop(e, self.function, zero, self.constant(k), one, &nothing, |j, previous| {
            let first = e.splat(e.b.build_int_compare(IntPredicate::EQ, j, zero, "")?.into(), 1)?;
            let previous = (previous[0], previous[1]);
            let best = counted_loop(e, self.function, zero, self.constant(kernel.len), one, &nothing, |r, best| {
                let candidate = (self.value(input, at(row, r)?)?, e.splat(r.into(), 1)?);
                let eligible = e.b.build_or(first, self.before(largest, previous, candidate)?, "")?;
                let unset = e.icmp(IntPredicate::SLT, best[1], e.i64(1, 0))?;
                let ahead = e.b.build_or(unset, self.before(largest, candidate, (best[0], best[1]))?, "")?;
                let take = e.b.build_and(eligible, ahead, "")?;
                Ok(vec![e.select(take, candidate.0, best[0])?, e.select(take, candidate.1, best[1])?])
            })?;
            let chosen = e.lane(best[1], 0)?.into_int_value();
            let raw = e.b.build_load(self.stored(), self.element(input, at(row, chosen)?, self.stored())?, "")?;
            e.b.build_store(self.element(values, at(out_row, j)?, self.stored())?, raw)?;
            e.b.build_store(self.element(indices, at(out_row, j)?, e.ctx.i64_type().into())?, chosen)?;
            Ok(best)
        })?;
        Ok(())
    }

    fn scatter(&self, w: IntValue<'ctx>, index_dtype: DType) -> Result<(), LlvmError> {
        let (e, kernel) = (self.e, self.kernel);
        let (index_buffer, updates, out, fault) =
            (self.pointers[0], self.pointers[1], self.pointers[2], self.pointers[3]);
        let (inner, out_len) = (self.constant(kernel.inner), self.constant(kernel.out_len));
        let i = e.b.build_int_unsigned_rem(w, inner, "")?;
        let o_j = e.b.build_int_unsigned_div(w, inner, "")?;
        let j = e.b.build_int_unsigned_rem(o_j, out_len, "")?;
        let o = e.b.build_int_unsigned_div(o_j, out_len, "")?;
        let column = e.b.build_int_add(e.b.build_int_mul(o, self.constant(kernel.len * kernel.inner), "")?, i, "")?;
        let index_type = match index_dtype {
            DType::I32 => e.ctx.i32_type(),
            _ => e.ctx.i64_type(),
        };
        let checks = e.b.build_int_compare(IntPredicate::EQ, j, self.constant(0), "")?;
        let zero = self.value(updates, column)?.get_type().const_zero();
        let (start, one) = (self.constant(0), self.constant(1));
        let sum = counted_loop(e, self.function, start, self.constant(kernel.len), one, &[zero], |r, sum| {
            let at = e.b.build_int_add(column, e.b.build_int_mul(r, inner, "")?, "")?;
            let raw = e.b.build_load(index_type, self.element(index_buffer, at, index_type.into())?, "")?;
            let raw = e.b.build_int_s_extend_or_bit_cast(raw.into_int_value(), e.ctx.i64_type(), "")?;
            let negative = e.b.build_int_compare(IntPredicate::SLT, raw, self.constant(0), "")?;
            let wrapped = e.b.build_int_add(raw, out_len, "")?;
            let named = e.b.build_select(negative, wrapped, raw, "")?.into_int_value();
            let invalid = e.b.build_int_compare(IntPredicate::UGE, named, out_len, "")?;
            if_then(e, self.function, e.b.build_and(invalid, checks, "")?, || self.report(fault, raw))?;
            let same = e.splat(e.b.build_int_compare(IntPredicate::EQ, named, j, "")?.into(), 1)?;
            let added = e.fadd(sum[0], self.value(updates, at)?)?;
            Ok(vec![e.select(same, added, sum[0])?])
        })?;
        let out_at = e.b.build_int_add(e.b.build_int_mul(o_j, inner, "")?, i, "")?;
        e.b.build_store(self.element(out, out_at, self.stored())?, e.lane(sum[0], 0)?)?;
        Ok(())
    }

    /// Stores `index` and the launch's tag in the fault words unless a tag is there already.
    fn report(&self, fault: PointerValue<'ctx>, index: IntValue<'ctx>) -> Result<(), LlvmError> {
        let e = self.e;
        let i64t = e.ctx.i64_type();
        let tag_at = self.element(fault, self.constant(1), i64t.into())?;
        let earlier = e.b.build_load(i64t, tag_at, "")?.into_int_value();
        if_then(e, self.function, e.b.build_int_compare(IntPredicate::EQ, earlier, self.constant(0), "")?, || {
            e.b.build_store(fault, index)?;
            e.b.build_store(tag_at, self.tag)?;
            Ok(())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use autotp_kernels::Kernel;

    #[test]
    fn routing_kernels_become_ptx() {
        let kernels: Vec<AxisKernel> = [
            Kernel::TopK { dtype: DType::BF16, outer: 512, len: 8, inner: 1, k: 2, largest: true },
            Kernel::TopK { dtype: DType::F64, outer: 4, len: 5, inner: 3, k: 5, largest: false },
            Kernel::ScatterElements {
                dtype: DType::F32,
                index_dtype: DType::I32,
                updates: vec![512, 2],
                out: vec![512, 8],
                axis: 1,
            },
        ]
        .iter()
        .map(|k| AxisKernel::of(k).unwrap())
        .collect();
        for arch in crate::nvptx::Arch::ALL {
            let entries = crate::nvptx::GpuEntries { axis: &kernels, ..Default::default() };
            let ptx = crate::nvptx::program_ptx(&entries, arch).unwrap();
            for i in 0..kernels.len() {
                assert!(ptx.contains(&format!(".entry {}(", entry_name(i))), "{ptx}");
            }
            // Sums in order, no atomics; no calls.
            assert!(!ptx.contains("atom.") && !ptx.contains("red.") && !ptx.contains("call"), "{ptx}");
        }
    }
}

#[cfg(test)]
mod x86 {
    use autotp_kernels::{AlignedBuf, DType, Kernel};

    use super::AxisKernel;
    use crate::Function;

    /// `values` as `dtype`'s bytes (bf16: the high half of each f32, exact for these values).
    fn bytes(dtype: DType, values: &[f64]) -> AlignedBuf {
        let raw: Vec<u8> = match dtype {
            DType::F64 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
            DType::F32 => values.iter().flat_map(|&v| (v as f32).to_le_bytes()).collect(),
            DType::BF16 => values.iter().flat_map(|&v| (((v as f32).to_bits() >> 16) as u16).to_le_bytes()).collect(),
            DType::I32 => values.iter().flat_map(|&v| (v as i32).to_le_bytes()).collect(),
            _ => values.iter().flat_map(|&v| (v as i64).to_le_bytes()).collect(),
        };
        AlignedBuf::from_bytes(&raw)
    }

    /// Runs `kernel`'s generated x86 form over `inputs` (items in two calls, as a pool splits
    /// them) and returns its outputs and fault words.
    fn generated(kernel: &AxisKernel, inputs: &[AlignedBuf], tag: u64) -> (Vec<AlignedBuf>, [i64; 2]) {
        let entry = crate::compile_cpu_functions(&[Function::Axis(kernel)]).unwrap().remove(0);
        let sizes = kernel.buffer_bytes();
        let mut outputs: Vec<AlignedBuf> = sizes[inputs.len()..].iter().map(|&n| AlignedBuf::zeroed(n)).collect();
        let mut fault = [0i64; 2];
        let mut words: Vec<*mut u8> = inputs.iter().map(|b| b.as_slice().as_ptr() as *mut u8).collect();
        words.extend(outputs.iter_mut().map(|b| b.as_mut_slice().as_mut_ptr()));
        if kernel.faults() {
            words.push(fault.as_mut_ptr() as *mut u8);
            words.push(tag as *mut u8);
        }
        let items = kernel.items();
        // SAFETY: the buffers have the kernel's sizes; the tag word is read as an integer.
        unsafe {
            entry.run(&words, 0..items / 2);
            entry.run(&words, items / 2..items);
        }
        (outputs, fault)
    }

    fn builtin(kernel: &Kernel, inputs: &[AlignedBuf], outputs: &[usize]) -> Result<Vec<AlignedBuf>, String> {
        let mut out: Vec<AlignedBuf> = outputs.iter().map(|&n| AlignedBuf::zeroed(n)).collect();
        let ins: Vec<&[u8]> = inputs.iter().map(AlignedBuf::as_slice).collect();
        let mut outs: Vec<&mut [u8]> = out.iter_mut().map(AlignedBuf::as_mut_slice).collect();
        kernel.run(&ins, &mut outs).map_err(|e| e.to_string())?;
        Ok(out)
    }

    /// Top-k of rows with many ties and NaNs, largest and smallest, over f32, f64 and bf16,
    /// middle and last axes: the builtin kernel's values and indices, bit for bit.
    #[test]
    fn generated_top_k_is_the_builtin_kernel() {
        for dtype in [DType::F32, DType::F64, DType::BF16] {
            for (outer, len, inner, k) in [(37, 8, 1, 2), (5, 9, 3, 9), (4, 1, 2, 1)] {
                for largest in [true, false] {
                    let n = outer * len * inner;
                    let values: Vec<f64> = (0..n)
                        .map(|i| if i % 11 == 3 { f64::NAN } else { ((i * 7919) % 5) as f64 * 0.5 - 1.0 })
                        .collect();
                    let kernel = Kernel::TopK { dtype, outer, len, inner, k, largest };
                    let form = AxisKernel::of(&kernel).unwrap();
                    let input = [bytes(dtype, &values)];
                    let want = builtin(&kernel, &input, &form.buffer_bytes()[1..]).unwrap();
                    let (got, _) = generated(&form, &input, 0);
                    for (name, (w, g)) in ["values", "indices"].iter().zip(want.iter().zip(&got)) {
                        assert!(
                            w.as_slice() == g.as_slice(),
                            "{dtype} {outer}x{len}x{inner} top-{k} {largest}: {name}"
                        );
                    }
                }
            }
        }
    }

    /// Scatter-elements with repeated and negative indices (i64 and i32) over f32 and f64 sums
    /// bit for bit as the builtin kernel; an index out of range lands in the fault words with
    /// the launch's tag, where the builtin kernel refuses it.
    #[test]
    fn generated_scatter_elements_is_the_builtin_kernel() {
        for (dtype, index_dtype) in [(DType::F32, DType::I64), (DType::F64, DType::I32)] {
            for (updates, out, axis) in [(vec![33, 2], vec![33, 8], 1), (vec![3, 5, 4], vec![3, 7, 4], 1)] {
                let n: usize = updates.iter().product();
                let out_len = out[axis] as i64;
                let indices: Vec<f64> = (0..n as i64).map(|i| ((i * 13) % (2 * out_len) - out_len) as f64).collect();
                let values: Vec<f64> = (0..n).map(|i| ((i * 7919) % 1000) as f64 * 1e-3 - 0.37).collect();
                let kernel = Kernel::ScatterElements { dtype, index_dtype, updates, out, axis };
                let form = AxisKernel::of(&kernel).unwrap();
                let mut inputs = [bytes(index_dtype, &indices), bytes(dtype, &values)];
                let want = builtin(&kernel, &inputs, &form.buffer_bytes()[2..]).unwrap();
                let (got, fault) = generated(&form, &inputs, 7);
                assert!(want[0].as_slice() == got[0].as_slice(), "{dtype} {index_dtype} {kernel:?}");
                assert_eq!(fault, [0, 0], "no index out of range");

                let mut bad = indices.clone();
                bad[n / 2] = out_len as f64;
                inputs[0] = bytes(index_dtype, &bad);
                let refused = builtin(&kernel, &inputs, &form.buffer_bytes()[2..]).unwrap_err();
                assert!(refused.contains(&format!("index {out_len} is out of range")), "{refused}");
                let (_, fault) = generated(&form, &inputs, 7);
                assert_eq!(fault, [out_len, 7], "{dtype} {index_dtype}: the index and the tag");
            }
        }
    }
}
