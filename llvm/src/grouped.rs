//! The grouped expert GEMM ([`GroupedKernel`]) for NVPTX, and for x86 to test it against the
//! builtin kernel. One thread per work item, no shared memory and no atomics:
//!
//! - gathered: item `w = q * width + r` is element `r` of pair `q`'s product: the sum, over `kk`
//!   in increasing order, of element `(kk, r)` of the pair's expert's matrix read in place
//!   (`GroupedDims::factor_strides`) times `v[q, kk]`; zero where another rank holds the expert;
//! - scattered: item `w` is element `(i, j)` of held expert `e`'s sum: over the pairs in
//!   increasing `q` whose id names `e`, `lhs[q, i] * rhs[q, j]`.
//!
//! Each sum is fused multiply-adds from 0, in f32 (16-bit values widened, the sum rounded once)
//! or f64. The builtin kernel adds in its GEMM's order, so the two agree within rounding, not
//! bit for bit, and the emulated GPU runs the builtin kernel (a plan trains on it as on the CPU,
//! bit for bit). Pairs whose vector is zero (expert parallelism's padding) need no skipping:
//! their products are zeros wherever the weights are finite. A scattered item reads every id,
//! and the pairs of its own expert's vectors.
//!
//! An id outside `[-global, global)` is an error on the CPU. Here it names no expert, and the
//! items that check it (the first element of its pair's product; item 0 of the scattered form,
//! which reads every id) store it and the launch's tag into the two i64 at `fault` unless a tag
//! is there already, as [`crate::indexed`] does.
//!
//! NVPTX: entry `autotp_grouped_<i>(in0, in1, in2, out, fault, tag, start, items)`, the builtin
//! kernel's three inputs and its output, `start` the first expert the rank holds (ranks of one
//! plan share the entry), items on a grid-stride loop of threads. x86: `void k(u64* args, i64
//! begin, i64 end)` with `args` the same words but `items`, running items `begin..end`.

pub use autotp_kernels::grouped::{GroupedForm, GroupedKernel};
use inkwell::values::{FunctionValue, IntValue};
use inkwell::IntPredicate;

use crate::emit::{counted_loop, Emitter};
use crate::items::{Items, Signature, Target};
use crate::nvptx::if_then;
use crate::LlvmError;

/// The entry point of kernel `index` in a plan's PTX module.
pub fn entry_name(index: usize) -> String {
    format!("autotp_grouped_{index}")
}

/// The entry's shape: three inputs, the output and the fault words; the launch's tag and the
/// rank's first expert.
fn signature(kernel: &GroupedKernel) -> Signature {
    Signature { pointers: 5, words: 2, dtype: kernel.dtype }
}

/// `kernel`'s entry `symbol` for `target` (see the module doc).
pub(crate) fn define<'ctx>(
    e: &Emitter<'_, 'ctx>,
    symbol: &str,
    kernel: &GroupedKernel,
    target: Target,
) -> Result<FunctionValue<'ctx>, LlvmError> {
    crate::items::define(e, symbol, target, signature(kernel), |items, w| Grouped { items, kernel }.item(w))
}

/// One kernel's emitter over its entry's arguments (see [`signature`]).
struct Grouped<'x, 'ctx> {
    items: &'x Items<'x, 'x, 'ctx>,
    kernel: &'x GroupedKernel,
}

