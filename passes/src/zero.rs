//! `zero`: data parallelism with DeepSpeed's ZeRO stages (`--dp N --zero 0|1|2|3`), as seeds
//! for [`Shard`]:
//!
//! | stage | optimizer state | gradients | parameters |
//! |---|---|---|---|
//! | 0 | whole on every rank | all-reduced | whole |
//! | 1 | sharded over dp | reduce-scattered at the optimizer (full ones held until then) | whole; updated shards all-gathered |
//! | 2 | sharded | reduce-scattered where they are made | whole; updated shards all-gathered |
//! | 3 | sharded | reduce-scattered where they are made | sharded; all-gathered before each use (forward and again backward), released after |
//!
//! A tensor is sharded on its first dim that the dp ranks divide and that no other mesh axis
//! already splits (tensor parallelism); one without such a dim stays whole on every rank. At
//! stage 3, parameters below `--param-persistence-threshold` elements stay whole too (their
//! optimizer state is still sharded), as DeepSpeed keeps small parameters resident. Everything else (which collective, where) follows
//! from the sharding rules: the optimizer runs on its state's shard, so its gradient is reduced
//! into that shard and its parameter sliced (stages 1-2) or already sharded (stage 3).
//!
//! Input phase: a training step (after `optimize`). Output: the step on the mesh `[dp]`.
//! Tests: tests/golden/zero_*.ir, tests/parallel.rs.

use std::collections::BTreeMap;

use autotp_ir::{Graph, Mesh, MeshAxis, Op, Placement, ValueId};

use crate::shard::Shard;
use crate::{Pass, PassError};

/// A ZeRO configuration.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct ZeroConfig {
    pub stage: u8,
    /// At stage 3, parameters with fewer elements stay whole on every rank (DeepSpeed's
    /// `stage3_param_persistence_threshold`): gathering them costs more than it saves.
    pub persistence_threshold: usize,
}

pub struct Zero {
    pub dp: usize,
    pub config: ZeroConfig,
    /// Graph inputs sharded over dp on their batch dim.
    pub batch_inputs: Vec<String>,
}

/// Each trainable parameter and its optimizer states, from the graph's optimizer ops.
fn optimized(graph: &Graph) -> Vec<(ValueId, Vec<ValueId>)> {
    graph
        .nodes()
        .filter_map(|(_, node)| {
            let tensors = match node.op {
                Op::AdamW { .. } => 4,
                Op::Sgd { .. } => 3,
                _ => return None,
            };
            Some((node.inputs[0], node.inputs[2..tensors].to_vec()))
        })
        .collect()
}

/// Adds ZeRO's placements on mesh axis `dp_axis` to `seeds` (which may already split
/// parameters over other axes): optimizer states from stage 1, parameters at stage 3. Returns
/// the parameters left whole because no dim fits.
pub fn seed(
    graph: &Graph,
    mesh: &Mesh,
    dp_axis: usize,
    config: ZeroConfig,
    seeds: &mut BTreeMap<String, Vec<Placement>>,
) -> Vec<String> {
    let dp = mesh.axes[dp_axis].size;
    let mut whole = Vec::new();
    if config.stage == 0 {
        return whole;
    }
    for (param, states) in optimized(graph) {
        let name = graph.name_of(param).unwrap_or("").to_string();
        let placements = seeds.get(&name).cloned().unwrap_or_else(|| mesh.replicated());
        let shape = &graph.ty(param).shape;
        let local = autotp_ir::sharding::local_shape(mesh, shape, &placements);
        let taken = |d: usize| placements.contains(&Placement::Shard(d));
        let Some(dim) = (0..shape.len()).find(|&d| local[d].is_multiple_of(dp) && local[d] >= dp && !taken(d)) else {
            whole.push(name);
            continue;
        };
        let mut sharded = placements.clone();
        sharded[dp_axis] = Placement::Shard(dim);
        for state in states {
            seeds.insert(graph.name_of(state).unwrap_or("").to_string(), sharded.clone());
        }
        if config.stage == 3 && graph.ty(param).numel() >= config.persistence_threshold {
            seeds.insert(name, sharded);
        }
    }
    whole
}

/// The `Shard` options of a stage.
pub fn shard_options(stage: u8) -> (bool, bool) {
    (stage == 3, stage >= 2)
}

fn invalid(message: String) -> PassError {
    PassError::Invalid { pass: "zero", message }
}

impl Pass for Zero {
    fn name(&self) -> &'static str {
        "zero"
    }

    fn run(&self, graph: &mut Graph) -> Result<(), PassError> {
        if self.config.stage > 3 {
            return Err(invalid(format!("--zero {} is not a ZeRO stage (0, 1, 2 or 3)", self.config.stage)));
        }
        let mesh = Mesh { axes: vec![MeshAxis { name: "dp".into(), size: self.dp }] };
        let mut seeds: BTreeMap<String, Vec<Placement>> =
            self.batch_inputs.iter().map(|n| (n.clone(), vec![Placement::Shard(0)])).collect();
        seed(graph, &mesh, 0, self.config, &mut seeds);
        let (regather_params, scatter_early) = shard_options(self.config.stage);
        Shard { mesh, seeds, regather_params, scatter_early }.run(graph)
    }
}
