//! Where a step's infs and NaNs came from: a step replayed with every instruction's float
//! outputs checked after it runs ([`crate::Executor::watch_non_finite`]), read in place on CPU
//! ranks and downloaded in the stream's order on GPUs. It finds the first instruction that
//! wrote an inf or a NaN (its label names the IR node or the fusion) and the parameters whose
//! gradients were not finite when the optimizer step reached them.
//! Only `--nan-policy stop` pays for it, once, after a step whose gradients were not finite.

use autotp_kernels::{DType, Kernel};
use autotp_program::{Instruction, Program, Region};

use crate::RuntimeError;

/// What a watched run of a rank's program found.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct NonFiniteTrace {
    /// The first instruction, in the order the rank ran them, that wrote an inf or a NaN: its
    /// index in the program and its label.
    pub first: Option<(usize, String)>,
    /// The parameters (by slot: a mixed-precision step's f32 master, `master.NAME`) whose
    /// gradients held an inf or a NaN when the optimizer step reached them, each with the
    /// instruction that last wrote its gradient, in that instruction's order: the backward's,
    /// nearest the loss first.
    pub gradients: Vec<(usize, String)>,
}

impl NonFiniteTrace {
    /// Records the gradients instruction `index` of `program` is about to apply, if it is an
    /// optimizer step; `non_finite` says whether a region of the rank's memory, of a type,
    /// holds an inf or a NaN (reading it from the host's memory or downloading it from a GPU).
    pub(crate) fn before(
        &mut self,
        program: &Program,
        index: usize,
        mut non_finite: impl FnMut(&Region, DType) -> Result<bool, RuntimeError>,
    ) -> Result<(), RuntimeError> {
        for (name, gradient, dtype) in gradients(program, index) {
            if non_finite(&gradient, dtype)? {
                let overlaps = |r: &Region| r.offset < gradient.end() && gradient.offset < r.end();
                let made_by = (0..index).rev().find(|&i| program.instructions[i].regions().1.iter().any(overlaps));
                let made_by = made_by.unwrap_or(index);
                let at = self.gradients.partition_point(|(other, _)| *other <= made_by);
                self.gradients.insert(at, (made_by, name));
            }
        }
        Ok(())
    }

    /// Records instruction `index` if it is the first to have written an inf or a NaN
    /// (`non_finite` as in [`NonFiniteTrace::before`]).
    pub(crate) fn after(
        &mut self,
        program: &Program,
        index: usize,
        mut non_finite: impl FnMut(&Region, DType) -> Result<bool, RuntimeError>,
    ) -> Result<(), RuntimeError> {
        if self.first.is_some() {
            return Ok(());
        }
        for (region, dtype) in float_outputs(program, index) {
            if non_finite(&region, dtype)? {
                self.first = Some((index, program.instructions[index].label().to_string()));
                return Ok(());
            }
        }
        Ok(())
    }
}

/// The float outputs of instruction `index` as it completes: a started collective's at its
/// wait. A pipeline message's type is its sender's to check, and an optimizer step runs only
/// on finite gradients (its guard), so neither has any here.
fn float_outputs(program: &Program, index: usize) -> Vec<(Region, DType)> {
    let float = |region: Region, dtype: DType| dtype.is_float().then_some((region, dtype));
    match &program.instructions[index] {
        Instruction::Kernel { kernel, outputs, .. } => {
            (outputs.iter().enumerate()).filter_map(|(i, r)| Some((*r, kernel.float_output(i)?))).collect()
        }
        Instruction::Generated { kernel, outputs, .. } => {
            let kernel = &program.kernels[*kernel];
            outputs.iter().zip(kernel.outputs()).filter_map(|(r, buffer)| float(*r, buffer.dtype)).collect()
        }
        Instruction::Collective { op, output, .. } => float(*output, op.dtype).into_iter().collect(),
        Instruction::Wait { start, .. } => match &program.instructions[*start] {
            Instruction::CollectiveStart { op, output, .. } => float(*output, op.dtype).into_iter().collect(),
            _ => Vec::new(),
        },
        Instruction::CollectiveStart { .. }
        | Instruction::Send { .. }
        | Instruction::Recv { .. }
        | Instruction::OptimizerStep { .. } => Vec::new(),
    }
}

/// The gradients instruction `index` applies, if it is an optimizer step: each one's
/// parameter (its slot's name), region and type.
fn gradients(program: &Program, index: usize) -> Vec<(String, Region, DType)> {
    let slot_at = |r: &Region| program.params.iter().chain(&program.states).find(|s| s.region == *r);
    let named = |param: &Region, gradient: &Region, dtype: DType| {
        slot_at(param).map(|slot| (slot.name.clone(), *gradient, dtype))
    };
    match &program.instructions[index] {
        Instruction::OptimizerStep { dtype, tensors, .. } => {
            tensors.iter().filter_map(|t| named(&t.inputs[0], &t.inputs[1], *dtype)).collect()
        }
        Instruction::Kernel { kernel: Kernel::AdamW { dtype, .. } | Kernel::Sgd { dtype, .. }, inputs, .. } => {
            named(&inputs[0], &inputs[1], *dtype).into_iter().collect()
        }
        _ => Vec::new(),
    }
}
