//! Top-k and scatter-elements in the form a GPU kernel runs them ([`AxisKernel`]): a mixture of
//! experts' routing (the `k` best experts of each token) and its gradient (the routing weights'
//! gradient scattered back to the experts picked), which pick elements along one axis of
//! `[outer, len, inner]` by comparing them or by an index buffer (data-dependent choices the
//! kernel IR does not express). Codegen picks the builtin kernels that have this form and the
//! plan carries them; `autotp_llvm::axis` emits them for NVPTX and, for the emulated GPU, for
//! x86, where its work items and fault words are described.

use serde::{Deserialize, Serialize};

use crate::{DType, Kernel};

/// What an [`AxisKernel`] computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AxisOp {
    /// `[x] -> [values, indices (i64)]`, the builtin `topk`: the `k` largest (or smallest) of
    /// each `x[o, :, i]` in order, equal values in index order, NaN the largest value.
    TopK { k: usize, largest: bool },
    /// `[indices, updates] -> [out]`, the builtin `scatter_elements`: `out[o, j, i]` is the sum,
    /// from 0 in increasing `r`, of `updates[o, r, i]` over the `r` whose `indices[o, r, i]`
    /// names `j` (negatives counted back from `out_len`).
    ScatterElements { index_dtype: DType },
}

/// A top-k or scatter-elements over `[outer, len, inner]` (see the module doc).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct AxisKernel {
    pub op: AxisOp,
    /// Of the values compared or summed: a float type (scatter-elements: f32 or f64).
    pub dtype: DType,
    pub outer: usize,
    /// The axis of the input (top-k) or of the indices and updates (scatter-elements).
    pub len: usize,
    /// The axis of the outputs: `k`, or the scatter's output length.
    pub out_len: usize,
    pub inner: usize,
}

impl AxisKernel {
    /// The GPU form of a builtin `kernel`, where it has one.
    pub fn of(kernel: &Kernel) -> Option<AxisKernel> {
        let float = |dtype: DType| matches!(dtype, DType::F32 | DType::F64 | DType::BF16 | DType::F16);
        match *kernel {
            Kernel::TopK { dtype, outer, len, inner, k, largest } if float(dtype) && k <= len => {
                Some(AxisKernel { op: AxisOp::TopK { k, largest }, dtype, outer, len, out_len: k, inner })
            }
            Kernel::ScatterElements { dtype, index_dtype, ref updates, ref out, axis }
                if matches!(dtype, DType::F32 | DType::F64)
                    && matches!(index_dtype, DType::I64 | DType::I32)
                    && axis < out.len()
                    && updates.len() == out.len()
                    && (0..out.len()).all(|d| d == axis || updates[d] == out[d]) =>
            {
                Some(AxisKernel {
                    op: AxisOp::ScatterElements { index_dtype },
                    dtype,
                    outer: out[..axis].iter().product(),
                    len: updates[axis],
                    out_len: out[axis],
                    inner: out[axis + 1..].iter().product(),
                })
            }
            _ => None,
        }
    }

    /// The builtin kernel computing the same (the reference of the generated one).
    pub fn builtin(&self) -> Kernel {
        let (dtype, outer, len, inner) = (self.dtype, self.outer, self.len, self.inner);
        match self.op {
            AxisOp::TopK { k, largest } => Kernel::TopK { dtype, outer, len, inner, k, largest },
            AxisOp::ScatterElements { index_dtype } => Kernel::ScatterElements {
                dtype,
                index_dtype,
                updates: vec![outer, len, inner],
                out: vec![outer, self.out_len, inner],
                axis: 1,
            },
        }
    }

    /// Its work items, one per thread: a row `(o, i)` of the top-k (`k` selections each), an
    /// output element of the scatter.
    pub fn items(&self) -> usize {
        match self.op {
            AxisOp::TopK { .. } => self.outer * self.inner,
            AxisOp::ScatterElements { .. } => self.outer * self.out_len * self.inner,
        }
    }

    /// Whether an index out of range can fault it (the runtime then passes its fault words).
    pub fn faults(&self) -> bool {
        matches!(self.op, AxisOp::ScatterElements { .. })
    }

    /// The byte lengths of its buffers: the builtin kernel's inputs, then its outputs.
    pub fn buffer_bytes(&self) -> Vec<usize> {
        let size = self.dtype.size();
        let along = self.outer * self.len * self.inner;
        let picked = self.outer * self.out_len * self.inner;
        match self.op {
            AxisOp::TopK { .. } => vec![along * size, picked * size, picked * 8],
            AxisOp::ScatterElements { index_dtype } => vec![along * index_dtype.size(), along * size, picked * size],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A router's top-2 of 8 experts and the gradient of the gathered weights have forms over
    /// `[outer, len, inner]`, whose builtin kernels are the ones they came from; integer values
    /// and scatters whose indices are narrower than their output stay on the host.
    #[test]
    fn routing_kernels_have_gpu_forms() {
        let top_k = Kernel::TopK { dtype: DType::BF16, outer: 512, len: 8, inner: 1, k: 2, largest: true };
        let form = AxisKernel::of(&top_k).unwrap();
        assert_eq!((form.items(), form.out_len, form.buffer_bytes()), (512, 2, vec![8192, 2048, 8192]));
        assert_eq!(form.builtin(), top_k);
        let scatter = Kernel::ScatterElements {
            dtype: DType::F32,
            index_dtype: DType::I64,
            updates: vec![4, 128, 2],
            out: vec![4, 128, 8],
            axis: 2,
        };
        let form = AxisKernel::of(&scatter).unwrap();
        assert_eq!((form.outer, form.len, form.out_len, form.inner, form.items()), (512, 2, 8, 1, 4096));
        assert!(form.faults());
        assert_eq!(form.builtin().name(), "scatter_elements");
        let integers = Kernel::TopK { dtype: DType::I64, outer: 4, len: 8, inner: 1, k: 2, largest: true };
        assert!(AxisKernel::of(&integers).is_none());
        let narrower = Kernel::ScatterElements {
            dtype: DType::F32,
            index_dtype: DType::I64,
            updates: vec![2, 2],
            out: vec![4, 8],
            axis: 1,
        };
        assert!(AxisKernel::of(&narrower).is_none());
    }
}
