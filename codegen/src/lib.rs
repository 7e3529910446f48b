//! autotp-codegen: lowers a verified IR graph to a runtime [`Program`].
//!
//! Each fusion group becomes one generated kernel ([`autotp_kernelgen`]; its internal
//! values get no region), and each other node one instruction (but reshapes and waits, whose
//! results share their input's region, and the transposes, expert lookups and per-pair
//! products that other kernels read in place: `in_place.rs`): a generated kernel where the
//! kernel builder makes one (with [`KernelChoice::Generated`], the default), else the builtin
//! kernel (chosen by [`autotp_ir::lower::node_kernel`], the same one the reference evaluator
//! runs), or, for a collective or a pipeline send/recv, a communication step. A pipeline
//! stage's graph lowers to that stage's program. A graph on a mesh lowers to one SPMD program
//! that every rank runs: all shapes are local (`autotp_ir::sharding::local_type`), and slots record their
//! global shape and placements so each rank loads and feeds its own block. Values get arena
//! regions from a liveness-based first-fit plan ([`memory`]); the plan's byte counts are the
//! compile-time memory report, per rank.

pub mod gpu_kernels;
mod in_place;
pub mod memory;

use std::collections::{HashMap, HashSet};

use autotp_ir::sharding::local_type;
use autotp_ir::{Def, Graph, NodeId, Op, TensorType, ValueId};
use autotp_program::{
    CollectiveOp, ConstantData, Instruction, MemoryPlan, OptimizerTensor, Program, PtxModule, Region, Slot, Update,
};

use autotp_kernels::{Kernel, OperandLayout};
use in_place::{at_batch_rank, grouped_products, strided_operands, GroupedProducts};
use memory::{align, Arena};

#[derive(Debug, thiserror::Error)]
pub enum CodegenError {
    #[error("cannot lower an invalid graph: {0}")]
    Verify(#[from] autotp_ir::VerifyErrors),
    #[error("cannot generate the kernels' PTX: {0}")]
    Ptx(#[from] autotp_llvm::LlvmError),
}

/// Which kernels compute the graph's ops.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KernelChoice {
    /// The builtin kernels alone: the reference interpreter, the oracle of generated kernels.
    Builtin,
    /// Generated kernels ([`autotp_kernelgen`]) wherever one computes the op, builtin ones elsewhere.
    #[default]
    Generated,
}

/// How to lower a graph.
#[derive(Clone, Copy, Debug, Default)]
pub struct LowerOptions {
    pub kernels: KernelChoice,
    /// Choose the builtin kernels' GPU forms ([`gpu_kernels`]) for the plan.
    pub gpu_kernels: bool,
    /// With generated kernels: a mixture of experts' lookups and per-pair products as grouped
    /// expert GEMMs (`in_place.rs`; the compile's default, off under `--no-moe-grouped-gemm`).
    pub grouped_experts: bool,
    /// Also compile them, the generated kernels and the optimizer steps to PTX for every GPU
    /// architecture plans carry (implies `gpu_kernels`).
    pub ptx: bool,
    /// Place the optimizer's states in the host pool ([`autotp_program::HOST_POOL`]) instead of
    /// the arena (`--offload-optimizer cpu`).
    pub offload_optimizer: bool,
    /// Place the parameters sharded over the data-parallel axis (ZeRO-3's shards) in the host
    /// pool (`--offload-param cpu`, DeepSpeed's `offload_param`): the gathers read them from
    /// there, the optimizer updates them there, and the arena holds only the gathered copies in
    /// flight.
    pub offload_params: bool,
    /// With `offload_params`: the most elements of them kept in host memory, the first in
    /// parameter order (`--max-in-cpu`); the others go on pages of their own at the end of the
    /// host pool, which the runtime keeps in a file (`--offload-param nvme`,
    /// [`autotp_program::param_file`]). None keeps them all in memory.
    pub max_params_in_cpu: Option<usize>,
}

/// Whether `--offload-param` keeps parameter `p` in the host pool: ZeRO-3 shards it over the
/// data-parallel axis.
fn offloaded_param(graph: &Graph, p: ValueId) -> bool {
    let data_axis = graph.mesh.axes.iter().position(|a| a.name == autotp_ir::DATA_AXIS);
    data_axis.is_some_and(|a| matches!(graph.value(p).placements[a], autotp_ir::Placement::Shard(_)))
}

/// The type one rank holds of `v`.
pub(crate) fn local(graph: &Graph, v: ValueId) -> TensorType {
    local_type(&graph.mesh, graph.ty(v), &graph.value(v).placements)
}

fn slot(graph: &Graph, v: ValueId, name: String, region: Region) -> Slot {
    let ty = graph.ty(v);
    let placements = graph.value(v).placements.clone();
    Slot { name, dtype: ty.dtype, shape: local(graph, v).shape, region, global_shape: ty.shape.clone(), placements }
}

/// Regions that live for the whole program (parameters, inputs, constants), packed from 0.
#[derive(Default)]
struct Dedicated {
    next: usize,
}

impl Dedicated {
    fn region(&mut self, len: usize) -> Region {
        let offset = self.next;
        self.next += align(len.max(1));
        Region { offset, len }
    }

