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
//! its use within `--prefetch-bucket-size` and `--max-live-params` (or at its use, when they
//! allow no more: [`schedule_prefetch`]), and a `wait` at the use.
//!
//! With context parallelism (`cp` > 1) the batch inputs are also split over their sequence on a
//! `cp` axis ([`batch_placement`]); ZeRO shards over `dp` alone.
//!
//! With fewer expert-parallel ranks than data-parallel ones (`--ep` below `--dp`), the
//! data-parallel ranks are `dp / ep` groups of `ep` ([`mesh`]): the batch is split over both
//! axes, the experts over `ep`. ZeRO shards as Megatron's distributed optimizer does
//! ([`seed`]): the dense parameters over both axes (all `dp` ranks), the experts' over the
//! groups' axis (`dp`, the expert-data-parallel group: the ranks that hold the same experts).
//! Their gradients are reduce-scattered over both axes, and at stage 3 a dense parameter is
//! gathered over `ep` (a small block) and then over `dp` ([`schedule_prefetch`]).
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

/// The data-parallel axes of `mesh` (from [`mesh`]): `dp`, and `ep` where the data-parallel
/// ranks are groups of expert-parallel ones. ZeRO shards over them together.
pub fn data_axes(mesh: &Mesh) -> Vec<usize> {
    let data = |a: &&MeshAxis| a.name == autotp_ir::DATA_AXIS || a.name == autotp_ir::EXPERT_AXIS;
    mesh.axes.iter().enumerate().filter(|(_, a)| data(a)).map(|(i, _)| i).collect()
}

/// Adds ZeRO's placements over the data-parallel axes of `mesh` ([`data_axes`]) to `seeds`
/// (which may already split parameters over other axes): optimizer states from stage 1,
/// parameters at stage 3. A tensor is split on one dim over every data axis that does not
/// split it yet, as Megatron's distributed optimizer shards the dense parameters over all the
/// data-parallel ranks and the experts' (split by expert over `ep`) over the groups
/// (`dp`); where no dim fits them all, over the first alone that one fits. A tensor with no
/// dim that fits stays whole.
pub fn seed(graph: &Graph, mesh: &Mesh, config: ZeroConfig, seeds: &mut BTreeMap<String, Vec<Placement>>) {
    if config.stage == 0 {
        return;
    }
    let axes = data_axes(mesh);
    for (param, states) in optimized(graph) {
        let name = graph.name_of(param).unwrap_or("").to_string();
        let placements = seeds.get(&name).cloned().unwrap_or_else(|| mesh.replicated());
        let free: Vec<usize> = axes.iter().copied().filter(|&a| placements[a] == Placement::Replicate).collect();
        let shape = &graph.ty(param).shape;
        let local = autotp_ir::sharding::local_shape(mesh, shape, &placements);
        let taken = |d: usize| placements.contains(&Placement::Shard(d));
        let fits = |over: &[usize]| {
            let ways: usize = over.iter().map(|&a| mesh.axes[a].size).product();
            (0..shape.len()).find(|&d| local[d].is_multiple_of(ways) && local[d] >= ways && !taken(d))
        };
        let candidates = std::iter::once(free.clone()).chain(free.iter().map(|&a| vec![a]));
        let Some((over, dim)) =
            candidates.filter(|over| !over.is_empty()).find_map(|over| Some((over.clone(), fits(&over)?)))
        else {
            continue;
        };
        let mut sharded = placements.clone();
        for a in over {
            sharded[a] = Placement::Shard(dim);
        }
        for state in states {
            seeds.insert(graph.name_of(state).unwrap_or("").to_string(), sharded.clone());
        }
        if config.stage == 3 && graph.ty(param).numel() >= config.persistence_threshold {
            seeds.insert(name, sharded);
        }
    }
}

