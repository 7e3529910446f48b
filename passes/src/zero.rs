//! `zero`: data parallelism with DeepSpeed's ZeRO stages (`--dp N --zero 0|1|2|3`), as seeds
//! for [`Shard`]:
//!
//! | stage | optimizer state | gradients | parameters |
//! |---|---|---|---|
//! | 0 | whole on every rank | all-reduced | whole |
//! | 1 | sharded over dp | reduce-scattered at the optimizer (full ones held until then) | whole; updated shards all-gathered |
//! | 2 | sharded | reduce-scattered where they are made (each micro-batch's) | whole; updated shards all-gathered |
//! | 3 | sharded | reduce-scattered where they are made (each micro-batch's) | sharded; all-gathered before each use (forward and again backward), released after |
//!
//! A tensor is sharded on its first dim that the dp ranks divide and that no other mesh axis
//! already splits (tensor parallelism); one without such a dim stays whole on every rank. At
//! stage 3, parameters below `--param-persistence-threshold` elements stay whole too (their
//! optimizer state is still sharded), as DeepSpeed keeps small parameters resident. Everything else (which collective, where) follows
//! from the sharding rules: the optimizer runs on its state's shard, so its gradient is reduced
//! into that shard and its parameter sliced (stages 1-2) or already sharded (stage 3).
//!
//! At stage 3 each parameter gather becomes an asynchronous `all_gather_start` issued ahead of
//! its use within `--prefetch-bucket-size` and `--max-live-params` ([`schedule_prefetch`]), and
//! a `wait` at the use.
//!
//! With context parallelism (`cp` > 1) the batch inputs are also split over their sequence on a
//! `cp` axis ([`batch_placement`]); ZeRO shards over `dp` alone.
//!
//! With fewer expert-parallel ranks than data-parallel ones (`--ep` below `--dp`), the
//! data-parallel ranks are `dp / ep` groups of `ep` ([`mesh`]): the batch is split over both
//! axes, the experts over `ep`, and ZeRO shards over the groups' axis (`dp`, Megatron's
//! expert-data-parallel group: the ranks that hold the same experts), so every parameter's
//! states, the experts' too, are split `dp / ep` ways.
//!
//! Input phase: a training step (after `optimize`). Output: the step on the mesh `[dp, ep, cp]`
//! (each axis where it has more than one rank).
//! Tests: tests/golden/zero_*.ir, tests/parallel.rs.

use std::collections::BTreeMap;

use autotp_ir::{Graph, Mesh, MeshAxis, Op, Placement, ValueId};

use crate::expert_dispatch::ExpertParallel;
use crate::optimize::trained_by;
use crate::shard::Shard;
use crate::{Pass, PassError};

/// A ZeRO configuration.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct ZeroConfig {
    pub stage: u8,
    /// At stage 3, parameters with fewer elements stay whole on every rank (DeepSpeed's
    /// `stage3_param_persistence_threshold`): gathering them costs more than it saves.
    pub persistence_threshold: usize,
    /// At stage 3, how parameters are gathered ahead of their use.
    pub prefetch: Prefetch,
    /// Gradient all-reduces merge into buckets of up to this many elements; 0 for none.
    pub reduce_bucket_elements: usize,
    /// The type gradients are reduced in over the data-parallel ranks (`--comm-dtype`), where
    /// it is not their own.
    pub comm_dtype: Option<autotp_ir::DType>,
    /// The micro-batches whose gradients each step sums (`--grad-accum`, or a pipeline's
    /// micro-batches; 0 or 1: none). From stage 2 each micro-batch's gradients are
    /// reduce-scattered as they are made and summed as shards ([`Shard::micro_batches`]).
    pub micro_batches: usize,
}

