//! An optimizer step's tensors as the multi-tensor kernel reads them: a table of chunks
//! ([`autotp_kernels::optim::TensorUpdate`]) at a rank's memories, the same for the CPU and a
//! GPU (whose chunks hold device addresses: nothing here is dereferenced).

use autotp_program::Region;

/// Elements of one chunk of an optimizer step (one task of the pool).
pub(crate) const OPTIMIZER_CHUNK_ELEMENTS: usize = 16_384;

/// Where a rank's memories start: regions resolve to addresses in the arena or, for those in
/// the host pool ([`autotp_program::HOST_POOL`]), in the pool.
#[derive(Clone, Copy)]
pub(crate) struct Bases {
    pub arena: usize,
    pub host_pool: usize,
}

impl Bases {
    /// The address of `region` (nothing is dereferenced: a GPU's device addresses work too).
    pub fn at(&self, region: &Region) -> *mut u8 {
        if region.in_host_pool() {
            self.host_pool.wrapping_add(region.offset - autotp_program::HOST_POOL) as *mut u8
        } else {
            self.arena.wrapping_add(region.offset) as *mut u8
        }
    }
}

/// The whole of tensor `t`'s update, for memories at `bases`.
pub(crate) fn tensor_update(
    dtype: autotp_kernels::DType,
    t: &autotp_program::OptimizerTensor,
    bases: Bases,
) -> autotp_kernels::optim::TensorUpdate {
    let at = |r: &Region| bases.at(r);
    let mut states = [std::ptr::null(); 2];
    let mut states_out = [std::ptr::null_mut(); 2];
    for (k, (input, output)) in t.inputs[2..].iter().zip(&t.outputs[1..]).enumerate() {
        states[k] = at(input) as *const u8;
        states_out[k] = at(output);
    }
    autotp_kernels::optim::TensorUpdate {
        len: t.inputs[0].len / dtype.size(),
        param: at(&t.inputs[0]),
        grad: at(&t.inputs[1]),
        states,
        param_out: at(&t.outputs[0]),
        states_out,
    }
}

/// `update`'s elements `range` in chunks of at most [`OPTIMIZER_CHUNK_ELEMENTS`], appended to
/// `chunks`.
pub(crate) fn push_chunks(
    dtype: autotp_kernels::DType,
    update: &autotp_kernels::optim::TensorUpdate,
    range: std::ops::Range<usize>,
    chunks: &mut Vec<autotp_kernels::optim::TensorUpdate>,
) {
    for start in range.clone().step_by(OPTIMIZER_CHUNK_ELEMENTS) {
        let end = (start + OPTIMIZER_CHUNK_ELEMENTS).min(range.end);
        // SAFETY: the range lies within the tensor; `part` only offsets the addresses.
        chunks.push(unsafe { update.part(dtype, start..end) });
    }
}

/// An optimizer step's tensors cut into chunks of at most [`OPTIMIZER_CHUNK_ELEMENTS`], for
/// memories at `bases` (the CPU's, or a GPU's device addresses: nothing is dereferenced).
pub(crate) fn optimizer_chunks<'a>(
    dtype: autotp_kernels::DType,
    tensors: impl IntoIterator<Item = &'a autotp_program::OptimizerTensor>,
    bases: Bases,
) -> Vec<autotp_kernels::optim::TensorUpdate> {
    let mut chunks = Vec::new();
    for t in tensors {
        let whole = tensor_update(dtype, t, bases);
        push_chunks(dtype, &whole, 0..whole.len, &mut chunks);
    }
    chunks
}
