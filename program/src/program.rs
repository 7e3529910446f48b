//! `Program`: what the runtime executes. One arena of bytes per rank; every tensor lives at a
//! planned offset; instructions run kernels over those regions: builtin ones, or generated ones
//! (the program's [`kir`] kernels, JIT-compiled when the program is loaded). The runtime knows
//! nothing of the IR: codegen produces Programs.

use autotp_kernels::optim::OptimizerKernel;
use autotp_kernels::{kir, DType, Kernel, Optimizer};
use serde::{Deserialize, Serialize};

use crate::gpu::{GpuForm, GpuKernels};
use crate::mesh::{CollectiveOp, MeshAxis, Placement};
use crate::ProgramError;

/// A region of the arena.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Region {
    pub offset: usize,
    pub len: usize,
}

/// Where the host pool starts in the address space of regions: an offloaded optimizer's states
/// (`--offload-optimizer cpu`) are at `HOST_POOL + offset` in memory of their own, outside the
/// arena (which starts at 0).
pub const HOST_POOL: usize = 1 << 48;

impl Region {
    pub fn end(&self) -> usize {
        self.offset + self.len
    }

    /// Whether the region lies in the host pool rather than the arena.
    pub fn in_host_pool(&self) -> bool {
        self.offset >= HOST_POOL
    }

    pub fn overlaps(&self, other: &Region) -> bool {
        self.len > 0 && other.len > 0 && self.offset < other.end() && other.offset < self.end()
    }
}

/// A named tensor at a region: an input to feed, an output to read, or a parameter to load.
/// `shape` is what one rank holds; `global_shape` and `placements` (one per mesh axis) say
/// which block of the global tensor that is.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Slot {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub region: Region,
    pub global_shape: Vec<usize>,
    pub placements: Vec<Placement>,
}

impl Slot {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// One f32 or f64: a loss, or another scalar the trainer reports.
    pub fn is_float_scalar(&self) -> bool {
        self.numel() == 1 && matches!(self.dtype, DType::F32 | DType::F64)
    }

    /// The `(dim, parts, index)` cuts that give a rank at `coords` its block.
    pub fn cuts(&self, mesh: &[MeshAxis], coords: &[usize]) -> Vec<(usize, usize, usize)> {
        self.placements
            .iter()
            .zip(mesh)
            .zip(coords)
            .filter_map(|((p, axis), &c)| match p {
                Placement::Shard(d) => Some((*d, axis.size, c)),
                _ => None,
            })
            .collect()
    }

    /// True when the slot is the same on every rank.
    pub fn is_replicated(&self) -> bool {
        self.placements.iter().all(|p| *p == Placement::Replicate)
    }
}

/// Bytes written into the arena once, when the program is loaded.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ConstantData {
    pub region: Region,
    pub bytes: Vec<u8>,
}

/// After a run, the bytes at `from` replace those at `to` (a parameter or state).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Update {
    pub from: Region,
    pub to: Region,
}

/// One step of the program.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Instruction {
    /// Runs a builtin kernel. `label` names the IR op it came from, for profiles and errors.
    /// `gpu`: how a GPU runs it, as entries of the plan's PTX (chosen by codegen); `None`: on
    /// the host.
    Kernel {
        kernel: Kernel,
        inputs: Vec<Region>,
        outputs: Vec<Region>,
        label: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        gpu: Option<GpuForm>,
    },
    /// Runs the program's generated kernel `kernel` (an index into `Program::kernels`) on its
    /// buffers: `inputs`, then `outputs`.
    Generated { kernel: usize, inputs: Vec<Region>, outputs: Vec<Region>, label: String },
    /// A collective between the ranks of one mesh axis.
    Collective { op: CollectiveOp, input: Region, output: Region, label: String },
    /// Starts a collective on the rank's communication thread; the instructions up to its
    /// `Wait` neither write its input nor touch its output (`validate` checks it).
    CollectiveStart { op: CollectiveOp, input: Region, output: Region, label: String },
    /// Blocks until the collective started by instruction `start` has completed.
    Wait { start: usize, label: String },
    /// Hands a copy of `input` to the same mesh position of pipeline stage `to` (does not wait).
    Send { input: Region, to: usize, tag: u64, label: String },
    /// Waits for what pipeline stage `from` sent with `tag` and writes it to `output`.
    Recv { output: Region, from: usize, tag: u64, label: String },
    /// One optimizer step over many tensors in one pass (a multi-tensor kernel, as Apex's and
    /// DeepSpeed's fused optimizers), with one-element `scalars` (learning rate, step) shared
    /// by all. Each output is exactly its input's region (updated in place) or overlaps nothing
    /// the instruction touches (`validate` checks it).
    OptimizerStep {
        optimizer: Optimizer,
        dtype: DType,
        scalars: Vec<Region>,
        tensors: Vec<OptimizerTensor>,
        /// A bool: the step runs only when it is true (fp16/bf16 skip a step whose gradients are
        /// not finite); otherwise every parameter and state is left as it was.
        #[serde(default)]
        guard: Option<Region>,
        label: String,
    },
}