pub struct Zero {
    pub dp: usize,
    /// Context-parallel ranks (1 for none): each sequence split over them.
    pub cp: usize,
    pub config: ZeroConfig,
    /// Graph inputs sharded over dp on their batch dim.
    pub batch_inputs: Vec<String>,
    /// Parameters' placements decided elsewhere, over ZeRO's: the evaluation step, which has
    /// no optimizer to say what ZeRO-3 shards, holds the blocks its training step holds.
    pub param_placements: BTreeMap<String, Vec<Placement>>,
    /// Expert-parallel ranks (`--ep`; 1 for none): the experts' tables of the dispatched
    /// mixtures ([`crate::expert_dispatch`]) split by expert over dp (`ep` = `dp`) or over an
    /// `ep` axis of their own ([`mesh`]); ZeRO leaves that split.
    pub ep: usize,
}

/// Each trainable parameter and its optimizer states, from the graph's optimizer ops.
fn optimized(graph: &Graph) -> Vec<(ValueId, Vec<ValueId>)> {
    graph.nodes().filter_map(|(_, node)| trained_by(graph, node)).collect()
}

/// Where a batch input of `rank` dims (token ids or labels: `[batch, seq]`, or `[batch,
/// micro-batches, seq]` when a step accumulates) lies on `mesh`: its batch split over the
/// data-parallel axis and its sequence (the last dim) over the context-parallel axis, where they
/// are.
pub fn batch_placement(mesh: &Mesh, rank: usize) -> Vec<Placement> {
    let split = |axis: &MeshAxis| match axis.name.as_str() {
        autotp_ir::DATA_AXIS | autotp_ir::EXPERT_AXIS => Placement::Shard(0),
        autotp_ir::CONTEXT_AXIS => Placement::Shard(rank - 1),
        _ => Placement::Replicate,
    };
    mesh.axes.iter().map(split).collect()
}

/// The rank of graph input `name`.
pub(crate) fn input_rank(graph: &Graph, name: &str) -> usize {
    graph.inputs().iter().find(|&&v| graph.name_of(v) == Some(name)).map_or(0, |&v| graph.ty(v).rank())
}

/// The mesh `[dp, ep, cp, tp]`: each axis where it has more than one rank, in Megatron's order,
/// tp innermost. `ep` is an axis of its own below `dp` ranks, which are then `dp / ep` groups
/// of `ep` (the `dp` axis has `dp / ep` ranks); with as many, the experts split over dp.
pub fn mesh(dp: usize, ep: usize, cp: usize, tp: usize) -> Mesh {
    let (groups, experts) = if ep > 1 && ep < dp { (dp / ep, ep) } else { (dp, 1) };
    let axes =
        [(autotp_ir::DATA_AXIS, groups), (autotp_ir::EXPERT_AXIS, experts), (autotp_ir::CONTEXT_AXIS, cp), ("tp", tp)];
    Mesh { axes: axes.iter().filter(|a| a.1 > 1).map(|&(name, size)| MeshAxis { name: name.into(), size }).collect() }
}

/// Expert parallelism of `ep` ranks on `mesh` (from [`mesh`]) for `graph`: its experts' tables
/// split over the `ep` axis, or over `dp` where there is none; `None` without `ep` or experts.
pub fn experts_on(graph: &Graph, mesh: &Mesh, ep: usize) -> Option<ExpertParallel> {
    let axis = autotp_program::mesh::expert_axis(&mesh.axes)?;
    (ep > 1).then(|| ExpertParallel::over(graph, axis)).flatten()
}

