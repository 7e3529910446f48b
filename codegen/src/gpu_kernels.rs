//! The GPU forms of a program's builtin kernels ([`autotp_program::gpu::GpuKernels`]), chosen
//! here once, at compile time: each builtin kernel's data movement as kernel IR
//! ([`autotp_kernels::kir_movement`]), the gathers and scatter-adds that have an
//! [`IndexedKernel`] form, fused attention's passes ([`AttentionFunction`]), top-ks and
//! scatter-elements ([`AxisKernel`]), and grouped expert GEMMs ([`GroupedKernel`]). Equal
//! kernels (of layers of one shape) are listed once. The plan's PTX holds them; a GPU runs every
//! other builtin kernel on the host.
//!
//! [`idle_launches`] finds the kernels that would leave a GPU's multiprocessors idle (fewer
//! blocks than it has, over more than a million elements: a whole-tensor reduction on one
//! block), which the compile summary lists.

use autotp_kernels::attention::{AttentionFunction, AttentionTarget};
use autotp_kernels::axis::AxisKernel;
use autotp_kernels::grouped::GroupedKernel;
use autotp_kernels::indexed::IndexedKernel;
use autotp_program::gpu::{GpuForm, MovementRun};
use autotp_program::{Instruction, Program};

/// Sets the GPU form of each of `program`'s builtin kernels that has one, listing the forms'
/// kernels in `program.gpu_kernels`.
pub fn choose_gpu_forms(program: &mut Program) {
    let table = &mut program.gpu_kernels;
    for instruction in &mut program.instructions {
        let Instruction::Kernel { kernel, inputs, gpu, .. } = instruction else { continue };
        if let Some(passes) = gpu_attention(kernel) {
            let entries = passes.into_iter().map(|f| index_of(&mut table.attention, f)).collect();
            *gpu = Some(GpuForm::Attention(entries));
            continue;
        }
        if let Some(axis) = AxisKernel::of(kernel) {
            *gpu = Some(GpuForm::Axis(index_of(&mut table.axis, axis)));
            continue;
        }
        if let Some(grouped) = GroupedKernel::of(kernel) {
            *gpu = Some(GpuForm::Grouped(index_of(&mut table.grouped, grouped)));
            continue;
        }
        let indexed = IndexedKernel::index_input(kernel)
            .and_then(|at| inputs.get(at))
            .and_then(|index| IndexedKernel::of(kernel, index.len));
        *gpu = match indexed {
            Some(indexed) => Some(GpuForm::Indexed(index_of(&mut table.indexed, indexed))),
            // A movement with nothing to write is a form of no launches.
            None => autotp_kernels::kir_movement::movement_kernels(kernel).map(|moves| {
                GpuForm::Movement(
                    (moves.into_iter())
                        .map(|moved| MovementRun {
                            kernel: index_of(&mut table.movement, moved.kernel),
                            inputs: moved.inputs,
                            outputs: moved.outputs,
                        })
                        .collect(),
                )
            }),
        };
    }
}

// Tensor-core attention loads its operands' rows 16 bytes at a time from where their regions start.
const _: () = assert!(crate::memory::ALIGN.is_multiple_of(16), "regions start 16-byte aligned");

/// Fused attention's passes for a GPU, where codegen gave the kernel to generated code.
fn gpu_attention(kernel: &autotp_kernels::Kernel) -> Option<Vec<AttentionFunction>> {
    use autotp_kernels::Kernel;
    let generated =
        matches!(kernel, Kernel::Attention { generated: true, .. } | Kernel::AttentionGrad { generated: true, .. });
    generated.then(|| AttentionFunction::of(kernel, AttentionTarget::Gpu)).flatten()
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

/// A kernel that leaves multiprocessors of the target GPU idle: it launches fewer blocks than
/// the GPU has multiprocessors while its work exceeds [`IDLE_WORK`] elements.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IdleLaunch {
    /// The kernel's name (the ops it was made from).
    pub kernel: String,
    pub blocks: usize,
    /// Elements of its loop nest (rows x inner).
    pub elements: usize,
    /// Its instructions in the program: launches per step.
    pub per_step: usize,
}