/// One tensor of an [`Instruction::OptimizerStep`]: `inputs` are the parameter, its gradient
/// and its states (as many as the optimizer keeps), `outputs` the new parameter and states.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct OptimizerTensor {
    pub inputs: Vec<Region>,
    pub outputs: Vec<Region>,
    /// The new parameter cast to a 16-bit type into this arena region too: a 16-bit model's
    /// copy of its offloaded f32 master, made by the step as DeepSpeed's CPU Adam makes it
    /// (rounded as the cast kernel rounds).
    #[serde(default)]
    pub copy: Option<(Region, DType)>,
}

/// The PTX of a program's kernels for one GPU architecture.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PtxModule {
    /// `sm_80`, `sm_90`.
    pub arch: String,
    pub code: String,
}

/// Byte counts of the memory plan, by category.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryPlan {
    pub params_bytes: usize,
    /// Persistent state (optimizer moments), zero at load.
    pub states_bytes: usize,
    pub inputs_bytes: usize,
    pub constants_bytes: usize,
    /// Peak bytes of intermediate values (activations) live at once.
    pub activations_peak_bytes: usize,
    /// Gradients as the optimizer receives them (inside the activations).
    #[serde(default)]
    pub grads_bytes: usize,
    /// The arena size: everything above, plus alignment padding.
    pub arena_bytes: usize,
    /// The host pool's bytes (`--offload-optimizer`'s states, `--offload-param`'s parameter
    /// shards), outside the arena.
    #[serde(default)]
    pub host_pool_bytes: usize,
    /// Parameters in the host pool (`--offload-param cpu`; inside `host_pool_bytes`, not in
    /// `params_bytes`).
    #[serde(default)]
    pub offloaded_params_bytes: usize,
    /// Bytes a step reads from offloaded parameters outside the optimizer step (the gathers of
    /// ZeRO-3's shards, each a fetch from host memory).
    #[serde(default)]
    pub param_fetch_bytes: usize,
    /// The host pool's last bytes, the parameter shards a rank keeps in a file
    /// (`--offload-param nvme`; inside `offloaded_params_bytes`), each on pages of its own
    /// ([`crate::param_file`]).
    #[serde(default)]
    pub nvme_params_bytes: usize,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Program {
    pub name: String,
    /// The device mesh; empty for one device. Every rank runs the same instructions.
    pub mesh: Vec<MeshAxis>,
    pub inputs: Vec<Slot>,
    pub outputs: Vec<Slot>,
    pub params: Vec<Slot>,
    pub states: Vec<Slot>,
    pub constants: Vec<ConstantData>,
    /// Copies applied after the instructions: a training step's new parameters and states.
    pub updates: Vec<Update>,
    pub instructions: Vec<Instruction>,
    /// The generated kernels that `Generated` instructions run.
    #[serde(default)]
    pub kernels: Vec<kir::Kernel>,
    /// The builtin kernels a GPU runs as entries of `ptx` (data movement, gathers and
    /// scatter-adds); empty when the plan was made without PTX.
    #[serde(default, skip_serializing_if = "GpuKernels::is_empty")]
    pub gpu_kernels: GpuKernels,
    /// `kernels`, the optimizer steps and `gpu_kernels` compiled for CUDA GPUs, one PTX module
    /// per architecture (kernel `i` is the entry `autotp_llvm::nvptx::entry_name(i)`); empty
    /// when the plan was made without them.
    #[serde(default)]
    pub ptx: Vec<PtxModule>,
    pub memory: MemoryPlan,
}

impl Instruction {
    /// What the instruction came from (`node N (op)`), for profiles and errors.
    pub fn label(&self) -> &str {
        match self {
            Instruction::Kernel { label, .. }
            | Instruction::Generated { label, .. }
            | Instruction::Collective { label, .. }
            | Instruction::CollectiveStart { label, .. }
            | Instruction::Wait { label, .. }
            | Instruction::Send { label, .. }
            | Instruction::Recv { label, .. }
            | Instruction::OptimizerStep { label, .. } => label,
        }
    }

