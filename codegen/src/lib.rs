//! autotp-codegen: lowers a verified IR graph to a runtime [`Program`].
//!
//! Each node becomes one builtin-kernel instruction (the kernel chosen by
//! [`autotp_ir::lower::kernel_for`], the same one the reference evaluator runs). Values get
//! arena regions from a liveness-based first-fit plan ([`memory`]); the plan's byte counts are
//! the compile-time memory report.

pub mod memory;

use autotp_ir::{Def, Graph, Op, ValueId};
use autotp_runtime::{ConstantData, Instruction, MemoryPlan, Program, Region, Slot, Update};

use memory::{align, FirstFit};

#[derive(Debug, thiserror::Error)]
pub enum CodegenError {
    #[error("cannot lower an invalid graph: {0}")]
    Verify(#[from] autotp_ir::VerifyErrors),
    #[error("cannot lower a graph over a device mesh ({mesh}) yet: per-rank programs are not implemented")]
    Sharded { mesh: String },
}

fn slot(graph: &Graph, v: ValueId, name: String, region: Region) -> Slot {
    let ty = graph.ty(v);
    Slot { name, dtype: ty.dtype, shape: ty.shape.clone(), region }
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
                let region = self.region(graph.ty(v).size_bytes());
                *total += region.len;
                regions[v.index()] = Some(region);
                slot(graph, v, graph.name_of(v).unwrap_or("").to_string(), region)
            })
            .collect()
    }
}

/// Lowers `graph` to a single-device program.
pub fn lower(graph: &Graph) -> Result<Program, CodegenError> {
    if !graph.mesh.axes.is_empty() {
        let axes: Vec<String> = graph.mesh.axes.iter().map(|a| format!("{}={}", a.name, a.size)).collect();
        return Err(CodegenError::Sharded { mesh: axes.join(", ") });
    }
    autotp_ir::verify(graph)?;
    let mut regions: Vec<Option<Region>> = vec![None; graph.num_values()];
    let mut memory = MemoryPlan::default();
    let mut dedicated = Dedicated::default();
    let params = dedicated.place(graph, graph.params(), &mut regions, &mut memory.params_bytes);
    let inputs = dedicated.place(graph, graph.inputs(), &mut regions, &mut memory.inputs_bytes);
    let states = dedicated.place(graph, graph.states(), &mut regions, &mut memory.states_bytes);
    let mut constants = Vec::new();
    for (_, node) in graph.nodes() {
        if let Op::Constant { value } = &node.op {
            let region = dedicated.region(value.ty.size_bytes());
            memory.constants_bytes += region.len;
            regions[node.outputs[0].index()] = Some(region);
            constants.push(ConstantData { region, bytes: value.bytes().to_vec() });
        }
    }

    // Last reader of each intermediate; graph outputs stay live to the end.
    let end = graph.num_nodes();
    let mut last_use = vec![0usize; graph.num_values()];
    for (id, node) in graph.nodes() {
        for v in &node.inputs {
            last_use[v.index()] = id.index();
        }
    }
    for (_, v) in graph.outputs() {
        last_use[v.index()] = end;
    }
    for (_, v) in graph.updates() {
        last_use[v.index()] = end;
    }
    let mut by_last_use: Vec<Vec<usize>> = vec![Vec::new(); end + 1];
    let mut allocator = FirstFit::new(dedicated.next);
    let mut live_bytes = 0usize;
    let mut instructions = Vec::new();
    for (id, node) in graph.nodes() {
        if matches!(node.op, Op::Constant { .. }) {
            continue;
        }
        for &o in &node.outputs {
            let len = graph.ty(o).size_bytes();
            regions[o.index()] = Some(Region { offset: allocator.alloc(len), len });
            live_bytes += len;
            let dies = if last_use[o.index()] > id.index() { last_use[o.index()] } else { id.index() };
            by_last_use[dies].push(o.index());
        }
        memory.activations_peak_bytes = memory.activations_peak_bytes.max(live_bytes);
        let types: Vec<_> = node.inputs.iter().map(|&v| graph.ty(v)).collect();
        let out_types: Vec<_> = node.outputs.iter().map(|&v| graph.ty(v)).collect();
        let kernel = autotp_ir::lower::kernel_for(&node.op, &types, &out_types).expect("only constants have no kernel");
        instructions.push(Instruction::Kernel {
            kernel,
            inputs: node.inputs.iter().map(|v| regions[v.index()].expect("defined before use")).collect(),
            outputs: node.outputs.iter().map(|v| regions[v.index()].expect("just placed")).collect(),
            label: format!("node {} ({})", id.index(), node.op.name()),
        });
        for v in std::mem::take(&mut by_last_use[id.index()]) {
            let region = regions[v].expect("placed");
            allocator.free(region.offset);
            live_bytes -= region.len;
        }
    }
    memory.arena_bytes = allocator.high_water();

    let outputs = graph
        .outputs()
        .iter()
        .map(|(name, v)| {
            // An output that is an input or parameter directly still has a region.
            let region = regions[v.index()].expect("outputs are defined");
            slot(graph, *v, name.clone(), region)
        })
        .collect();
    debug_assert!(graph.values().all(|(id, v)| !matches!(v.def, Def::Node(..)) || regions[id.index()].is_some()));
    let updates = graph
        .updates()
        .iter()
        .map(|(target, value)| Update {
            from: regions[value.index()].expect("update values are defined"),
            to: regions[target.index()].expect("targets are parameters or states"),
        })
        .collect();
    Ok(Program { name: graph.name.clone(), inputs, outputs, params, states, constants, updates, instructions, memory })
}