/// The work above which a kernel should fill the GPU.
pub const IDLE_WORK: usize = 1_000_000;

/// The GPU with the most multiprocessors among the architectures plans carry PTX for, and how
/// many it has: the GPU [`idle_launches`] checks against.
pub fn largest_target_gpu() -> (&'static str, usize) {
    (autotp_llvm::nvptx::Arch::ALL.iter().map(|arch| arch.largest_gpu()))
        .max_by_key(|&(_, multiprocessors)| multiprocessors)
        .expect("at least one architecture")
}

/// The generated and movement kernels of `program` that launch fewer blocks than a GPU of
/// `multiprocessors` has, over more than [`IDLE_WORK`] elements (one entry per kernel, in the
/// program's order), then fused attention's passes that do, over more than [`IDLE_WORK`]
/// scores (rows times the keys or queries each meets, all of them).
pub fn idle_launches(program: &Program, multiprocessors: usize) -> Vec<IdleLaunch> {
    use autotp_llvm::nvptx::{blocks_per_row, launch_blocks};
    let mut per_step: std::collections::HashMap<(bool, usize), usize> = Default::default();
    for instruction in &program.instructions {
        match instruction {
            Instruction::Generated { kernel, .. } => *per_step.entry((false, *kernel)).or_default() += 1,
            Instruction::Kernel { gpu: Some(GpuForm::Movement(runs)), .. } => {
                for run in runs {
                    *per_step.entry((true, run.kernel)).or_default() += 1;
                }
            }
            _ => {}
        }
    }
    let kernels = (program.kernels.iter().enumerate().map(|(i, k)| ((false, i), k)))
        .chain(program.gpu_kernels.movement.iter().enumerate().map(|(i, k)| ((true, i), k)));
    let mut idle: Vec<IdleLaunch> = kernels
        .filter_map(|(key, kernel)| {
            let blocks = launch_blocks(kernel.outer, blocks_per_row(kernel));
            let elements = kernel.outer * kernel.inner;
            (blocks < multiprocessors && elements > IDLE_WORK).then(|| IdleLaunch {
                kernel: kernel.name.clone(),
                blocks,
                elements,
                per_step: per_step.get(&key).copied().unwrap_or(0),
            })
        })
        .collect();
    let mut attention_per_step = vec![0; program.gpu_kernels.attention.len()];
    for instruction in &program.instructions {
        if let Instruction::Kernel { gpu: Some(GpuForm::Attention(passes)), .. } = instruction {
            passes.iter().for_each(|&p| attention_per_step[p] += 1);
        }
    }
    for (f, per_step) in program.gpu_kernels.attention.iter().zip(attention_per_step) {
        let threads = f.units() * f.threads_per_unit();
        let blocks = launch_blocks(threads.div_ceil(autotp_llvm::nvptx::BLOCK as usize), 1);
        let elements = f.dims.query_rows() * f.dims.kv_len;
        if blocks < multiprocessors && elements > IDLE_WORK {
            let cut = if f.tensor_cores { ", tensor cores" } else { "" };
            idle.push(IdleLaunch { kernel: format!("attention {:?}{cut}", f.pass), blocks, elements, per_step });
        }
    }
    idle
}

#[cfg(test)]
mod tests {
    use autotp_kernels::kir::{Expr, Fold, Index, Stage, Store, Term, Var};
    use autotp_kernels::{kir, DType};
    use autotp_program::Region;

    use super::*;