    /// The regions the instruction reads and writes when it runs (a start reads and writes its
    /// regions until its wait; a wait touches nothing itself).
    pub fn regions(&self) -> (Vec<Region>, Vec<Region>) {
        match self {
            Instruction::Kernel { inputs, outputs, .. } | Instruction::Generated { inputs, outputs, .. } => {
                (inputs.clone(), outputs.clone())
            }
            Instruction::Collective { input, output, .. } | Instruction::CollectiveStart { input, output, .. } => {
                (vec![*input], vec![*output])
            }
            Instruction::Wait { .. } => (vec![], vec![]),
            Instruction::Send { input, .. } => (vec![*input], vec![]),
            Instruction::Recv { output, .. } => (vec![], vec![*output]),
            Instruction::OptimizerStep { scalars, tensors, guard, .. } => (
                scalars.iter().chain(guard).chain(tensors.iter().flat_map(|t| &t.inputs)).copied().collect(),
                tensors.iter().flat_map(|t| t.outputs.iter().copied().chain(t.copy.map(|(r, _)| r))).collect(),
            ),
        }
    }
}

impl Program {
    /// A program of `instructions` alone over an arena of `arena_bytes`, with no slots or
    /// kernels (for tests of instruction sequences).
    pub fn bare(instructions: Vec<Instruction>, mesh: Vec<MeshAxis>, arena_bytes: usize) -> Program {
        Program {
            kernels: vec![],
            gpu_kernels: GpuKernels::default(),
            ptx: vec![],
            name: "p".into(),
            mesh,
            inputs: vec![],
            outputs: vec![],
            params: vec![],
            states: vec![],
            constants: vec![],
            updates: vec![],
            instructions,
            memory: MemoryPlan { arena_bytes, ..Default::default() },
        }
    }

    /// Where the arena's activations start: after the parameters, states, inputs and constants,
    /// which have regions of their own; the memory plan reuses the rest.
    pub fn activations_start(&self) -> usize {
        let slots = self.params.iter().chain(&self.states).chain(&self.inputs).map(|s| s.region);
        let regions = slots.chain(self.constants.iter().map(|c| c.region)).filter(|r| !r.in_host_pool());
        regions.map(|r| r.end()).max().unwrap_or(0)
    }

    /// Whether a GPU running this program launches any kernel of its PTX: generated kernels,
    /// optimizer steps or builtin kernels' GPU forms. A program of none (only copies,
    /// collectives and cuBLAS GEMMs) carries no PTX and needs none.
    pub fn runs_gpu_kernels(&self) -> bool {
        !(self.kernels.is_empty() && self.gpu_kernels.is_empty() && self.optimizer_kernels().is_empty())
    }

    /// The multi-tensor kernels that the program's optimizer steps need, one per update rule
    /// and dtype, in order of first use.
    pub fn optimizer_kernels(&self) -> Vec<OptimizerKernel> {
        let mut kinds = Vec::new();
        for instruction in &self.instructions {
            if let Instruction::OptimizerStep { optimizer, dtype, .. } = instruction {
                let kind = OptimizerKernel { optimizer: optimizer.clone(), dtype: *dtype };
                if !kinds.contains(&kind) {
                    kinds.push(kind);
                }
            }
        }
        kinds
    }

    /// A SHA-256 of the whole program (slots, kernels with their attributes, constants, memory
    /// plan), in hex: two programs with the same fingerprint compute the same step on the same
    /// layout. Checkpoints record it; `.atp` files carry it to detect corruption.
    pub fn fingerprint(&self) -> String {
        use sha2::Digest;
        let json = serde_json::to_vec(self).expect("a Program always serializes");
        sha2::Sha256::digest(&json).iter().map(|b| format!("{b:02x}")).collect()
    }

    /// Whether `region` lies inside the arena or inside the host pool.
    pub fn holds(&self, region: &Region) -> bool {
        if region.in_host_pool() {
            region.end() - HOST_POOL <= self.memory.host_pool_bytes
        } else {
            region.end() <= self.memory.arena_bytes
        }
    }