/// The `Shard` options of a ZeRO stage on `mesh`: (`gather_params_on`, `scatter_early`).
pub fn shard_options(stage: u8, mesh: &Mesh) -> (Vec<usize>, bool) {
    (if stage == 3 { data_axes(mesh) } else { Vec::new() }, stage >= 2)
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
            seed(graph, &mesh, self.config, &mut seeds);
        }
        seeds.extend(self.param_placements.clone());
        let (gather_params_on, scatter_early) = shard_options(self.config.stage, &mesh);
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
    /// Elements of gathered parameters alive at once beyond which none is gathered ahead of its
    /// use (`--max-live-params`; a parameter is gathered at its use whatever its size).
    pub max_live_elements: usize,
    /// Parameter gathers in flight at once: `--offload-param nvme`'s `--buffer-count` (each
    /// holds its shard in one of the buffers from its start to its wait, as DeepSpeed swaps in
    /// no more shards than it has buffers free), else unbounded.
    pub max_in_flight: usize,
}

impl Default for Prefetch {
    /// DeepSpeed's defaults: `stage3_prefetch_bucket_size` 5e7, `stage3_max_live_parameters` 1e9.
    fn default() -> Prefetch {
        Prefetch { bucket_elements: 50_000_000, max_live_elements: 1_000_000_000, max_in_flight: usize::MAX }
    }
}