    /// A kernel of `outer` rows of `inner` f32: a map (`y = x`) or a row sum (`y[row] = sum x`).
    fn kernel(name: &str, outer: usize, inner: usize, reduce: bool) -> kir::Kernel {
        let along = |var: Var, stride: usize| Term { var, div: 1, modulo: None, offset: 0, wrap: None, stride };
        let element = Index { base: 0, terms: vec![along(Var::Outer, inner), along(Var::Inner, 1)] };
        let row = Index { base: 0, terms: vec![along(Var::Outer, 1)] };
        let load = Expr::Load { buffer: 0, index: element.clone() };
        let stages = match reduce {
            false => {
                vec![Stage::Map { exprs: vec![load], stores: vec![Store { buffer: 1, index: element, value: 0 }] }]
            }
            true => vec![
                Stage::Reduce { fold: Fold::Sum, exprs: vec![load], value: 0 },
                Stage::Row { exprs: vec![Expr::Acc(0)], stores: vec![Store { buffer: 1, index: row, value: 0 }] },
            ],
        };
        let out = if reduce { outer } else { outer * inner };
        let buffers =
            vec![kir::Buffer { dtype: DType::F32, len: outer * inner }, kir::Buffer { dtype: DType::F32, len: out }];
        kir::Kernel { name: name.into(), buffers, num_inputs: 1, outer, inner, stages }
    }

    /// A whole-tensor sum of 4M elements runs on one block: flagged, with its launches per
    /// step. A map over one row of 4M splits the row across blocks, and a sum of 1M rows has a
    /// block per row: neither is.
    #[test]
    fn whole_tensor_reductions_leave_the_gpu_idle() {
        let mut program = Program::bare(vec![], vec![], 0);
        program.kernels =
            vec![kernel("sum", 1, 4 << 20, true), kernel("copy", 1, 4 << 20, false), kernel("rows", 1 << 20, 4, true)];
        let regions = |n: usize| vec![Region { offset: 0, len: n }];
        for kernel in [0, 0, 1, 2] {
            program.instructions.push(Instruction::Generated {
                kernel,
                inputs: regions(4),
                outputs: regions(4),
                label: "node".into(),
            });
        }
        let idle = idle_launches(&program, 132);
        assert_eq!(idle, [IdleLaunch { kernel: "sum".into(), blocks: 1, elements: 4 << 20, per_step: 2 }]);
    }

    /// Fused attention's passes count too: one sequence of 1024 tokens and 12 heads of 64 in
    /// bf16 is 96 tiles of 128 queries, a block each, for 12M scores: flagged on an H100's 132
    /// multiprocessors; a micro-batch of 8 (768 blocks) is not.
    #[test]
    fn attention_over_few_tiles_leaves_the_gpu_idle() {
        use autotp_kernels::attention::{AttentionDims, AttentionFunction, AttentionMask, AttentionTarget};
        use autotp_kernels::Kernel;
        let flagged = |batch: usize| {
            let dims = AttentionDims {
                lead: vec![batch, 12],
                kv_lead: vec![batch, 12],
                q_len: 1024,
                kv_len: 1024,
                head_dim: 64,
                value_dim: 64,
                bias: None,
                query_runs: None,
                key_blocks: None,
            };
            let kernel = Kernel::Attention {
                dtype: DType::BF16,
                dims,
                scale: 0.125,
                mask: AttentionMask::Causal,
                generated: true,
            };
            let mut program = Program::bare(vec![], vec![], 0);
            program.gpu_kernels.attention = AttentionFunction::of(&kernel, AttentionTarget::Gpu).unwrap_or_default();
            program.instructions.push(Instruction::Kernel {
                kernel,
                inputs: vec![],
                outputs: vec![],
                gpu: Some(GpuForm::Attention(vec![0])),
                label: "node".into(),
            });
            idle_launches(&program, 132)
        };
        let one = IdleLaunch {
            kernel: "attention Forward, tensor cores".into(),
            blocks: 96,
            elements: 12 << 20,
            per_step: 1,
        };
        assert_eq!(flagged(1), [one]);
        assert_eq!(flagged(8), []);
    }
}