    /// Checks that every region is inside the arena (or the host pool), that each instruction's regions have the
    /// sizes its kernel implies, and that no instruction's outputs overlap its inputs or each
    /// other; the executor relies on this to hand kernels disjoint slices of the right length.
    pub fn validate(&self) -> Result<(), ProgramError> {
        self.validate_data()?;
        let bad = |what: String| Err(ProgramError::InvalidProgram(what));
        let mut waited = vec![false; self.instructions.len()];
        for (i, instruction) in self.instructions.iter().enumerate() {
            let Some((inputs, outputs, label)) = self.instruction_operands(i, instruction, &mut waited)? else {
                continue;
            };
            for r in inputs.iter().chain(&outputs) {
                if !self.holds(r) {
                    return bad(format!("instruction {i} ({label}) reaches past the arena"));
                }
            }
            for (j, o) in outputs.iter().enumerate() {
                if inputs.iter().any(|r| r.overlaps(o)) || outputs[j + 1..].iter().any(|r| r.overlaps(o)) {
                    return bad(format!("instruction {i} ({label}) writes over one of its own operands"));
                }
            }
        }
        for (i, instruction) in self.instructions.iter().enumerate() {
            if matches!(instruction, Instruction::CollectiveStart { .. }) && !waited[i] {
                return bad(format!("the collective started at instruction {i} is never waited for"));
            }
        }
        Ok(())
    }

    /// The slots, constants and updates: inside the arena (or the host pool) with their sizes;
    /// the GPU's movement kernels inside their buffers.
    fn validate_data(&self) -> Result<(), ProgramError> {
        let size = self.memory.arena_bytes;
        let bad = |what: String| Err(ProgramError::InvalidProgram(what));
        for kernel in &self.gpu_kernels.movement {
            if let Err(e) = kernel.check() {
                return bad(format!("movement kernel {}: {e}", kernel.name));
            }
        }
        let slots = self.inputs.iter().chain(&self.outputs).chain(&self.params).chain(&self.states);
        for slot in slots {
            if !self.holds(&slot.region) {
                return bad(format!(
                    "slot '{}' ends at {} past the arena ({size} bytes)",
                    slot.name,
                    slot.region.end()
                ));
            }
            if slot.region.len != slot.numel() * slot.dtype.size() {
                return bad(format!(
                    "slot '{}' has {} bytes for {} elements of {}",
                    slot.name,
                    slot.region.len,
                    slot.numel(),
                    slot.dtype
                ));
            }
        }
        for c in &self.constants {
            if c.region.end() > size || c.region.in_host_pool() || c.bytes.len() != c.region.len {
                return bad(format!("a constant at offset {} does not fit its region", c.region.offset));
            }
        }
        for u in &self.updates {
            if !self.holds(&u.from)
                || !self.holds(&u.to)
                || u.from.len != u.to.len
                || (u.from != u.to && u.from.overlaps(&u.to))
            {
                return bad(format!("an update from offset {} to {} is out of place", u.from.offset, u.to.offset));
            }
        }
        Ok(())
    }