impl<'ctx> Grouped<'_, 'ctx> {
    /// Pair `q`'s held expert (from 0 at the rank's first) as an unsigned index, at least the
    /// experts held where the rank holds none, after reporting an id out of range if `checks`.
    fn expert(&self, q: IntValue<'ctx>, checks: IntValue<'ctx>) -> Result<IntValue<'ctx>, LlvmError> {
        let (items, e) = (self.items, self.items.e);
        let ids = match self.kernel.dims.form {
            GroupedForm::Scattered => items.pointers[0],
            _ => items.pointers[1],
        };
        let raw = items.index(ids, q, self.kernel.index_dtype)?;
        let (named, invalid) = items.resolved(raw, self.kernel.global_experts())?;
        let (fault, tag, start) = (items.pointers[4], items.words[0], items.words[1]);
        if_then(e, items.function, e.b.build_and(invalid, checks, "")?, || items.report(fault, raw, tag))?;
        // An id out of range names `global` or more, unsigned: past every held expert.
        Ok(e.b.build_int_sub(named, start, "")?)
    }

    fn item(&self, w: IntValue<'ctx>) -> Result<(), LlvmError> {
        match self.kernel.dims.form {
            GroupedForm::GatheredLhs | GroupedForm::GatheredRhs => self.gathered(w),
            GroupedForm::Scattered => self.scattered(w),
        }
    }

    fn gathered(&self, w: IntValue<'ctx>) -> Result<(), LlvmError> {
        let (items, dims) = (self.items, &self.kernel.dims);
        let (e, table, vectors) = (items.e, items.pointers[0], items.pointers[2]);
        let (k, width) = (dims.pair.k, dims.width());
        let (row_stride, col_stride) = dims.factor_strides();
        let q = e.b.build_int_unsigned_div(w, items.constant(width), "")?;
        let r = e.b.build_int_unsigned_rem(w, items.constant(width), "")?;
        let first = e.b.build_int_compare(IntPredicate::EQ, r, items.constant(0), "")?;
        let expert = self.expert(q, first)?;
        let held = e.b.build_int_compare(IntPredicate::ULT, expert, items.constant(dims.experts), "")?;
        let zero = items.zero();
        let sum = items.if_taken(held, zero, || {
            let matrix = e.b.build_int_mul(expert, items.constant(dims.matrix()), "")?;
            let column = e.b.build_int_add(matrix, e.b.build_int_mul(r, items.constant(col_stride), "")?, "")?;
            let vector = e.b.build_int_mul(q, items.constant(k), "")?;
            let sums = counted_loop(
                e,
                items.function,
                items.constant(0),
                items.constant(k),
                items.constant(1),
                &[zero],
                |kk, sum| {
                    let weight_at =
                        e.b.build_int_add(column, e.b.build_int_mul(kk, items.constant(row_stride), "")?, "")?;
                    let weight = items.value(table, weight_at)?;
                    let x = items.value(vectors, e.b.build_int_add(vector, kk, "")?)?;
                    Ok(vec![e.fma(weight, x, sum[0])?])
                },
            )?;
            Ok(sums[0])
        })?;
        items.store(items.pointers[3], w, sum)
    }

    fn scattered(&self, w: IntValue<'ctx>) -> Result<(), LlvmError> {
        let (items, dims) = (self.items, &self.kernel.dims);
        let (e, lhs, rhs) = (items.e, items.pointers[1], items.pointers[2]);
        let (m, n) = (dims.pair.m, dims.pair.n);
        let j = e.b.build_int_unsigned_rem(w, items.constant(n), "")?;
        let expert_i = e.b.build_int_unsigned_div(w, items.constant(n), "")?;
        let i = e.b.build_int_unsigned_rem(expert_i, items.constant(m), "")?;
        let own = e.b.build_int_unsigned_div(expert_i, items.constant(m), "")?;
        let checks = e.b.build_int_compare(IntPredicate::EQ, w, items.constant(0), "")?;
        let (start, one) = (items.constant(0), items.constant(1));
        let sums =
            counted_loop(e, items.function, start, items.constant(dims.pairs()), one, &[items.zero()], |q, sum| {
                let expert = self.expert(q, checks)?;
                let same = e.b.build_int_compare(IntPredicate::EQ, expert, own, "")?;
                let added = items.if_taken(same, sum[0], || {
                    let u =
                        items.value(lhs, e.b.build_int_add(e.b.build_int_mul(q, items.constant(m), "")?, i, "")?)?;
                    let v =
                        items.value(rhs, e.b.build_int_add(e.b.build_int_mul(q, items.constant(n), "")?, j, "")?)?;
                    e.fma(u, v, sum[0])
                })?;
                Ok(vec![added])
            })?;
        items.store(items.pointers[3], w, sums[0])
    }
}

#[cfg(test)]
mod tests {
    use autotp_kernels::grouped::GroupedDims;
    use autotp_kernels::{AlignedBuf, DType, IndexBlock, Kernel, MatMulDims};

    use super::*;
    use crate::items::tests::bytes;
    use crate::Function;

