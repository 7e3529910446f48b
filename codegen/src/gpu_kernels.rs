//! The GPU forms of a program's builtin kernels ([`autotp_program::gpu::GpuKernels`]), chosen
//! here once, at compile time: each builtin kernel's data movement as kernel IR
//! ([`autotp_kernels::kir_movement`]), and the gathers and scatter-adds that have an
//! [`IndexedKernel`] form. Equal kernels (of layers of one shape) are listed once. The plan's
//! PTX holds them; a GPU runs every other builtin kernel on the host.

use autotp_kernels::indexed::IndexedKernel;
use autotp_program::gpu::{GpuForm, GpuKernels, MovementRun};
use autotp_program::{Instruction, Program};

/// Sets the GPU form of each of `program`'s builtin kernels that has one, listing the forms'
/// kernels in `program.gpu_kernels`.
pub fn choose_gpu_forms(program: &mut Program) {
    let table = &mut program.gpu_kernels;
    for instruction in &mut program.instructions {
        let Instruction::Kernel { kernel, inputs, gpu, .. } = instruction else { continue };
        let indexed = GpuKernels::index_input(kernel)
            .and_then(|at| inputs.get(at))
            .and_then(|index| IndexedKernel::of(kernel, index.len));
        *gpu = match indexed {
            Some(indexed) => Some(GpuForm::Indexed(index_of(&mut table.indexed, indexed))),
            None => {
                let moves = autotp_kernels::kir_movement::movement_kernels(kernel).unwrap_or_default();
                let runs: Vec<MovementRun> = (moves.into_iter())
                    .map(|moved| MovementRun {
                        kernel: index_of(&mut table.movement, moved.kernel),
                        inputs: moved.inputs,
                        outputs: moved.outputs,
                    })
                    .collect();
                (!runs.is_empty()).then_some(GpuForm::Movement(runs))
            }
        };
    }
}

/// The position of `item` in `list`, appended if new.
fn index_of<T: PartialEq>(list: &mut Vec<T>, item: T) -> usize {
    match list.iter().position(|k| *k == item) {
        Some(i) => i,
        None => {
            list.push(item);
            list.len() - 1
        }
    }
}
