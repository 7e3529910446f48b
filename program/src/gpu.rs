//! The builtin kernels a GPU runs as entries of the plan's PTX, chosen by codegen and carried
//! by the plan, so the runtime on a GPU selects nothing: a builtin-kernel instruction with a
//! [`GpuForm`] runs as that form's launches, any other on the host. The forms' kernels are
//! listed once per program in [`GpuKernels`].
//!
//! - Data movement (expand, transpose, slice, pad, concat, split) as kernel IR
//!   ([`autotp_kernels::kir_movement`]): entry `autotp_movement_<i>` of the PTX module for
//!   movement kernel `i`, one launch per [`MovementRun`] over the instruction's buffers.
//! - Gathers and scatter-adds (the embedding and its gradient) as [`IndexedKernel`]s: entry
//!   `autotp_indexed_<i>` for indexed kernel `i` (`autotp_llvm::indexed` describes its arguments).
//! - Fused attention's passes as [`AttentionFunction`]s: entry `autotp_attention_<i>`
//!   (`autotp_llvm::attention` describes its arguments).
//! - Top-k and scatter-elements (a mixture of experts' routing and its gradient) as
//!   [`AxisKernel`]s: entry `autotp_axis_<i>` (`autotp_llvm::axis` describes its arguments).
//! - Grouped expert GEMMs as [`GroupedKernel`]s: entry `autotp_grouped_<i>`
//!   (`autotp_llvm::grouped` describes its arguments).
//!
//! `Program::validate` checks a plan read from a file: movement kernels stay inside their
//! buffers (`kir::Kernel::check`) and each form fits its instruction ([`GpuKernels::check_form`]:
//! the buffers a movement run names, the indexed, attention, axis or grouped kernel its builtin
//! kernel's).

use autotp_kernels::attention::{AttentionFunction, AttentionTarget};
use autotp_kernels::axis::AxisKernel;
use autotp_kernels::grouped::GroupedKernel;
use autotp_kernels::indexed::IndexedKernel;
use autotp_kernels::{kir, Kernel};
use serde::{Deserialize, Serialize};

use crate::Region;

/// The GPU forms of a program's builtin kernels (see the module doc).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct GpuKernels {
    /// The distinct movement kernels (equal ones, of layers of one shape, listed once).
    pub movement: Vec<kir::Kernel>,
    /// The distinct gathers and scatter-adds.
    pub indexed: Vec<IndexedKernel>,
    /// The distinct passes of fused attention.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub attention: Vec<AttentionFunction>,
    /// The distinct top-ks and scatter-elements.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub axis: Vec<AxisKernel>,
    /// The distinct grouped expert GEMMs.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub grouped: Vec<GroupedKernel>,
}

/// How a GPU runs one builtin-kernel instruction (`Instruction::Kernel::gpu`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GpuForm {
    /// Movement kernels, launched in order.
    Movement(Vec<MovementRun>),
    /// [`GpuKernels::indexed`]`[i]` over the instruction's two inputs and its output.
    Indexed(usize),
    /// [`GpuKernels::attention`]`[i]` for each pass in order, over the instruction's inputs and
    /// outputs, the pass's table and a scratch of one f32 per query row (the runtime makes
    /// both).
    Attention(Vec<usize>),
    /// [`GpuKernels::axis`]`[i]` over the instruction's inputs and outputs.
    Axis(usize),
    /// [`GpuKernels::grouped`]`[i]` over the instruction's inputs and output.
    Grouped(usize),
}

/// One launch of a movement kernel for an instruction.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MovementRun {
    /// An index into [`GpuKernels::movement`].
    pub kernel: usize,
    /// Its buffers: positions in the instruction's inputs, then in its outputs.
    pub inputs: Vec<usize>,
    pub outputs: Vec<usize>,
}

impl GpuKernels {
    /// Whether there is nothing for a GPU to run.
    pub fn is_empty(&self) -> bool {
        self.movement.is_empty()
            && self.indexed.is_empty()
            && self.attention.is_empty()
            && self.axis.is_empty()
            && self.grouped.is_empty()
    }