    /// Gives each value a region, adds their bytes to `total`, and returns their slots.
    fn place(
        &mut self,
        graph: &Graph,
        values: &[ValueId],
        regions: &mut [Option<Region>],
        total: &mut usize,
    ) -> Vec<Slot> {
        values
            .iter()
            .map(|&v| {
                let region = self.region(local(graph, v).size_bytes());
                *total += region.len;
                regions[v.index()] = Some(region);
                slot(graph, v, graph.name_of(v).unwrap_or("").to_string(), region)
            })
            .collect()
    }
}

/// The index of `kernel` in `kernels`, added if new (layers of one shape share kernels), with
/// its index arithmetic simplified ([`autotp_kernelgen::index_rewrite`]).
fn intern(kernels: &mut Vec<autotp_kernels::kir::Kernel>, mut kernel: autotp_kernels::kir::Kernel) -> usize {
    autotp_kernelgen::index_rewrite::simplify_kernel(&mut kernel);
    match kernels.iter().position(|k| *k == kernel) {
        Some(known) => known,
        None => {
            kernels.push(kernel);
            kernels.len() - 1
        }
    }
}

/// The values a fusion group makes that are read after it (by a later node, as a graph output
/// or an update): the group kernel's outputs.
fn fusion_outputs(graph: &Graph, fusion: &autotp_ir::Fusion, last_use: &[usize]) -> Vec<ValueId> {
    fusion
        .node_ids()
        .flat_map(|n| graph.node(n).outputs.iter().copied())
        .filter(|v| last_use[v.index()] >= fusion.nodes.end)
        .collect()
}

/// The input an optimizer node's output `j` is the new value of: the parameter (output 0) or
/// a state (output `j`, after the parameter and its gradient).
fn replaced_input(node: &autotp_ir::Node, j: usize) -> ValueId {
    node.inputs[if j == 0 { 0 } else { j + 1 }]
}

/// Lets each output of a multi-tensor optimizer step `fusion` take its input's bytes (the
/// parameter's for the new parameter, each state's for the new state) when the step reads that
/// input last and only once: the update is then made in place, and the copy after the step and
/// the output's memory go away. `root` and `last_use` are codegen's region-sharing and liveness
/// tables, updated for the values that now share.
fn update_in_place(graph: &Graph, fusion: &autotp_ir::Fusion, root: &mut [usize], last_use: &mut [usize]) {
    let nodes: Vec<_> = fusion.node_ids().collect();
    let mut reads = HashMap::<usize, usize>::new();
    for &n in &nodes {
        for v in &graph.node(n).inputs {
            *reads.entry(root[v.index()]).or_default() += 1;
        }
    }
    let graph_inputs: HashSet<usize> = graph.inputs().iter().map(|v| v.index()).collect();
    for &n in &nodes {
        let node = graph.node(n);
        for (k, &output) in node.outputs.iter().enumerate() {
            let input = root[replaced_input(node, k).index()];
            let is_constant = matches!(
                graph.value(ValueId(input as u32)).def,
                Def::Node(c, _) if matches!(graph.node(c).op, Op::Constant { .. })
            );
            let in_place = reads[&input] == 1
                && fusion.nodes.contains(&last_use[input])
                && !graph_inputs.contains(&input)
                && !is_constant
                && local(graph, ValueId(input as u32)).size_bytes() == local(graph, output).size_bytes();
            if !in_place {
                continue;
            }
            let output = output.index();
            for shared in root.iter_mut().filter(|r| **r == output) {
                *shared = input;
            }
            last_use[input] = last_use[input].max(last_use[output]);
        }
    }
}

/// What a multi-tensor step takes over from the nodes after it. Where a plan skips the steps
/// whose gradients are not finite, every new value is kept by `select(finite, new, old)` (its
/// update), and a 16-bit parameter is `select(finite, cast(new master), old)`, where `old` is
/// the parameter or, under ZeRO 1/2, this rank's shard of it (a `shard_slice` that the select's
/// result is all-gathered from): folded, the step runs in place only when `finite` holds. An
/// offloaded step also writes the 16-bit copy over `old` itself (as DeepSpeed's CPU Adam does),
/// so no kernel reads the offloaded states but the step; elsewhere the cast and its select stay
/// nodes of their own (a GPU's step kernel writes no 16-bit copies), the cast reading the
/// master that the step left as it was or updated.
struct GuardedStep {
    guard: ValueId,
    /// The selects and casts the step does the work of.
    folded: Vec<autotp_ir::NodeId>,
    /// Per member of the group: the value its new master's 16-bit copy is (the cast's select)
    /// and the old 16-bit value it replaces (the parameter, or its shard).
    copies: Vec<Option<(ValueId, ValueId)>>,
}

/// The [`GuardedStep`] of each multi-tensor step group (by its first node), when every one of
/// them folds and no fusion group mixes folded nodes with others; else none.
fn guarded_steps(graph: &Graph, steps: &[&autotp_ir::Fusion], offloaded: bool) -> HashMap<usize, GuardedStep> {
    let consumers = graph.consumers();
    let updates: HashMap<ValueId, ValueId> = graph.updates().iter().map(|&(target, value)| (value, target)).collect();
    // A parameter, or a value made before the step starting at node `first`.
    let made_before = |v: ValueId, first: usize| match graph.value(v).def {
        Def::Node(n, _) => n.index() < first && !matches!(graph.node(n).op, Op::Constant { .. }),
        _ => graph.params().contains(&v),
    };
    // `select(guard, value, old)` reading `value`, whose result updates `old`, or takes the
    // place of `old` made before the step starting at `first` (an f32 parameter's shard under
    // ZeRO 1/2, all-gathered after the step).
    let kept_by_select = |value: ValueId, old: ValueId, first: usize| -> Option<(autotp_ir::NodeId, ValueId)> {
        let select = *consumers[value.index()].iter().find(|&&c| graph.node(c).op == Op::Select)?;
        let node = graph.node(select);
        let made_here = matches!(graph.value(old).def, Def::Node(..)) && made_before(old, first);
        let takes_place = updates.get(&node.outputs[0]) == Some(&old) || made_here;
        (node.inputs[1] == value && node.inputs[2] == old && takes_place).then_some((select, node.inputs[0]))
    };
    let mut guarded = HashMap::new();
    for f in steps {
        let (mut step_guard, mut folded, mut copies) = (None, Vec::new(), Vec::new());
        for member in f.node_ids() {
            let node = graph.node(member);
            let mut copy = None;
            for (j, &new) in node.outputs.iter().enumerate() {
                let old = replaced_input(node, j);
                let Some((select, guard)) = kept_by_select(new, old, f.nodes.start) else { return HashMap::new() };
                let mut expected = 1;
                if j == 0 {
                    let cast = consumers[new.index()].iter().copied().find(|&c| {
                        matches!(graph.node(c).op, Op::Cast { to: autotp_ir::DType::BF16 | autotp_ir::DType::F16 })
                    });
                    if cast.is_some() {
                        // The new master's other reader: its cast, folded into an offloaded step.
                        expected = 2;
                    }
                    if let Some(cast) = cast.filter(|_| offloaded) {
                        let half = graph.node(cast).outputs[0];
                        let Some(&param_select) = consumers[half.index()].first() else { return HashMap::new() };
                        let select = graph.node(param_select);
                        let old = select.inputs[2];
                        if select.op != Op::Select
                            || select.inputs[..2] != [guard, half]
                            || consumers[half.index()].len() != 1
                            || !made_before(old, f.nodes.start)
                        {
                            return HashMap::new();
                        }
                        folded.extend([cast, param_select]);
                        copy = Some((select.outputs[0], old));
                    }
                }
                if consumers[new.index()].len() != expected || step_guard.is_some_and(|g| g != guard) {
                    return HashMap::new();
                }
                step_guard = Some(guard);
                folded.push(select);
            }
            copies.push(copy);
        }
        let Some(guard) = step_guard else { return HashMap::new() };
        guarded.insert(f.nodes.start, GuardedStep { guard, folded, copies });
    }
    let folded: HashSet<usize> = guarded.values().flat_map(|g| g.folded.iter().map(|n| n.index())).collect();
    let mixed = graph.fusions().iter().any(|f| {
        let inside = f.nodes.clone().filter(|n| folded.contains(n)).count();
        inside > 0 && inside < f.nodes.len()
    });
    // In place, the old values must have no reader after the step but the step and the folded.
    let read_after = steps.iter().any(|f| {
        f.node_ids().any(|member| {
            let node = graph.node(member);
            let olds = (0..node.outputs.len()).map(|j| replaced_input(node, j));
            let params = guarded[&f.nodes.start].copies.iter().flatten().map(|&(_, old)| old);
            olds.chain(params).any(|old| {
                consumers[old.index()].iter().any(|c| {
                    c.index() >= f.nodes.start && !f.nodes.contains(&c.index()) && !folded.contains(&c.index())
                })
            })
        })
    });
    if mixed || read_after {
        return HashMap::new();
    }
    guarded
}

/// Frees the regions of the values that die.
fn release(dying: Vec<usize>, regions: &[Option<Region>], allocator: &mut Arena, live_bytes: &mut usize) {
    for v in dying {
        let region = regions[v].expect("placed");
        allocator.free(region.offset);
        *live_bytes -= region.len;
    }
}

/// Lowers `graph` to the program every rank of its mesh runs (one device for an empty mesh),
/// with the default options (generated kernels).
pub fn lower(graph: &Graph) -> Result<Program, CodegenError> {
    lower_with(graph, &LowerOptions::default())
}

/// Lowers `graph` as [`lower`] does, with `options`.
pub fn lower_with(graph: &Graph, options: &LowerOptions) -> Result<Program, CodegenError> {
    let (mut program, planned) = lower_placed(graph, options, None)?;
    if let Some(offsets) = planned {
        program = lower_placed(graph, options, Some(offsets))?.0;
    }
    if options.gpu_kernels || options.ptx {
        gpu_kernels::choose_gpu_forms(&mut program);
    }
    if options.ptx {
        program.ptx = ptx_modules(&program)?;
    }
    Ok(program)
}

/// `program`'s PTX, one module per architecture, of every kernel a GPU runs: generated kernels,
/// optimizer steps and the builtin kernels' GPU forms. The architectures compile on threads of
/// their own (each an LLVM context of its own).
fn ptx_modules(program: &Program) -> Result<Vec<PtxModule>, CodegenError> {
    if !program.runs_gpu_kernels() {
        return Ok(Vec::new());
    }
    let optimizer_steps = program.optimizer_kernels();
    let entries = autotp_llvm::nvptx::GpuEntries {
        kernels: &program.kernels,
        optimizer_steps: &optimizer_steps,
        movement: &program.gpu_kernels.movement,
        indexed: &program.gpu_kernels.indexed,
        attention: &program.gpu_kernels.attention,
        axis: &program.gpu_kernels.axis,
        grouped: &program.gpu_kernels.grouped,
    };
    let compile = |arch: autotp_llvm::nvptx::Arch| {
        let code = autotp_llvm::nvptx::program_ptx(&entries, arch)?;
        Ok(PtxModule { arch: arch.name().to_string(), code })
    };
    let compile = &compile;
    std::thread::scope(|scope| {
        let threads: Vec<_> =
            autotp_llvm::nvptx::Arch::ALL.iter().map(|&arch| scope.spawn(move || compile(arch))).collect();
        threads.into_iter().map(|t| t.join().expect("a PTX thread panicked")).collect()
    })
}

/// Lowers `graph`, its activations placed first fit, or at `offsets` (in allocation order);
/// with the offsets of a smaller placement of the same allocations, when there is one
/// ([`memory`]).
fn lower_placed(
    graph: &Graph,
    options: &LowerOptions,
    offsets: Option<Vec<usize>>,
) -> Result<(Program, Option<Vec<usize>>), CodegenError> {
    autotp_ir::verify(graph)?;
    let mut regions: Vec<Option<Region>> = vec![None; graph.num_values()];
    let mut memory = MemoryPlan::default();
    let mut dedicated = Dedicated::default();
    let mut host_pool = Dedicated { next: autotp_program::HOST_POOL };
    let mut in_cpu_left = options.max_params_in_cpu.unwrap_or(usize::MAX);
    let mut in_file = Vec::new();
    for &p in graph.params() {
        if !(options.offload_params && offloaded_param(graph, p)) {
            dedicated.place(graph, &[p], &mut regions, &mut memory.params_bytes);
            continue;
        }
        let elements = local(graph, p).numel();
        match elements <= in_cpu_left {
            true => {
                in_cpu_left -= elements;
                host_pool.place(graph, &[p], &mut regions, &mut memory.offloaded_params_bytes);
            }
            false => {
                in_cpu_left = 0;
                in_file.push(p);
            }
        }
    }
    let inputs = dedicated.place(graph, graph.inputs(), &mut regions, &mut memory.inputs_bytes);
    let states = if options.offload_optimizer {
        host_pool.place(graph, graph.states(), &mut regions, &mut 0)
    } else {
        dedicated.place(graph, graph.states(), &mut regions, &mut memory.states_bytes)
    };
    if !in_file.is_empty() {
        // Each shard in the file on pages of its own: direct reads and writes, and pages the
        // runtime gives back between uses.
        let page = autotp_program::offload::BLOCK;
        host_pool.next = host_pool.next.next_multiple_of(page);
        let tail = host_pool.next;
        for &p in &in_file {
            host_pool.place(graph, &[p], &mut regions, &mut memory.offloaded_params_bytes);
            host_pool.next = host_pool.next.next_multiple_of(page);
        }
        memory.nvme_params_bytes = host_pool.next - tail;
    }
    let params = (graph.params().iter())
        .map(|&p| {
            let region = regions[p.index()].expect("placed above");
            slot(graph, p, graph.name_of(p).unwrap_or("").to_string(), region)
        })
        .collect();
    // The pool holds the aligned regions, not only their bytes.
    memory.host_pool_bytes = host_pool.next - autotp_program::HOST_POOL;
    let mut constants = Vec::new();
    for (_, node) in graph.nodes() {
        if let Op::Constant { value } = &node.op {
            let region = dedicated.region(value.ty.size_bytes());
            memory.constants_bytes += region.len;
            regions[node.outputs[0].index()] = Some(region);
            constants.push(ConstantData { region, bytes: value.bytes().to_vec() });
        }
    }
    let lifetimes = Lifetimes::of(graph, options);
    let allocator = match offsets {
        Some(offsets) => Arena::replaying(dedicated.next, offsets),
        None => Arena::first_fit(dedicated.next),
    };
    let mut lowering = Lowering {
        graph,
        options,
        regions,
        by_last_use: vec![Vec::new(); graph.num_nodes() + 1],
        lifetimes,
        allocator,
        live_bytes: 0,
        memory,
        instructions: Vec::new(),
        kernels: Vec::new(),
        start_instruction: vec![usize::MAX; graph.num_nodes()],
        in_fused_group: vec![false; graph.num_nodes()],
        names: autotp_ir::text::ValueNames::new(graph),
    };
    // Fusion groups that lower to one kernel or optimizer step, by their first node.
    let mut fusion_at: Vec<Option<&autotp_ir::Fusion>> = vec![None; graph.num_nodes()];
    if options.kernels == KernelChoice::Generated {
        for f in graph.fusions() {
            fusion_at[f.nodes.start] = Some(f);
        }
    }
    for (id, node) in graph.nodes() {
        if matches!(node.op, Op::Constant { .. }) {
            continue;
        }
        // A node its group's kernel, or a grouped GEMM, computes only releases what dies here.
        if !lowering.in_fused_group[id.index()] && !lowering.lifetimes.grouped.absorbed.contains(&id) {
            let step = fusion_at[id.index()]
                .and_then(|f| Some((f, lowering.lifetimes.optimizer_steps.remove(&f.nodes.start)?)));
            if let Some((fusion, optimizer)) = step {
                lowering.optimizer_step(id, fusion, optimizer);
            } else if !fusion_at[id.index()].is_some_and(|f| lowering.fused_group(id, f)) {
                lowering.node(id, node);
            }
        }
        lowering.release(id);
    }
    lowering.finish(params, inputs, states, constants)
}

/// Which values share a region and until when each region is read.
struct Lifetimes {
    /// The value whose region each value uses (itself, or the value whose bytes it is: a
    /// wait's start, a reshaped intermediate, a transpose a matmul reads through strides, an
    /// optimizer step's output written over its input).
    root: Vec<usize>,
    /// The last node that reads each value (the end for graph outputs and updates).
    last_use: Vec<usize>,
    /// The fusion groups that are multi-tensor optimizer steps, by their first node.
    optimizer_steps: HashMap<usize, autotp_kernels::Optimizer>,
    /// Steps guarded by the finiteness of the gradients, by their first node.
    guarded: HashMap<usize, GuardedStep>,
    /// Transposes read by a matmul alone, and how the matmul reads their input in place.
    layouts: HashMap<ValueId, OperandLayout>,
    /// The grouped expert GEMMs, and the gathers and matmuls whose work they do.
    grouped: GroupedProducts,
}

impl Lifetimes {
    fn of(graph: &Graph, options: &LowerOptions) -> Lifetimes {
        // Values that are another's bytes share its region: a wait's result is its start's
        // output, and a reshape of an intermediate is the same bytes (no copy).
        let mut root: Vec<usize> = (0..graph.num_values()).collect();
        let is_intermediate = |v: ValueId| matches!(graph.value(v).def, Def::Node(n, _) if !matches!(graph.node(n).op, Op::Constant { .. }));
        for (_, node) in graph.nodes() {
            let shares = match node.op {
                Op::Wait => true,
                Op::Reshape { .. } => is_intermediate(node.inputs[0]),
                _ => false,
            };
            if shares {
                root[node.outputs[0].index()] = root[node.inputs[0].index()];
            }
        }
        // Transposes read by a matmul alone: the matmul reads their input in place through
        // strides and they make nothing (their value is their input's bytes, like a reshape's).
        let generated = options.kernels == KernelChoice::Generated;
        let layouts = if generated { strided_operands(graph) } else { HashMap::new() };
        for v in layouts.keys() {
            let Def::Node(transpose, _) = graph.value(*v).def else { unreachable!("a transpose's value") };
            root[v.index()] = root[graph.node(transpose).inputs[0].index()];
        }
        // Last reader of each region; graph outputs stay live to the end.
        let end = graph.num_nodes();
        let mut last_use = vec![0usize; graph.num_values()];
        for (id, node) in graph.nodes() {
            for v in &node.inputs {
                last_use[v.index()] = id.index();
            }
        }
        for v in graph.outputs().iter().map(|(_, v)| v).chain(graph.updates().iter().map(|(_, v)| v)) {
            last_use[v.index()] = end;
        }
        for v in 0..graph.num_values() {
            last_use[root[v]] = last_use[root[v]].max(last_use[v]);
        }
        // A grouped GEMM reads the table and vectors of the gathers and products it absorbs.
        let grouped = match generated && options.grouped_experts {
            true => grouped_products(graph, &layouts),
            false => GroupedProducts::default(),
        };
        for (node, (_, inputs)) in &grouped.kernels {
            for v in inputs {
                last_use[root[v.index()]] = last_use[root[v.index()]].max(node.index());
            }
        }
        let mut lifetimes =
            Lifetimes { root, last_use, optimizer_steps: HashMap::new(), guarded: HashMap::new(), layouts, grouped };
        if generated {
            lifetimes.optimizer_steps_in_place(graph, options);
        }
        // A started collective's input lives until its wait (the communication thread reads it).
        for (id, node) in graph.nodes() {
            if node.op == Op::Wait {
                let Def::Node(start, _) = graph.value(node.inputs[0]).def else {
                    unreachable!("verified: a wait waits for a start")
                };
                let input = lifetimes.root[graph.node(start).inputs[0].index()];
                lifetimes.last_use[input] = lifetimes.last_use[input].max(id.index());
            }
        }
        lifetimes
    }