/// Adds ZeRO's placements on mesh axis `dp_axis` to `seeds` (which may already split
/// parameters over other axes): optimizer states from stage 1, parameters at stage 3. A tensor
/// with no dim that fits stays whole.
pub fn seed(
    graph: &Graph,
    mesh: &Mesh,
    dp_axis: usize,
    config: ZeroConfig,
    seeds: &mut BTreeMap<String, Vec<Placement>>,
) {
    let dp = mesh.axes[dp_axis].size;
    if config.stage == 0 {
        return;
    }
    for (param, states) in optimized(graph) {
        let name = graph.name_of(param).unwrap_or("").to_string();
        let placements = seeds.get(&name).cloned().unwrap_or_else(|| mesh.replicated());
        if placements[dp_axis] != Placement::Replicate {
            // Split over dp already (experts by expert): its states follow it.
            continue;
        }
        let shape = &graph.ty(param).shape;
        let local = autotp_ir::sharding::local_shape(mesh, shape, &placements);
        let taken = |d: usize| placements.contains(&Placement::Shard(d));
        let Some(dim) = (0..shape.len()).find(|&d| local[d].is_multiple_of(dp) && local[d] >= dp && !taken(d)) else {
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
}

/// The `Shard` options of a stage with data parallelism on mesh axis `dp_axis`:
/// (`gather_params_on`, `scatter_early`).
pub fn shard_options(stage: u8, dp_axis: usize) -> (Option<usize>, bool) {
    ((stage == 3).then_some(dp_axis), stage >= 2)
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
        if self.config.stage > 0 && self.dp < 2 {
            return Err(invalid(format!("--zero {} shards over dp: it needs dp 2 or more", self.config.stage)));
        }
        let mesh = mesh(self.dp, self.ep, self.cp, 1);
        let mut seeds: BTreeMap<String, Vec<Placement>> = crate::present_inputs(graph, &self.batch_inputs)
            .map(|n| (n.clone(), batch_placement(&mesh, input_rank(graph, n))))
            .collect();
        let experts = experts_on(graph, &mesh, self.ep);
        if let Some(experts) = &experts {
            experts.seed(&mesh, &mut seeds);
        }
        if self.config.stage > 0 {
            seed(graph, &mesh, 0, self.config, &mut seeds);
        }
        seeds.extend(self.param_placements.clone());
        let (gather_params_on, scatter_early) = shard_options(self.config.stage, 0);
        Shard {
            mesh,
            seeds,
            gather_params_on,
            scatter_early,
            micro_batches: self.config.micro_batches,
            bucket_elements: self.config.reduce_bucket_elements,
            reduce_dtype: self.config.comm_dtype,
            sequence_parallel: None,
            experts,
        }
        .run(graph)?;
        if self.config.stage == 3 {
            *graph = schedule_prefetch(graph, self.config.prefetch)?;
        }
        Ok(())
    }
}

/// How ZeRO-3 fetches parameters ahead of their use.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Prefetch {
    /// Elements of parameter gathers in flight at once (`--prefetch-bucket-size`).
    pub bucket_elements: usize,
    /// Elements of gathered parameters alive at once (`--max-live-params`).
    pub max_live_elements: usize,
}

impl Default for Prefetch {
    /// DeepSpeed's defaults: `stage3_prefetch_bucket_size` 5e7, `stage3_max_live_parameters` 1e9.
    fn default() -> Prefetch {
        Prefetch { bucket_elements: 50_000_000, max_live_elements: 1_000_000_000 }
    }
}