/// Turns every gather of a sharded parameter into an asynchronous `all_gather_start` issued
/// ahead of its use and a `wait` where the gather was (a parameter sharded over two data axes
/// is gathered over the inner one first, on the way, synchronously, and the start is the
/// gather over the outer one): each start goes as early as the budget
/// allows (gathers in flight within `bucket_elements` and `max_in_flight`, gathered parameters
/// alive within `max_live_elements`; a gathered copy is released after its last use), in order, and not
/// while an earlier copy of the same parameter is alive: as DeepSpeed holds at most one
/// gathered copy of a parameter, so a small model's prefetch does not fetch the next
/// micro-batch's (or the backward's) copies beside the current ones. The budgets bound what is
/// fetched ahead: a parameter not yet started at its use is gathered there whatever they say
/// (one larger than `max_live_elements` too, as DeepSpeed fetches a module's own parameters),
/// and nothing more starts until enough gathered copies are released.
pub fn schedule_prefetch(graph: &Graph, prefetch: Prefetch) -> Result<Graph, PassError> {
    let nodes: Vec<&autotp_ir::Node> = graph.nodes().map(|(_, n)| n).collect();
    let is_gather = |i: usize| {
        matches!(nodes[i].op, Op::Collective { kind: autotp_ir::Collective::AllGather { .. }, start: false, .. })
    };
    // A gather on from a parameter's gather: ZeRO's over the next data axis (dp after ep), not
    // tensor parallelism's.
    let gathers_on = |i: usize| {
        matches!(&nodes[i].op, Op::Collective { kind: autotp_ir::Collective::AllGather { .. }, start: false, axis }
            if axis == autotp_ir::DATA_AXIS || axis == autotp_ir::EXPERT_AXIS)
    };
    // Each parameter gather: its gathers in order, one per data axis it is sharded over (the
    // inner axis's first, from the parameter; each next from the one before).
    let consumers = graph.consumers();
    let gathers: Vec<Vec<usize>> = (0..nodes.len())
        .filter(|&i| is_gather(i) && graph.params().contains(&nodes[i].inputs[0]))
        .map(|first| {
            let mut chain = vec![first];
            while let [next] = consumers[nodes[*chain.last().expect("one gather")].outputs[0].index()][..] {
                if !gathers_on(next.0 as usize) || !gathers_on(*chain.last().expect("one gather")) {
                    break;
                }
                chain.push(next.0 as usize);
            }
            chain
        })
        .collect();
    if gathers.is_empty() {
        return Ok(graph.clone());
    }
    let local_elements = |v: ValueId| {
        let value = graph.value(v);
        autotp_ir::sharding::local_shape(&graph.mesh, &value.ty.shape, &value.placements).iter().product::<usize>()
    };
    let gathered = |j: usize| nodes[*gathers[j].last().expect("one gather")].outputs[0];
    let mut last_use = vec![0usize; graph.num_values()];
    for (i, node) in nodes.iter().enumerate() {
        for v in &node.inputs {
            last_use[v.index()] = i;
        }
    }
    let elements: Vec<usize> = (0..gathers.len()).map(|j| local_elements(gathered(j))).collect();
    let ends: Vec<usize> = (0..gathers.len()).map(|j| last_use[gathered(j).index()]).collect();
    // Where each gather's copy is used (its last gather's place), and the places of the
    // gathers before the last, which move with it.
    let gather_index: BTreeMap<usize, usize> =
        gathers.iter().enumerate().map(|(j, chain)| (*chain.last().expect("one gather"), j)).collect();
    let inner: std::collections::BTreeSet<usize> =
        gathers.iter().flat_map(|chain| chain[..chain.len() - 1].iter().copied()).collect();
    // The previous gather of the same parameter: its copy must be dead before the next starts.
    let mut last_of_param: BTreeMap<ValueId, usize> = BTreeMap::new();
    let previous: Vec<Option<usize>> =
        gathers.iter().enumerate().map(|(j, chain)| last_of_param.insert(nodes[chain[0]].inputs[0], j)).collect();

    let mut rw = autotp_ir::Rewriter::new(graph, |_| true);
    let mut started: Vec<Option<ValueId>> = vec![None; gathers.len()];
    let (mut next, mut in_flight, mut live, mut gathers_in_flight) = (0usize, 0usize, 0usize, 0usize);
    // Issues gather `j`: the gathers over inner axes as they were (on the way, small), the
    // last asynchronously.
    let start = |rw: &mut autotp_ir::Rewriter, j: usize| -> Result<ValueId, PassError> {
        let mut value = rw.map(nodes[gathers[j][0]].inputs[0]);
        for (k, &i) in gathers[j].iter().enumerate() {
            let Op::Collective { kind, axis, .. } = &nodes[i].op else { unreachable!("a gather") };
            let op = Op::Collective { kind: *kind, axis: axis.clone(), start: k + 1 == gathers[j].len() };
            let g = rw.graph();
            let mut placements = g.value(value).placements.clone();
            value = crate::add_op("zero", g, op, vec![value])?;
            let a = graph.mesh.axes.iter().position(|x| &x.name == axis).expect("verified axis");
            placements[a] = Placement::Replicate;
            g.value_mut(value).placements = placements;
        }
        Ok(value)
    };
    for (i, node) in nodes.iter().enumerate() {
        // Issue the next gathers while the budgets allow (at least one in flight).
        while next < gathers.len()
            && (in_flight == 0 || in_flight + elements[next] <= prefetch.bucket_elements)
            && gathers_in_flight < prefetch.max_in_flight
            && live + elements[next] <= prefetch.max_live_elements
            && previous[next].is_none_or(|p| ends[p] < i)
        {
            started[next] = Some(start(&mut rw, next)?);
            in_flight += elements[next];
            gathers_in_flight += 1;
            live += elements[next];
            next += 1;
        }
        if let Some(&j) = gather_index.get(&i) {
            if started[j].is_none() {
                started[j] = Some(start(&mut rw, j)?);
                live += elements[j];
                in_flight += elements[j];
                gathers_in_flight += 1;
                next = j + 1;
            }
            let pending = started[j].expect("started above");
            let g = rw.graph();
            let placements = g.value(pending).placements.clone();
            let ready = crate::add_op("zero", g, Op::Wait, vec![pending])?;
            g.value_mut(ready).placements = placements;
            in_flight -= elements[j];
            gathers_in_flight -= 1;
            rw.set(node.outputs[0], ready);
        } else if !inner.contains(&i) {
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