    /// Checks instruction `i` against its kernel, collective or start; returns the regions it
    /// reads and writes (`None` for an optimizer step, whose aliasing rules are its own and
    /// already checked).
    fn instruction_operands<'a>(
        &self,
        i: usize,
        instruction: &'a Instruction,
        waited: &mut [bool],
    ) -> Result<Option<Operands<'a>>, ProgramError> {
        let bad = |what: String| Err(ProgramError::InvalidProgram(what));
        let (inputs, outputs, label) = match instruction {
            Instruction::Kernel { kernel, inputs, outputs, label, gpu } => {
                let lengths = |regions: &[Region]| regions.iter().map(|r| r.len).collect::<Vec<_>>();
                if let Err(e) = kernel.check_buffers(&lengths(inputs), &lengths(outputs)) {
                    return bad(format!("instruction {i} ({label}): {e}"));
                }
                if let Some(Err(e)) =
                    gpu.as_ref().map(|form| self.gpu_kernels.check_form(form, kernel, inputs, outputs))
                {
                    return bad(format!("instruction {i} ({label}): its GPU form {e}"));
                }
                (inputs.clone(), outputs.clone(), label)
            }
            Instruction::Generated { kernel, inputs, outputs, label } => {
                let Some(k) = self.kernels.get(*kernel) else {
                    return bad(format!("instruction {i} ({label}) runs kernel {kernel}, which does not exist"));
                };
                if let Err(e) = k.check() {
                    return bad(format!("instruction {i} ({label}): {e}"));
                }
                let regions = inputs.iter().chain(outputs);
                if inputs.len() != k.num_inputs
                    || regions.clone().count() != k.buffers.len()
                    || regions
                        .clone()
                        .zip(&k.buffers)
                        .any(|(r, b)| r.len != b.len * b.dtype.size() || r.offset % b.dtype.size() != 0)
                {
                    return bad(format!("instruction {i} ({label}): its regions do not fit kernel {}", k.name));
                }
                (inputs.clone(), outputs.clone(), label)
            }
            Instruction::Collective { op, input, output, label }
            | Instruction::CollectiveStart { op, input, output, label } => {
                let CollectiveOp { kind, axis, dtype, shape } = op;
                let n = match self.mesh.get(*axis) {
                    Some(a) => a.size,
                    None => {
                        return bad(format!("instruction {i} ({label}) names mesh axis {axis}, which does not exist"))
                    }
                };
                let out_shape = kind.output_shape(shape, n);
                let bytes = |s: &[usize]| s.iter().product::<usize>() * dtype.size();
                if input.len != bytes(shape) || out_shape.is_none_or(|s| output.len != bytes(&s)) {
                    return bad(format!(
                        "instruction {i} ({label}): its regions do not fit {} of {shape:?}",
                        kind.name()
                    ));
                }
                (vec![*input], vec![*output], label)
            }
            Instruction::Wait { start, label } => {
                let Some(Instruction::CollectiveStart { input, output, .. }) =
                    self.instructions.get(*start).filter(|_| *start < i)
                else {
                    return bad(format!(
                        "instruction {i} ({label}) waits for instruction {start}, not an earlier start"
                    ));
                };
                if std::mem::replace(&mut waited[*start], true) {
                    return bad(format!("instruction {i} ({label}) waits a second time for instruction {start}"));
                }
                // In between, nothing may write the start's input or touch its output.
                for (k, between) in self.instructions[start + 1..i].iter().enumerate() {
                    let (reads, writes) = between.regions();
                    if writes.iter().any(|w| w.overlaps(input) || w.overlaps(output))
                        || reads.iter().any(|r| r.overlaps(output))
                    {
                        return bad(format!(
                            "instruction {} uses the regions of the collective started at {start} before its wait at {i}",
                            start + 1 + k
                        ));
                    }
                }
                (vec![], vec![], label)
            }
            Instruction::Send { label, .. } | Instruction::Recv { label, .. } => {
                let (reads, writes) = instruction.regions();
                (reads, writes, label)
            }
            Instruction::OptimizerStep { optimizer, dtype, scalars, tensors, guard, label } => {
                if guard.is_some_and(|g| g.len != 1) {
                    return bad(format!("instruction {i} ({label}): its guard is not one bool"));
                }
                if let Err(what) = check_optimizer_step(optimizer, *dtype, scalars, tensors) {
                    return bad(format!("instruction {i} ({label}): {what}"));
                }
                // Aliasing is checked above; only the arena bounds remain.
                let (reads, writes) = instruction.regions();
                for r in reads.iter().chain(&writes) {
                    if !self.holds(r) {
                        return bad(format!("instruction {i} ({label}) reaches past the arena"));
                    }
                }
                return Ok(None);
            }
        };
        Ok(Some((inputs, outputs, label.as_str())))
    }
}

/// The regions an instruction reads and writes, and its label.
type Operands<'a> = (Vec<Region>, Vec<Region>, &'a str);