/// Turns every gather of a sharded parameter into an asynchronous `all_gather_start` issued
/// ahead of its use and a `wait` where the gather was: each start goes as early as the budget
/// allows (gathers in flight within `bucket_elements`, gathered parameters alive within
/// `max_live_elements`; a gathered copy is released after its last use), in order, and not
/// while an earlier copy of the same parameter is alive: as DeepSpeed holds at most one
/// gathered copy of a parameter, so a small model's prefetch does not fetch the next
/// micro-batch's (or the backward's) copies beside the current ones. A parameter that cannot
/// be gathered within `max_live_elements` (alone, or beside the gathered parameters alive at its
/// use) is refused.
pub fn schedule_prefetch(graph: &Graph, prefetch: Prefetch) -> Result<Graph, PassError> {
    let nodes: Vec<&autotp_ir::Node> = graph.nodes().map(|(_, n)| n).collect();
    let gathers: Vec<usize> = (0..nodes.len())
        .filter(|&i| {
            matches!(nodes[i].op, Op::Collective { kind: autotp_ir::Collective::AllGather { .. }, start: false, .. })
                && graph.params().contains(&nodes[i].inputs[0])
        })
        .collect();
    if gathers.is_empty() {
        return Ok(graph.clone());
    }
    let local_elements = |v: ValueId| {
        let value = graph.value(v);
        autotp_ir::sharding::local_shape(&graph.mesh, &value.ty.shape, &value.placements).iter().product::<usize>()
    };
    let mut last_use = vec![0usize; graph.num_values()];
    for (i, node) in nodes.iter().enumerate() {
        for v in &node.inputs {
            last_use[v.index()] = i;
        }
    }
    let elements: Vec<usize> = gathers.iter().map(|&g| local_elements(nodes[g].outputs[0])).collect();
    let ends: Vec<usize> = gathers.iter().map(|&g| last_use[nodes[g].outputs[0].index()]).collect();
    let gather_index: BTreeMap<usize, usize> = gathers.iter().enumerate().map(|(j, &g)| (g, j)).collect();
    // The previous gather of the same parameter: its copy must be dead before the next starts.
    let mut last_of_param: BTreeMap<ValueId, usize> = BTreeMap::new();
    let previous: Vec<Option<usize>> =
        gathers.iter().enumerate().map(|(j, &g)| last_of_param.insert(nodes[g].inputs[0], j)).collect();

    let mut rw = autotp_ir::Rewriter::new(graph, |_| true);
    let mut started: Vec<Option<ValueId>> = vec![None; gathers.len()];
    let (mut next, mut in_flight, mut live) = (0usize, 0usize, 0usize);
    let start = |rw: &mut autotp_ir::Rewriter, j: usize| -> Result<ValueId, PassError> {
        let node = nodes[gathers[j]];
        let Op::Collective { kind, axis, .. } = &node.op else { unreachable!("a gather") };
        let op = Op::Collective { kind: *kind, axis: axis.clone(), start: true };
        let param = rw.map(node.inputs[0]);
        let g = rw.graph();
        let placements = g.value(param).placements.clone();
        let out = crate::add_op("zero", g, op, vec![param])?;
        let mut out_placements = placements;
        let a = graph.mesh.axes.iter().position(|x| &x.name == axis).expect("verified axis");
        out_placements[a] = Placement::Replicate;
        g.value_mut(out).placements = out_placements;
        Ok(out)
    };
    for (i, node) in nodes.iter().enumerate() {
        // Issue the next gathers while the budgets allow (at least one in flight).
        while next < gathers.len()
            && (in_flight == 0 || in_flight + elements[next] <= prefetch.bucket_elements)
            && live + elements[next] <= prefetch.max_live_elements
            && previous[next].is_none_or(|p| ends[p] < i)
        {
            started[next] = Some(start(&mut rw, next)?);
            in_flight += elements[next];
            live += elements[next];
            next += 1;
        }
        if let Some(&j) = gather_index.get(&i) {
            if started[j].is_none() {
                let name = graph.name_of(node.inputs[0]).unwrap_or("");
                if live + elements[j] > prefetch.max_live_elements {
                    return Err(invalid(format!(
                        "--max-live-params {} cannot hold parameter '{name}' ({} elements gathered) beside the {live} \
                         elements of gathered parameters alive at its use",
                        prefetch.max_live_elements, elements[j]
                    )));
                }
                started[j] = Some(start(&mut rw, j)?);
                live += elements[j];
                in_flight += elements[j];
                next = j + 1;
            }
            let pending = started[j].expect("started above");
            let g = rw.graph();
            let placements = g.value(pending).placements.clone();
            let ready = crate::add_op("zero", g, Op::Wait, vec![pending])?;
            g.value_mut(ready).placements = placements;
            in_flight -= elements[j];
            rw.set(node.outputs[0], ready);
        } else {
            rw.copy_node(autotp_ir::NodeId(i as u32));
        }
        for (j, &end) in ends.iter().enumerate() {
            if end == i && started[j].is_some() {
                live -= elements[j];
            }
        }
    }
    Ok(rw.finish())
}
