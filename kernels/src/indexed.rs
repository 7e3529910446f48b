//! Gathers and scatter-adds in the form a GPU kernel runs them ([`IndexedKernel`]): the
//! embedding lookup and its gradient, whose rows an index buffer picks (data-dependent
//! addresses, which the kernel IR does not express). Codegen picks the builtin kernels that
//! have this form and the plan carries them; `autotp_llvm::indexed` compiles them to PTX, where
//! the work items and the fault words are described.

use serde::{Deserialize, Serialize};

use crate::{DType, IndexBlock, Kernel};

/// Which of the two.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum IndexedOp {
    Gather,
    ScatterAdd,
}

/// A gather or scatter-add kernel's shape (see the module doc).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct IndexedKernel {
    pub op: IndexedOp,
    /// The elements': any type of 2, 4 or 8 bytes for a gather (it moves bits); f32, f64, bf16
    /// or f16 for a scatter-add (16-bit updates summed in f32 and rounded once, as the CPU does).
    pub dtype: DType,
    /// i64 or i32.
    pub index_dtype: DType,
    pub outer: usize,
    pub indices: usize,
    pub inner: usize,
    /// The table's (gather) or output's (scatter-add) rows: how many this kernel holds (from
    /// the launch's `start`), and the whole axis.
    pub held: usize,
    pub global: usize,
}

impl IndexedKernel {
    /// The GPU form of a builtin `kernel` whose index buffer holds `index_bytes`, where it has
    /// one (other element types stay on the host).
    pub fn of(kernel: &Kernel, index_bytes: usize) -> Option<IndexedKernel> {
        let (op, dtype, index_dtype, shape, axis, block) = match kernel {
            Kernel::Gather { dtype, index_dtype, data, axis, block } => {
                (IndexedOp::Gather, *dtype, *index_dtype, data, *axis, block)
            }
            Kernel::ScatterAdd { dtype, index_dtype, out, axis, block } => {
                (IndexedOp::ScatterAdd, *dtype, *index_dtype, out, *axis, block)
            }
            _ => return None,
        };
        let supported = match op {
            IndexedOp::Gather => matches!(dtype.size(), 2 | 4 | 8),
            IndexedOp::ScatterAdd => matches!(dtype, DType::F32 | DType::F64 | DType::BF16 | DType::F16),
        };
        if !supported || !matches!(index_dtype, DType::I64 | DType::I32) || axis >= shape.len() {
            return None;
        }
        let held = shape[axis];
        let global = block.as_ref().map_or(held, |b| b.global_len);
        Some(IndexedKernel {
            op,
            dtype,
            index_dtype,
            outer: shape[..axis].iter().product(),
            indices: index_bytes / index_dtype.size(),
            inner: shape[axis + 1..].iter().product(),
            held,
            global,
        })
    }

    /// The position of the index buffer among a builtin gather's (1) or scatter-add's (0)
    /// inputs, `None` for other kernels.
    pub fn index_input(kernel: &Kernel) -> Option<usize> {
        match kernel {
            Kernel::Gather { .. } => Some(1),
            Kernel::ScatterAdd { .. } => Some(0),
            _ => None,
        }
    }

    /// The global index of the first row `kernel` (a gather or scatter-add) holds: its launch's
    /// `start`.
    pub fn start(kernel: &Kernel) -> usize {
        match kernel {
            Kernel::Gather { block: Some(b), .. } | Kernel::ScatterAdd { block: Some(b), .. } => b.start,
            _ => 0,
        }
    }

    /// Work items (blocks' worth of rows) one launch runs.
    pub fn rows(&self) -> usize {
        self.outer * self.indices
    }

    /// The byte lengths of the entry's `a`, `b` and `out` buffers.
    pub fn buffer_bytes(&self) -> [usize; 3] {
        let (size, index_size) = (self.dtype.size(), self.index_dtype.size());
        let held = self.outer * self.held * self.inner * size;
        let picked = self.outer * self.indices * self.inner * size;
        match self.op {
            IndexedOp::Gather => [held, self.indices * index_size, picked],
            IndexedOp::ScatterAdd => [self.indices * index_size, picked, held],
        }
    }

    /// The builtin kernel computing the same over `[outer, held, inner]` (the CPU's reference,
    /// which the emulated GPU runs), its block starting at global row `start`.
    pub fn builtin(&self, start: usize) -> Kernel {
        let shape = vec![self.outer, self.held, self.inner];
        let block = (self.held != self.global).then_some(IndexBlock { mesh_axis: 0, start, global_len: self.global });
        let (dtype, index_dtype, axis) = (self.dtype, self.index_dtype, 1);
        match self.op {
            IndexedOp::Gather => Kernel::Gather { dtype, index_dtype, data: shape, axis, block },
            IndexedOp::ScatterAdd => Kernel::ScatterAdd { dtype, index_dtype, out: shape, axis, block },
        }
    }
}