    /// Finds the fusion groups that are multi-tensor optimizer steps and lets their outputs
    /// take their inputs' regions, guarded by the finiteness of the gradients where the plan's
    /// selects of it fold into the steps.
    fn optimizer_steps_in_place(&mut self, graph: &Graph, options: &LowerOptions) {
        let steps: Vec<(&autotp_ir::Fusion, autotp_kernels::Optimizer)> = (graph.fusions().iter())
            .filter_map(|f| {
                Some((f, autotp_ir::lower::multi_tensor_optimizer(graph, &f.node_ids().collect::<Vec<_>>())?))
            })
            .collect();
        let fusions: Vec<&autotp_ir::Fusion> = steps.iter().map(|(f, _)| *f).collect();
        self.guarded = guarded_steps(graph, &fusions, options.offload_optimizer);
        let (root, last_use) = (&mut self.root, &mut self.last_use);
        for (f, optimizer) in steps {
            match self.guarded.get(&f.nodes.start) {
                Some(step) => {
                    for member in f.node_ids() {
                        let node = graph.node(member);
                        for (j, &new) in node.outputs.iter().enumerate() {
                            root[new.index()] = root[replaced_input(node, j).index()];
                        }
                    }
                    for &folded in &step.folded {
                        let node = graph.node(folded);
                        let old = if node.op == Op::Select { node.inputs[2] } else { node.outputs[0] };
                        let held = root[old.index()];
                        root[node.outputs[0].index()] = held;
                        // A shard's region now holds the kept value: it lives as long as that.
                        last_use[held] = last_use[held].max(last_use[node.outputs[0].index()]);
                    }
                    for &(copy, old) in step.copies.iter().flatten() {
                        let Def::Node(select, _) = graph.value(copy).def else { unreachable!("a select's value") };
                        let cast = graph.node(select).inputs[1];
                        root[cast.index()] = root[old.index()];
                        // A shard's region now holds the copy too: it lives as long as the copy.
                        let held = root[old.index()];
                        last_use[held] = last_use[held].max(last_use[copy.index()]).max(last_use[cast.index()]);
                    }
                }
                None => update_in_place(graph, f, root, last_use),
            }
            self.optimizer_steps.insert(f.nodes.start, optimizer);
        }
    }
}

/// A graph being lowered: the regions placed and the instructions emitted so far.
struct Lowering<'g> {
    graph: &'g Graph,
    options: &'g LowerOptions,
    regions: Vec<Option<Region>>,
    lifetimes: Lifetimes,
    /// The values whose regions are freed after each node.
    by_last_use: Vec<Vec<usize>>,
    allocator: Arena,
    live_bytes: usize,
    memory: MemoryPlan,
    instructions: Vec<Instruction>,
    kernels: Vec<autotp_kernels::kir::Kernel>,
    /// The instruction each started collective became (its wait names it).
    start_instruction: Vec<usize>,
    /// Nodes a group's kernel or optimizer step computes.
    in_fused_group: Vec<bool>,
    /// The values' names in the graph's printed text, which instructions' labels use.
    names: autotp_ir::text::ValueNames<'g>,
}

