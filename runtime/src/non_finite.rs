//! Where a step's infs and NaNs came from: a step replayed on CPU ranks with every instruction's
//! float outputs checked after it runs ([`crate::Executor::watch_non_finite`]). It finds the
//! first instruction that wrote an inf or a NaN (its label names the IR node or the fusion)
//! and the parameters whose gradients were not finite when the optimizer step reached them.
//! Only `--nan-policy stop` pays for it, once, after a step whose gradients were not finite.

use autotp_kernels::{DType, Kernel};
use autotp_program::{Instruction, Program, Region};

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
    /// optimizer step; `bytes` reads a region of the rank's memory.
    pub(crate) fn before<'a>(&mut self, program: &Program, index: usize, bytes: impl Fn(&Region) -> &'a [u8]) {
        for (name, gradient, dtype) in gradients(program, index) {
            if dtype.first_non_finite(bytes(&gradient)).is_some() {
                let overlaps = |r: &Region| r.offset < gradient.end() && gradient.offset < r.end();
                let made_by = (0..index).rev().find(|&i| program.instructions[i].regions().1.iter().any(overlaps));
                let made_by = made_by.unwrap_or(index);
                let at = self.gradients.partition_point(|(other, _)| *other <= made_by);
                self.gradients.insert(at, (made_by, name));
            }
        }
    }

    /// Records instruction `index` if it is the first to have written an inf or a NaN.
    pub(crate) fn after<'a>(&mut self, program: &Program, index: usize, bytes: impl Fn(&Region) -> &'a [u8]) {
        if self.first.is_some() {
            return;
        }
        if float_outputs(program, index).iter().any(|(region, dtype)| dtype.first_non_finite(bytes(region)).is_some()) {
            self.first = Some((index, program.instructions[index].label().to_string()));
        }
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
