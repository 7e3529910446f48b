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
use inkwell::values::{FunctionValue, IntValue};
use inkwell::{FloatPredicate, IntPredicate};

use crate::emit::{counted_loop, Emitter, V};
use crate::items::{Items, Signature, Target};
use crate::nvptx::if_then;
use crate::LlvmError;

/// The entry point of kernel `index` in a plan's PTX module.
pub fn entry_name(index: usize) -> String {
    format!("autotp_axis_{index}")
}

/// The shape of `kernel`'s entry: its buffers, then the fault words and the launch's tag if
/// it faults.
fn signature(kernel: &AxisKernel) -> Signature {
    let faults = usize::from(kernel.faults());
    Signature { pointers: kernel.buffer_bytes().len() + faults, words: faults, dtype: kernel.dtype }
}

/// `kernel`'s entry `symbol` for `target` (see the module doc).
pub(crate) fn define<'ctx>(
    e: &Emitter<'_, 'ctx>,
    symbol: &str,
    kernel: &AxisKernel,
    target: Target,
) -> Result<FunctionValue<'ctx>, LlvmError> {
    crate::items::define(e, symbol, target, signature(kernel), |items, w| Axis { items, kernel }.item(w))
}

/// One kernel's emitter over its entry's arguments: the builtin kernel's inputs, then its
/// outputs, then the fault words if it faults; the launch's tag then.
struct Axis<'x, 'ctx> {
    items: &'x Items<'x, 'x, 'ctx>,
    kernel: &'x AxisKernel,
}

impl<'ctx> Axis<'_, 'ctx> {
    fn item(&self, w: IntValue<'ctx>) -> Result<(), LlvmError> {
        match self.kernel.op {
            AxisOp::TopK { k, largest } => self.top_k(w, k, largest),
            AxisOp::ScatterElements { index_dtype } => self.scatter(w, index_dtype),
        }
    }

    /// Whether `(a, ia)` ranks before `(b, ib)` (see the module doc), one lane wide.
    fn before(&self, largest: bool, a: (V<'ctx>, V<'ctx>), b: (V<'ctx>, V<'ctx>)) -> Result<V<'ctx>, LlvmError> {
        let e = self.items.e;
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
        let (items, kernel) = (self.items, self.kernel);
        let e = items.e;
        let (input, values, indices) = (items.pointers[0], items.pointers[1], items.pointers[2]);
        let inner = items.constant(kernel.inner);
        let o = e.b.build_int_unsigned_div(w, inner, "")?;
        let i = e.b.build_int_unsigned_rem(w, inner, "")?;
        let row = e.b.build_int_add(e.b.build_int_mul(o, items.constant(kernel.len * kernel.inner), "")?, i, "")?;
        let out_row = e.b.build_int_add(e.b.build_int_mul(o, items.constant(k * kernel.inner), "")?, i, "")?;
        let at = |base: IntValue<'ctx>, r: IntValue<'ctx>| -> Result<IntValue<'ctx>, LlvmError> {
            Ok(e.b.build_int_add(base, e.b.build_int_mul(r, inner, "")?, "")?)
        };
        // No selection yet: index -1 (the value is never compared then, but is a defined one).
        let nothing = [items.value(input, row)?.get_type().const_zero(), e.i64(1, -1)];
        let (zero, one) = (items.constant(0), items.constant(1));
        counted_loop(e, items.function, zero, items.constant(k), one, &nothing, |j, previous| {
            let first = e.splat(e.b.build_int_compare(IntPredicate::EQ, j, zero, "")?.into(), 1)?;
            let previous = (previous[0], previous[1]);
            let best = counted_loop(e, items.function, zero, items.constant(kernel.len), one, &nothing, |r, best| {
                let candidate = (items.value(input, at(row, r)?)?, e.splat(r.into(), 1)?);
                let eligible = e.b.build_or(first, self.before(largest, previous, candidate)?, "")?;
                let unset = e.icmp(IntPredicate::SLT, best[1], e.i64(1, 0))?;
                let ahead = e.b.build_or(unset, self.before(largest, candidate, (best[0], best[1]))?, "")?;
                let take = e.b.build_and(eligible, ahead, "")?;
                Ok(vec![e.select(take, candidate.0, best[0])?, e.select(take, candidate.1, best[1])?])
            })?;
            let chosen = e.lane(best[1], 0)?.into_int_value();
            let raw = e.b.build_load(items.stored(), items.element(input, at(row, chosen)?, items.stored())?, "")?;
            e.b.build_store(items.element(values, at(out_row, j)?, items.stored())?, raw)?;
            e.b.build_store(items.element(indices, at(out_row, j)?, e.ctx.i64_type().into())?, chosen)?;
            Ok(best)
        })?;
        Ok(())
    }

    fn scatter(&self, w: IntValue<'ctx>, index_dtype: DType) -> Result<(), LlvmError> {
        let (items, kernel) = (self.items, self.kernel);
        let e = items.e;
        let (index_buffer, updates, out, fault) =
            (items.pointers[0], items.pointers[1], items.pointers[2], items.pointers[3]);
        let (inner, out_len) = (items.constant(kernel.inner), items.constant(kernel.out_len));
        let i = e.b.build_int_unsigned_rem(w, inner, "")?;
        let o_j = e.b.build_int_unsigned_div(w, inner, "")?;
        let j = e.b.build_int_unsigned_rem(o_j, out_len, "")?;
        let o = e.b.build_int_unsigned_div(o_j, out_len, "")?;
        let column = e.b.build_int_add(e.b.build_int_mul(o, items.constant(kernel.len * kernel.inner), "")?, i, "")?;
        let checks = e.b.build_int_compare(IntPredicate::EQ, j, items.constant(0), "")?;
        let zero = items.value(updates, column)?.get_type().const_zero();
        let (start, one) = (items.constant(0), items.constant(1));
        let sum = counted_loop(e, items.function, start, items.constant(kernel.len), one, &[zero], |r, sum| {
            let at = e.b.build_int_add(column, e.b.build_int_mul(r, inner, "")?, "")?;
            let raw = items.index(index_buffer, at, index_dtype)?;
            let (named, invalid) = items.resolved(raw, kernel.out_len)?;
            if_then(e, items.function, e.b.build_and(invalid, checks, "")?, || {
                items.report(fault, raw, items.words[0])
            })?;
            let same = e.splat(e.b.build_int_compare(IntPredicate::EQ, named, j, "")?.into(), 1)?;
            let added = e.fadd(sum[0], items.value(updates, at)?)?;
            Ok(vec![e.select(same, added, sum[0])?])
        })?;
        let out_at = e.b.build_int_add(e.b.build_int_mul(o_j, inner, "")?, i, "")?;
        e.b.build_store(items.element(out, out_at, items.stored())?, e.lane(sum[0], 0)?)?;
        Ok(())
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
    use crate::items::tests::bytes;
    use crate::Function;

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