impl Lowering<'_> {
    fn region(&self, v: &ValueId) -> Region {
        self.regions[v.index()].expect("defined before use")
    }

    /// A new region for `o`, made at node `at`, freed after its last use.
    fn allocate(&mut self, o: ValueId, at: usize) -> Region {
        let len = local(self.graph, o).size_bytes();
        let region = Region { offset: self.allocator.alloc(len), len };
        self.live_bytes += len;
        self.by_last_use[self.lifetimes.last_use[o.index()].max(at)].push(o.index());
        self.regions[o.index()] = Some(region);
        region
    }

    fn note_peak(&mut self) {
        self.memory.activations_peak_bytes = self.memory.activations_peak_bytes.max(self.live_bytes);
    }

    /// Frees the regions of the values that die at node `id`.
    fn release(&mut self, id: NodeId) {
        release(
            std::mem::take(&mut self.by_last_use[id.index()]),
            &self.regions,
            &mut self.allocator,
            &mut self.live_bytes,
        );
    }

    /// A fusion group of optimizer updates as one multi-tensor step (see [`Instruction::OptimizerStep`]).
    fn optimizer_step(&mut self, id: NodeId, fusion: &autotp_ir::Fusion, optimizer: autotp_kernels::Optimizer) {
        let graph = self.graph;
        let node = graph.node(id);
        // One rule, dtype and scalars for all (`multi_tensor_optimizer` checked it).
        let tensor_inputs = 2 + optimizer.num_states();
        let dtype = graph.ty(node.inputs[0]).dtype;
        let scalars = node.inputs[tensor_inputs..].iter().map(|v| self.region(v)).collect();
        let mut tensors: Vec<OptimizerTensor> = fusion
            .node_ids()
            .map(|member| OptimizerTensor {
                inputs: graph.node(member).inputs[..tensor_inputs].iter().map(|v| self.region(v)).collect(),
                outputs: vec![],
                copy: None,
            })
            .collect();
        for (member, tensor) in fusion.node_ids().zip(&mut tensors) {
            for &o in &graph.node(member).outputs {
                let root = self.lifetimes.root[o.index()];
                let placed = if root != o.index() {
                    let placed = self.regions[root].expect("an in-place output's input is placed");
                    self.regions[o.index()] = Some(placed);
                    placed
                } else {
                    self.allocate(o, id.index())
                };
                tensor.outputs.push(placed);
            }
        }
        // Guarded: the selects and casts after the step are its work, in place.
        let mut guard = None;
        if let Some(step) = self.lifetimes.guarded.get(&fusion.nodes.start) {
            let root = &self.lifetimes.root;
            guard = Some(self.regions[root[step.guard.index()]].expect("the guard is computed before the step"));
            for &folded in &step.folded {
                for &o in &graph.node(folded).outputs {
                    self.regions[o.index()] = self.regions[root[o.index()]];
                }
                self.in_fused_group[folded.index()] = true;
            }
            for (tensor, copy) in tensors.iter_mut().zip(&step.copies) {
                if let Some((copy, _)) = copy {
                    let region = self.regions[copy.index()].expect("the parameter's region");
                    tensor.copy = Some((region, graph.ty(*copy).dtype));
                }
            }
        }
        self.note_peak();
        let label = format!(
            "fusion {}, nodes {}..{} ({})",
            fusion.name,
            fusion.nodes.start,
            fusion.nodes.end,
            optimizer.multi_tensor_name()
        );
        self.instructions.push(Instruction::OptimizerStep { optimizer, dtype, scalars, tensors, guard, label });
        for member in fusion.nodes.clone() {
            self.in_fused_group[member] = true;
        }
    }

    /// A fusion group as one generated kernel, when the kernel builder makes one; `false` (and
    /// nothing emitted) when it does not, and the group's nodes lower one by one.
    fn fused_group(&mut self, id: NodeId, fusion: &autotp_ir::Fusion) -> bool {
        let graph = self.graph;
        let nodes: Vec<_> = fusion.node_ids().collect();
        let fused_outputs = fusion_outputs(graph, fusion, &self.lifetimes.last_use);
        // A cross-entropy reading a cast of its 16-bit scores: its two kernels read them.
        if let Some([rows, total]) = autotp_kernelgen::cross_entropy(graph, &nodes) {
            let (cast, ce) = (graph.node(nodes[0]), graph.node(nodes[1]));
            let &[loss] = &fused_outputs[..] else { return false };
            self.allocate(loss, id.index());
            self.note_peak();
            let inputs = vec![self.region(&cast.inputs[0]), self.region(&ce.inputs[1])];
            let label = format!(
                "fusion {}, nodes {}..{} (fused:cast+cross_entropy)",
                fusion.name, fusion.nodes.start, fusion.nodes.end
            );
            let loss = self.region(&loss);
            self.cross_entropy(rows, total, inputs, loss, label);
            for member in fusion.nodes.clone() {
                self.in_fused_group[member] = true;
            }
            return true;
        }
        let Some(built) = autotp_kernelgen::try_build(graph, &nodes, &fused_outputs) else { return false };
        for o in &fused_outputs {
            self.allocate(*o, id.index());
        }
        self.note_peak();
        let inputs = built.inputs.iter().map(|v| self.region(v)).collect();
        let outputs = fused_outputs.iter().map(|v| self.region(v)).collect();
        let label = format!(
            "fusion {}, nodes {}..{} (fused:{})",
            fusion.name, fusion.nodes.start, fusion.nodes.end, built.kernel.name
        );
        self.generated(built.kernel, inputs, outputs, label);
        for member in fusion.nodes.clone() {
            self.in_fused_group[member] = true;
        }
        true
    }

    /// One node: a wait or a value sharing another's region, a collective, a pipeline message,
    /// a generated kernel, or its builtin kernel.
    fn node(&mut self, id: NodeId, node: &autotp_ir::Node) {
        let graph = self.graph;
        let shared = node.outputs.first().filter(|o| self.lifetimes.root[o.index()] != o.index());
        if let Some(&out) = shared {
            self.regions[out.index()] = self.regions[self.lifetimes.root[out.index()]];
            if node.op == Op::Wait {
                let Def::Node(start, _) = graph.value(node.inputs[0]).def else { unreachable!("verified") };
                let label = format!("node {} ({})", id.index(), self.names.node(graph, id));
                self.instructions.push(Instruction::Wait { start: self.start_instruction[start.index()], label });
            }
            return;
        }
        for &o in &node.outputs {
            self.allocate(o, id.index());
        }
        self.note_peak();
        let label = format!("node {} ({})", id.index(), self.names.node(graph, id));
        let outputs: Vec<Region> = node.outputs.iter().map(|v| self.region(v)).collect();
        if let Some((kernel, reads)) = self.lifetimes.grouped.kernels.get(&id) {
            let inputs = reads.iter().map(|v| self.region(v)).collect();
            let kernel = kernel.clone();
            self.instructions.push(Instruction::Kernel { kernel, inputs, outputs, label, gpu: None });
            return;
        }
        let inputs: Vec<Region> = node.inputs.iter().map(|v| self.region(v)).collect();
        let generated = self.options.kernels == KernelChoice::Generated;
        if let Op::Collective { kind, axis, start } = &node.op {
            let input = local(graph, node.inputs[0]);
            let op = CollectiveOp {
                kind: *kind,
                axis: graph.mesh.axes.iter().position(|a| &a.name == axis).expect("verified: the axis exists"),
                dtype: input.dtype,
                shape: input.shape,
            };
            let (input, output) = (inputs[0], outputs[0]);
            if *start {
                self.start_instruction[id.index()] = self.instructions.len();
                self.instructions.push(Instruction::CollectiveStart { op, input, output, label });
            } else {
                self.instructions.push(Instruction::Collective { op, input, output, label });
            }
        } else if let Op::Send { to, tag, .. } = node.op {
            self.instructions.push(Instruction::Send { input: inputs[0], to, tag, label });
        } else if let Op::Recv { from, tag, .. } = node.op {
            self.instructions.push(Instruction::Recv { output: outputs[0], from, tag, label });
        } else if let Some([rows, total]) = generated.then(|| autotp_kernelgen::cross_entropy(graph, &[id])).flatten() {
            self.cross_entropy(rows, total, inputs, outputs[0], label);
        } else if let Some(built) =
            generated.then(|| autotp_kernelgen::try_build(graph, &[id], &node.outputs)).flatten()
        {
            let inputs = built.inputs.iter().map(|v| self.region(v)).collect();
            self.generated(built.kernel, inputs, outputs, label);
        } else {
            let mut kernel = autotp_ir::lower::node_kernel(graph, node)
                .expect("constants, collectives and pipeline communication are handled apart");
            match &mut kernel {
                Kernel::MatMul { dims, .. } => {
                    let layout =
                        |v: &ValueId| self.lifetimes.layouts.get(v).map(|l| at_batch_rank(l, dims.batch.len()));
                    dims.lhs_layout = layout(&node.inputs[0]);
                    dims.rhs_layout = layout(&node.inputs[1]);
                }
                Kernel::Attention { generated: g, .. } | Kernel::AttentionGrad { generated: g, .. } => *g = generated,
                _ => {}
            }
            self.instructions.push(Instruction::Kernel { kernel, inputs, outputs, label, gpu: None });
        }
    }

    /// A generated kernel over `inputs` and `outputs`; a whole-tensor reduction as its partials
    /// and total kernels ([`autotp_kernelgen::split`]), the partials in a scratch region that
    /// dies with the second.
    fn generated(
        &mut self,
        mut kernel: autotp_kernels::kir::Kernel,
        inputs: Vec<Region>,
        outputs: Vec<Region>,
        label: String,
    ) {
        autotp_kernelgen::index_rewrite::simplify_kernel(&mut kernel);
        let Some([partials, total]) = autotp_kernelgen::split::split_whole_reduction(&kernel) else {
            let kernel = intern(&mut self.kernels, kernel);
            self.instructions.push(Instruction::Generated { kernel, inputs, outputs, label });
            return;
        };
        let scratch = partials.buffers.last().expect("the partials' scratch buffer");
        let [scratch] = self.scratch([scratch.len * scratch.dtype.size()]);
        let (partials, total) = (intern(&mut self.kernels, partials), intern(&mut self.kernels, total));
        let with_scratch = |regions: &[Region]| regions.iter().copied().chain([scratch]).collect();
        self.instructions.push(Instruction::Generated {
            kernel: partials,
            inputs: inputs.clone(),
            outputs: with_scratch(&outputs),
            label: label.clone(),
        });
        self.instructions.push(Instruction::Generated { kernel: total, inputs: with_scratch(&inputs), outputs, label });
        self.free_scratch(&[scratch]);
    }

    /// A mean cross-entropy as two generated kernels: per-row losses and counts into a
    /// scratch region that dies with the second, which sums them into `loss`.
    fn cross_entropy(
        &mut self,
        rows: autotp_kernels::kir::Kernel,
        total: autotp_kernels::kir::Kernel,
        inputs: Vec<Region>,
        loss: Region,
        label: String,
    ) {
        let row_bytes = rows.buffers[2].len * 4;
        let scratch = self.scratch([row_bytes; 2]);
        let rows = intern(&mut self.kernels, rows);
        let total = intern(&mut self.kernels, total);
        self.instructions.push(Instruction::Generated {
            kernel: rows,
            inputs,
            outputs: scratch.to_vec(),
            label: label.clone(),
        });
        self.instructions.push(Instruction::Generated {
            kernel: total,
            inputs: scratch.to_vec(),
            outputs: vec![loss],
            label,
        });
        self.free_scratch(&scratch);
    }

    /// Regions of these byte lengths for the two kernels of one node or group to pass values
    /// through (counted in the activations' peak), freed by [`Lowering::free_scratch`] after
    /// the second.
    fn scratch<const N: usize>(&mut self, bytes: [usize; N]) -> [Region; N] {
        let regions = bytes.map(|len| Region { offset: self.allocator.alloc(len), len });
        let total: usize = bytes.iter().sum();
        self.memory.activations_peak_bytes = self.memory.activations_peak_bytes.max(self.live_bytes + total);
        regions
    }

    fn free_scratch(&mut self, regions: &[Region]) {
        for region in regions {
            self.allocator.free(region.offset);
        }
    }

    /// The program, with its outputs, updates and memory plan.
    fn finish(
        self,
        params: Vec<Slot>,
        inputs: Vec<Slot>,
        states: Vec<Slot>,
        constants: Vec<ConstantData>,
    ) -> Result<(Program, Option<Vec<usize>>), CodegenError> {
        let graph = self.graph;
        let mut memory = self.memory;
        memory.arena_bytes = self.allocator.high_water();
        let offloaded: std::collections::BTreeSet<usize> =
            params.iter().filter(|s| s.region.in_host_pool()).map(|s| s.region.offset).collect();
        memory.param_fetch_bytes = (self.instructions.iter())
            .filter(|i| !matches!(i, Instruction::OptimizerStep { .. }))
            .flat_map(|i| i.regions().0)
            .filter(|r| offloaded.contains(&r.offset))
            .map(|r| r.len)
            .sum();
        memory.grads_bytes = graph
            .nodes()
            .filter(|(_, n)| matches!(n.op, Op::AdamW { .. } | Op::Sgd { .. }))
            .map(|(_, n)| local(graph, n.inputs[1]).size_bytes())
            .sum();
        let regions = &self.regions;
        let outputs = graph
            .outputs()
            .iter()
            .map(|(name, v)| {
                // An output that is an input or parameter directly still has a region.
                let region = regions[v.index()].expect("outputs are defined");
                slot(graph, *v, name.clone(), region)
            })
            .collect();
        // Updates made in place (the optimizer step wrote the target's own region) copy nothing.
        let updates = graph
            .updates()
            .iter()
            .map(|(target, value)| Update {
                from: regions[value.index()].expect("update values are defined"),
                to: regions[target.index()].expect("targets are parameters or states"),
            })
            .filter(|u| u.from != u.to)
            .collect();
        let program = Program {
            name: graph.name.clone(),
            mesh: graph.mesh.axes.clone(),
            inputs,
            outputs,
            params,
            states,
            constants,
            updates,
            instructions: self.instructions,
            kernels: self.kernels,
            gpu_kernels: Default::default(),
            ptx: Vec::new(),
            memory,
        };
        Ok((program, self.allocator.planned()))
    }
}