    /// The most keys a fused-attention pass reads with a GPU thread per query row (no
    /// tensor-core form: f32, or several query runs a row block), if one does.
    pub fn thread_per_row_attention_keys(&self) -> Option<usize> {
        self.attention.iter().filter(|f| !f.tensor_cores).map(|f| f.dims.kv_len).max()
    }

    /// Checks that `form` fits the builtin `kernel` over `inputs` and `outputs` (see the module
    /// doc); the error says how it does not.
    pub fn check_form(
        &self,
        form: &GpuForm,
        kernel: &Kernel,
        inputs: &[Region],
        outputs: &[Region],
    ) -> Result<(), String> {
        match form {
            GpuForm::Movement(runs) => {
                for run in runs {
                    let Some(moved) = self.movement.get(run.kernel) else {
                        return Err(format!("runs movement kernel {}, which does not exist", run.kernel));
                    };
                    let pick = |positions: &[usize], regions: &[Region]| -> Option<Vec<Region>> {
                        positions.iter().map(|&p| regions.get(p).copied()).collect()
                    };
                    let (Some(ins), Some(outs)) = (pick(&run.inputs, inputs), pick(&run.outputs, outputs)) else {
                        return Err("names a buffer the instruction does not have".into());
                    };
                    let regions = ins.iter().chain(&outs);
                    if ins.len() != moved.num_inputs
                        || regions.clone().count() != moved.buffers.len()
                        || regions
                            .zip(&moved.buffers)
                            .any(|(r, b)| r.len != b.len * b.dtype.size() || !r.offset.is_multiple_of(b.dtype.size()))
                    {
                        return Err(format!("does not fit movement kernel {}", moved.name));
                    }
                }
            }
            GpuForm::Indexed(k) => {
                let expected = IndexedKernel::index_input(kernel)
                    .and_then(|at| inputs.get(at))
                    .and_then(|index| IndexedKernel::of(kernel, index.len));
                if self.indexed.get(*k).is_none() || expected.as_ref() != self.indexed.get(*k) {
                    return Err(format!("names indexed kernel {k}, which is not its {}'s", kernel.name()));
                }
                if inputs.len() != 2 || outputs.len() != 1 {
                    return Err("needs two inputs and one output".into());
                }
            }
            GpuForm::Attention(passes) => {
                let functions: Option<Vec<&AttentionFunction>> =
                    passes.iter().map(|&i| self.attention.get(i)).collect();
                let Some(functions) = functions else {
                    return Err("names an attention function that does not exist".into());
                };
                let expected = AttentionFunction::of(kernel, AttentionTarget::Gpu).unwrap_or_default();
                if functions.len() != expected.len() || functions.iter().zip(&expected).any(|(f, e)| *f != e) {
                    return Err(format!("its attention functions are not its {}'s", kernel.name()));
                }
            }
            GpuForm::Axis(k) => {
                let Some(axis) = self.axis.get(*k) else {
                    return Err(format!("names axis kernel {k}, which does not exist"));
                };
                // The buffers fit the builtin kernel (checked before), so they fit its form.
                if AxisKernel::of(kernel).as_ref() != Some(axis) {
                    return Err(format!("names axis kernel {k}, which is not its {}'s", kernel.name()));
                }
            }
            GpuForm::Grouped(k) => {
                // The buffers fit the builtin kernel (checked before), so they fit its form.
                if self.grouped.get(*k).is_none() || GroupedKernel::of(kernel).as_ref() != self.grouped.get(*k) {
                    return Err(format!("names grouped kernel {k}, which is not its {}'s", kernel.name()));
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use autotp_kernels::DType;

    use super::*;
    use crate::{Instruction, Program};

    fn region(offset: usize, len: usize) -> Region {
        Region { offset, len }
    }

    /// An expand of f32[1, 4] to [3, 4] and a gather of 2 i64 indices from an f32[5, 4] table,
    /// each with its GPU form.
    fn program() -> Program {
        let expand = Kernel::Expand { dtype: DType::F32, shape: vec![1, 4], out: vec![3, 4] };
        let gather =
            Kernel::Gather { dtype: DType::F32, index_dtype: DType::I64, data: vec![5, 4], axis: 0, block: None };
        let mut gpu_kernels = GpuKernels::default();
        let moved = autotp_kernels::kir_movement::movement_kernels(&expand).unwrap().remove(0);
        gpu_kernels.movement.push(moved.kernel);
        let run = MovementRun { kernel: 0, inputs: moved.inputs, outputs: moved.outputs };
        gpu_kernels.indexed.push(IndexedKernel::of(&gather, 16).unwrap());
        let instructions = vec![
            Instruction::Kernel {
                kernel: expand,
                inputs: vec![region(0, 16)],
                outputs: vec![region(64, 48)],
                label: "node 0 (expand)".into(),
                gpu: Some(GpuForm::Movement(vec![run])),
            },
            Instruction::Kernel {
                kernel: gather,
                inputs: vec![region(128, 80), region(256, 16)],
                outputs: vec![region(320, 32)],
                label: "node 1 (gather)".into(),
                gpu: Some(GpuForm::Indexed(0)),
            },
        ];
        let mut program = Program::bare(instructions, vec![], 512);
        program.gpu_kernels = gpu_kernels;
        program
    }

    fn refusal(program: &Program) -> String {
        program.validate().expect_err("refused").to_string()
    }

    fn form(program: &mut Program, i: usize) -> &mut GpuForm {
        let Instruction::Kernel { gpu: Some(form), .. } = &mut program.instructions[i] else { unreachable!() };
        form
    }

    #[test]
    fn gpu_forms_that_fit_their_instructions_validate() {
        program().validate().unwrap();
    }

    #[test]
    fn gpu_forms_that_do_not_fit_are_refused_naming_the_instruction() {
        let mut missing_kernel = program();
        *form(&mut missing_kernel, 0) =
            GpuForm::Movement(vec![MovementRun { kernel: 3, inputs: vec![0], outputs: vec![0] }]);
        let message = refusal(&missing_kernel);
        assert!(
            message.contains("instruction 0 (node 0 (expand))") && message.contains("movement kernel 3"),
            "{message}"
        );

        let mut missing_buffer = program();
        let GpuForm::Movement(runs) = form(&mut missing_buffer, 0) else { unreachable!() };
        runs[0].outputs = vec![1];
        assert!(refusal(&missing_buffer).contains("names a buffer the instruction does not have"));

        let mut other_movement = program();
        let wider = Kernel::Expand { dtype: DType::F32, shape: vec![1, 8], out: vec![3, 8] };
        let moved = autotp_kernels::kir_movement::movement_kernels(&wider).unwrap().remove(0);
        other_movement.gpu_kernels.movement[0] = moved.kernel;
        assert!(refusal(&other_movement).contains("does not fit movement kernel"));

        let mut other_shape = program();
        other_shape.gpu_kernels.indexed[0].indices = 3;
        let message = refusal(&other_shape);
        assert!(
            message.contains("instruction 1 (node 1 (gather))") && message.contains("not its gather's"),
            "{message}"
        );

        let mut on_the_expand = program();
        *form(&mut on_the_expand, 0) = GpuForm::Indexed(0);
        assert!(refusal(&on_the_expand).contains("not its expand's"));
    }

    /// An attention's GPU form names its passes, each cut for the GPU from its kernel.
    #[test]
    fn attention_forms_name_their_kernels_passes() {
        use autotp_kernels::attention::{AttentionDims, AttentionMask};
        let dims = AttentionDims {
            lead: vec![2],
            kv_lead: vec![2],
            q_len: 4,
            kv_len: 4,
            head_dim: 8,
            value_dim: 8,
            bias: None,
            query_runs: None,
            key_blocks: None,
        };
        let (dtype, mask) = (DType::F32, AttentionMask::Causal);
        let kernel = Kernel::Attention { dtype, dims: dims.clone(), scale: 0.5, mask, generated: true };
        let passes = AttentionFunction::of(&kernel, AttentionTarget::Gpu).unwrap();
        let attention = Instruction::Kernel {
            kernel,
            inputs: vec![region(0, 256), region(256, 256), region(512, 256)],
            outputs: vec![region(768, 256), region(1024, 32)],
            label: "node 0 (attention)".into(),
            gpu: Some(GpuForm::Attention(vec![0])),
        };
        let mut program = Program::bare(vec![attention], vec![], 1088);
        program.gpu_kernels.attention = passes;
        program.validate().unwrap();

        let mut missing = program.clone();
        *form(&mut missing, 0) = GpuForm::Attention(vec![1]);
        assert!(refusal(&missing).contains("an attention function that does not exist"));
        let mut other = program.clone();
        other.gpu_kernels.attention[0].mask = AttentionMask::None;
        let message = refusal(&other);
        assert!(message.contains("node 0 (attention)") && message.contains("not its attention's"), "{message}");
    }

    /// A top-k's form names its own axis kernel.
    #[test]
    fn axis_forms_name_their_kernel_over_its_buffers() {
        let top_k = Kernel::TopK { dtype: DType::F32, outer: 4, len: 8, inner: 1, k: 2, largest: true };
        let axis = AxisKernel::of(&top_k).unwrap();
        let instruction = Instruction::Kernel {
            kernel: top_k,
            inputs: vec![region(0, 128)],
            outputs: vec![region(128, 32), region(192, 64)],
            label: "node 0 (topk)".into(),
            gpu: Some(GpuForm::Axis(0)),
        };
        let mut program = Program::bare(vec![instruction], vec![], 256);
        program.gpu_kernels.axis.push(axis);
        program.validate().unwrap();

        let mut missing = program.clone();
        *form(&mut missing, 0) = GpuForm::Axis(1);
        assert!(refusal(&missing).contains("axis kernel 1, which does not exist"));
        let mut other = program.clone();
        other.gpu_kernels.axis[0].op = autotp_kernels::axis::AxisOp::TopK { k: 2, largest: false };
        let message = refusal(&other);
        assert!(message.contains("node 0 (topk)") && message.contains("not its topk's"), "{message}");
    }

    /// A grouped expert GEMM's form names its own grouped kernel, whatever rank's block of
    /// experts the instruction holds.
    #[test]
    fn grouped_forms_name_their_kernel() {
        use autotp_kernels::grouped::{GroupedDims, GroupedForm};
        use autotp_kernels::{IndexBlock, MatMulDims};
        let pair = MatMulDims {
            batch: vec![3],
            lhs_batch: vec![3],
            rhs_batch: vec![3],
            m: 4,
            k: 2,
            n: 1,
            transpose_lhs: false,
            transpose_rhs: false,
            lhs_layout: None,
            rhs_layout: None,
        };
        let block = Some(IndexBlock { mesh_axis: 0, start: 2, global_len: 4 });
        let dims = GroupedDims { pair, form: GroupedForm::GatheredLhs, experts: 2, block };
        let kernel = Kernel::GroupedMatMul { dtype: DType::F32, index_dtype: DType::I64, dims: Box::new(dims) };
        let grouped = GroupedKernel::of(&kernel).unwrap();
        assert_eq!(grouped.dims.block.map(|b| b.start), Some(0), "the launch gives the block's start");
        assert_eq!(grouped.builtin(2), kernel);
        let instruction = Instruction::Kernel {
            kernel,
            inputs: vec![region(0, 64), region(64, 24), region(128, 24)],
            outputs: vec![region(192, 48)],
            label: "node 0 (grouped)".into(),
            gpu: Some(GpuForm::Grouped(0)),
        };
        let mut program = Program::bare(vec![instruction], vec![], 256);
        program.gpu_kernels.grouped.push(grouped);
        program.validate().unwrap();

        let mut missing = program.clone();
        *form(&mut missing, 0) = GpuForm::Grouped(1);
        assert!(refusal(&missing).contains("grouped kernel 1, which is not its grouped_matmul's"));
        let mut other = program.clone();
        other.gpu_kernels.grouped[0].dims.experts = 4;
        let message = refusal(&other);
        assert!(message.contains("node 0 (grouped)") && message.contains("not its grouped_matmul's"), "{message}");
    }
}