    fn floats(dtype: DType, buf: &AlignedBuf) -> Vec<f64> {
        let raw = buf.as_slice();
        match dtype {
            DType::F64 => raw.chunks_exact(8).map(|c| f64::from_le_bytes(c.try_into().unwrap())).collect(),
            DType::F32 => raw.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap()) as f64).collect(),
            _ => raw
                .chunks_exact(2)
                .map(|c| f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16) as f64)
                .collect(),
        }
    }

    /// Runs `kernel`'s x86 form for the rank whose experts start at `start` (items in two calls,
    /// as a pool splits them): its output and fault words.
    fn generated(kernel: &GroupedKernel, inputs: &[AlignedBuf], start: usize, tag: u64) -> (AlignedBuf, [i64; 2]) {
        let entry = crate::compile_cpu_functions(&[Function::Grouped(kernel)]).unwrap().remove(0);
        let mut out = AlignedBuf::zeroed(kernel.buffer_bytes()[3]);
        let mut fault = [0i64; 2];
        let mut words: Vec<*mut u8> = inputs.iter().map(|b| b.as_slice().as_ptr() as *mut u8).collect();
        words.push(out.as_mut_slice().as_mut_ptr());
        words.push(fault.as_mut_ptr() as *mut u8);
        words.extend([tag as *mut u8, start as *mut u8]);
        let items = kernel.items();
        // SAFETY: the buffers have the kernel's sizes; the tag and start words are integers.
        unsafe {
            entry.run(&words, 0..items / 2);
            entry.run(&words, items / 2..items);
        }
        (out, fault)
    }

    fn builtin(kernel: &Kernel, inputs: &[AlignedBuf], out_bytes: usize) -> Result<AlignedBuf, String> {
        let mut out = AlignedBuf::zeroed(out_bytes);
        let ins: Vec<&[u8]> = inputs.iter().map(AlignedBuf::as_slice).collect();
        kernel.run(&ins, &mut [out.as_mut_slice()]).map_err(|e| e.to_string())?;
        Ok(out)
    }

    fn dims(
        form: GroupedForm,
        (m, k, n): (usize, usize, usize),
        transposed: bool,
        block: Option<IndexBlock>,
    ) -> GroupedDims {
        let pairs = IDS.len();
        let lhs_side = form == GroupedForm::GatheredLhs;
        let pair = MatMulDims {
            batch: vec![pairs],
            lhs_batch: vec![pairs],
            rhs_batch: vec![pairs],
            m,
            k,
            n,
            transpose_lhs: transposed && lhs_side,
            transpose_rhs: transposed && !lhs_side,
            lhs_layout: None,
            rhs_layout: None,
        };
        GroupedDims { pair, form, experts: if block.is_some() { 2 } else { 4 }, block }
    }

    /// Pairs of 4 experts, negative ids among them; pairs 3 and 6 have zero vectors.
    const IDS: [i64; 9] = [2, 0, -1, 2, 1, 0, 0, 3, -2];

    fn values(n: usize, seed: usize, zero_pieces: Option<usize>) -> Vec<f64> {
        let mut x: Vec<f64> = (0..n).map(|i| ((i * 7919 + seed * 104_729) % 2001) as f64 / 1000.0 - 1.0).collect();
        if let Some(piece) = zero_pieces {
            for q in [3, 6] {
                x[q * piece..][..piece].fill(0.0);
            }
        }
        x
    }

    /// Every form, both transposes, the whole table and a rank's block of it, in f32, f64 and
    /// bf16 with i64 and i32 ids: the builtin kernel's results within the rounding of a sum in
    /// another order (16-bit results within one rounding of the type).
    #[test]
    fn generated_grouped_gemms_are_the_builtin_kernel() {
        let shapes = [
            (GroupedForm::GatheredLhs, (24, 40, 1)),
            (GroupedForm::GatheredRhs, (1, 40, 24)),
            (GroupedForm::Scattered, (12, 1, 20)),
        ];
        for (dtype, index_dtype) in [(DType::F32, DType::I64), (DType::F64, DType::I32), (DType::BF16, DType::I64)] {
            for (form, mkn) in shapes {
                for transposed in [false, true] {
                    for start in [None, Some(2)] {
                        let block = start.map(|_| IndexBlock { mesh_axis: 0, start: 0, global_len: 4 });
                        let dims = dims(form, mkn, transposed, block);
                        let kernel = Kernel::GroupedMatMul { dtype, index_dtype, dims: Box::new(dims.clone()) };
                        let form_kernel = GroupedKernel::of(&kernel).unwrap();
                        let sizes = form_kernel.buffer_bytes();
                        let ids = bytes(index_dtype, &IDS.map(|i| i as f64));
                        let (m, k, n) = mkn;
                        let inputs = match form {
                            GroupedForm::Scattered => vec![
                                ids,
                                bytes(dtype, &values(IDS.len() * m, 1, Some(m))),
                                bytes(dtype, &values(IDS.len() * n, 2, None)),
                            ],
                            _ => vec![
                                bytes(dtype, &values(dims.experts * dims.matrix(), 3, None)),
                                ids,
                                bytes(dtype, &values(IDS.len() * k, 4, Some(k))),
                            ],
                        };
                        let start = start.unwrap_or(0);
                        let want = builtin(&form_kernel.builtin(start), &inputs, sizes[3]).unwrap();
                        let (got, fault) = generated(&form_kernel, &inputs, start, 5);
                        assert_eq!(fault, [0, 0]);
                        let tolerance = if dtype == DType::BF16 { 1e-2 } else { 1e-6 };
                        for (at, (w, g)) in floats(dtype, &want).iter().zip(floats(dtype, &got)).enumerate() {
                            assert!(
                                (w - g).abs() <= tolerance * (1.0 + w.abs()),
                                "{dtype} {index_dtype} {form:?} transposed {transposed} start {start}: element {at}: {g} for {w}"
                            );
                        }
                        if form != GroupedForm::Scattered {
                            // Pairs of experts another rank holds are zeros, as zero pairs are.
                            let width = dims.width();
                            let product = |q: usize| floats(dtype, &got)[q * width..][..width].to_vec();
                            assert!(product(3).iter().all(|&x| x == 0.0), "a zero vector's product");
                            assert_eq!(product(7).iter().all(|&x| x == 0.0), start == 0 && block.is_some());
                        }
                    }
                }
            }
        }
    }

    /// An id out of range lands in the fault words with the launch's tag where the builtin kernel
    /// refuses it, and names no expert.
    #[test]
    fn an_id_out_of_range_is_reported_in_the_fault_words() {
        for form in [GroupedForm::GatheredLhs, GroupedForm::Scattered] {
            let mkn = if form == GroupedForm::Scattered { (3, 1, 2) } else { (3, 5, 1) };
            let dims = dims(form, mkn, false, None);
            let kernel = GroupedKernel::of(&Kernel::GroupedMatMul {
                dtype: DType::F32,
                index_dtype: DType::I64,
                dims: Box::new(dims.clone()),
            })
            .unwrap();
            let mut ids = IDS.map(|i| i as f64);
            ids[4] = 4.0;
            let ids = bytes(DType::I64, &ids);
            let (m, k, n) = mkn;
            let inputs = match form {
                GroupedForm::Scattered => {
                    vec![ids, bytes(DType::F32, &values(9 * m, 1, None)), bytes(DType::F32, &values(9 * n, 2, None))]
                }
                _ => vec![
                    bytes(DType::F32, &values(4 * m * k, 3, None)),
                    ids,
                    bytes(DType::F32, &values(9 * k, 4, None)),
                ],
            };
            let refused = builtin(&kernel.builtin(0), &inputs, kernel.buffer_bytes()[3]).unwrap_err();
            assert!(refused.contains("index 4 is out of range for a dimension of size 4"), "{refused}");
            let (_, fault) = generated(&kernel, &inputs, 0, 9);
            assert_eq!(fault, [4, 9], "{form:?}: the id and the tag");
        }
    }

    #[test]
    fn grouped_gemms_become_ptx() {
        let dims = dims(GroupedForm::Scattered, (12, 1, 20), false, None);
        let kernels = [GroupedKernel { dtype: DType::BF16, index_dtype: DType::I64, dims }];
        for arch in crate::nvptx::Arch::ALL {
            let entries = crate::nvptx::GpuEntries { grouped: &kernels, ..Default::default() };
            let ptx = crate::nvptx::program_ptx(&entries, arch).unwrap();
            assert!(ptx.contains(&format!(".entry {}(", entry_name(0))), "{ptx}");
            assert!(!ptx.contains("atom.") && !ptx.contains("red.") && !ptx.contains("call"), "{ptx}");
        }
    }
}