/// The shape and aliasing rules of an optimizer step: every tensor's regions hold the same
/// number of `dtype` elements, aligned for it; each output is its own input or apart from every
/// other region of the step; no two outputs overlap.
fn check_optimizer_step(
    optimizer: &Optimizer,
    dtype: DType,
    scalars: &[Region],
    tensors: &[OptimizerTensor],
) -> Result<(), String> {
    if !matches!(dtype, DType::F32 | DType::F64) {
        return Err(format!("{} updates f32 or f64 parameters, not {dtype}", optimizer.name()));
    }
    if scalars.len() != optimizer.num_scalars() || scalars.iter().any(|s| s.len != dtype.size()) {
        return Err(format!("{} takes {} one-element scalars", optimizer.name(), optimizer.num_scalars()));
    }
    let states = optimizer.num_states();
    for (k, t) in tensors.iter().enumerate() {
        let len = t.inputs.first().map_or(0, |r| r.len);
        if let Some((copy, to)) = &t.copy {
            // The copy is the 16-bit parameter: in the host pool when the parameters are
            // offloaded too (`--offload-param`, which GPU ranks refuse).
            if !matches!(to, DType::F16 | DType::BF16) || copy.len * dtype.size() != len * to.size() {
                return Err(format!("tensor {k}'s copy does not fit a 16-bit copy of its parameter"));
            }
        }
        if t.inputs.len() != 2 + states
            || t.outputs.len() != 1 + states
            || t.inputs.iter().chain(&t.outputs).any(|r| r.len != len || r.offset % dtype.size() != 0)
            || len % dtype.size() != 0
        {
            return Err(format!("tensor {k}'s regions do not fit {} of {dtype}", optimizer.name()));
        }
    }
    // Each read with the (tensor, output) that may replace it in place.
    let replaced_by = |k: usize, i: usize| match i {
        0 => Some((k, 0)),
        1 => None,
        i => Some((k, i - 1)),
    };
    let reads: Vec<(Option<(usize, usize)>, Region)> = scalars
        .iter()
        .map(|&s| (None, s))
        .chain(
            tensors
                .iter()
                .enumerate()
                .flat_map(|(k, t)| t.inputs.iter().enumerate().map(move |(i, &r)| (replaced_by(k, i), r))),
        )
        .collect();
    let writes: Vec<(usize, usize, Region)> = tensors
        .iter()
        .enumerate()
        .flat_map(|(k, t)| {
            let copy = t.copy.map(|(r, _)| (k, t.outputs.len(), r));
            t.outputs.iter().enumerate().map(move |(j, &o)| (k, j, o)).chain(copy)
        })
        .collect();
    for (n, &(k, j, out)) in writes.iter().enumerate() {
        let clashes_with_read = reads.iter().any(|&(by, r)| r.overlaps(&out) && !(by == Some((k, j)) && r == out));
        if clashes_with_read || writes[n + 1..].iter().any(|(_, _, w)| w.overlaps(&out)) {
            return Err(format!("tensor {k}'s output {j} overlaps another region of the step"));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn program(kernel: Kernel, output_len: usize) -> Program {
        let transpose = Instruction::Kernel {
            kernel,
            inputs: vec![Region { offset: 0, len: 24 }],
            outputs: vec![Region { offset: 64, len: output_len }],
            label: "%3 = transpose".into(),
            gpu: None,
        };
        Program::bare(vec![transpose], vec![], 128)
    }

    #[test]
    fn regions_must_match_their_kernels() {
        let transpose = Kernel::Transpose { dtype: DType::F32, shape: vec![2, 3], perm: vec![1, 0] };
        program(transpose.clone(), 24).validate().unwrap();
        let err = program(transpose, 20).validate().unwrap_err().to_string();
        assert!(err.contains("instruction 0 (%3 = transpose): transpose: a buffer does not match"), "{err}");
        let bad_perm = Kernel::Transpose { dtype: DType::F32, shape: vec![2, 3], perm: vec![1, 1] };
        assert!(program(bad_perm, 24).validate().is_err());
        assert!(program(Kernel::Cast { from: DType::F32, to: DType::I64 }, 48).validate().is_ok());
        assert!(program(Kernel::Cast { from: DType::F32, to: DType::I64 }, 24).validate().is_err());
    }
    #[test]
    fn a_started_collective_is_left_alone_until_its_wait() {
        use crate::mesh::{Collective, CollectiveOp};
        let op = CollectiveOp { kind: Collective::AllReduce, axis: 0, dtype: DType::F32, shape: vec![2, 3] };
        let start = Instruction::CollectiveStart {
            op,
            input: Region { offset: 0, len: 24 },
            output: Region { offset: 32, len: 24 },
            label: "start".into(),
        };
        let reads_output = Instruction::Kernel {
            kernel: Kernel::Copy,
            inputs: vec![Region { offset: 32, len: 24 }],
            outputs: vec![Region { offset: 64, len: 24 }],
            label: "too early".into(),
            gpu: None,
        };
        let wait = Instruction::Wait { start: 0, label: "wait".into() };
        let mut p = program(Kernel::Copy, 24);
        p.mesh = vec![MeshAxis { name: "dp".into(), size: 2 }];
        p.instructions = vec![start.clone(), wait.clone()];
        p.validate().unwrap();
        p.instructions = vec![start.clone(), reads_output, wait];
        let err = p.validate().unwrap_err().to_string();
        assert!(
            err.contains("instruction 1 uses the regions of the collective started at 0 before its wait at 2"),
            "{err}"
        );
        p.instructions = vec![start];
        let err = p.validate().unwrap_err().to_string();
        assert!(err.contains("the collective started at instruction 0 is never waited for"), "{err}");
    }
}
