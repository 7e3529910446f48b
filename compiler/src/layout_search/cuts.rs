//! The cuts of the model the search compiles (a layout's tp, micro-batch and recomputation on
//! one stage; a cut of 2 stages for pipelines; dp 2 for the data-parallel staging), how a
//! pipeline's layers fall on its stages, and a layout as `autotp compile` flags.

use super::kinds::LayerKinds;
use super::{Layout, SearchRequest};

/// A compiled cut of the model: its layout and the positions of the layers kept (as many a
/// stage).
pub(super) type Cut = (Layout, Vec<usize>);

/// `layout`'s cut of `depth` layers a stage: the first of the modelled kind
/// ([`LayerKinds::first_modelled`]), or `None` where the model has too few.
pub(super) fn at_depth(kinds: &LayerKinds, layout: &Layout, depth: usize) -> Option<Cut> {
    Some((layout.clone(), kinds.first_modelled(depth * layout.pp)?))
}

/// The largest staging of the data-parallel reductions the planner assumes: three copies (a
/// reduce-scatter's) of DeepSpeed's 5e8-element f32 bucket.
pub(super) const DP_STAGING_CAP: f64 = 3.0 * 5e8 * 4.0;

/// The cut compiled for a layout's memory and work: its tp, micro-batch and recomputation on
/// one stage, without dp; with ep, over its ep ranks (the experts split, the pairs exchanged,
/// a rank's experts' work for every pair that may reach it).
pub(super) fn search_cut(layout: &Layout) -> Layout {
    Layout { pp: 1, dp: layout.ep, zero: 0, grad_accum: 1, ..one_chunk(layout) }
}

/// `layout` under plain 1F1B, its optimizer on the device: the schedule and the model chunks
/// change what a stage holds in flight and how long the pipeline idles, and an offloaded
/// optimizer where its states and step are, which the search predicts from the same cuts.
fn one_chunk(layout: &Layout) -> Layout {
    Layout {
        schedule: "1f1b".into(),
        virtual_stages: 1,
        offload_optimizer: false,
        offload_param: false,
        ..layout.clone()
    }
}

/// The cut compiled for a pipelined layout's stages: 2 stages at its tp, micro-batch and
/// recomputation, over one micro-batch (nothing accumulated) or, for a layout that accumulates,
/// [`PIPELINE_CUT_MICRO_BATCHES`] (with 3, the first stage runs a forward after a backward: the
/// steady state, where the gradients summed so far live beside the micro-batches in flight).
/// Other counts of micro-batches differ by those in flight ([`super::figures::PipelineModel::stage`]): one cut
/// serves every pp, dp and ZeRO stage. None for a model of fewer than 4 layers of its modelled
/// kind (the cut keeps up to 2 a stage, [`LayerKinds`]), whose stages are then slices of the
/// one-stage cuts.
pub(super) fn pipeline_cut(layout: &Layout, kinds: &LayerKinds) -> Option<Layout> {
    (layout.pp > 1 && kinds.first_modelled(4).is_some()).then(|| Layout {
        pp: 2,
        dp: 1,
        ep: 1,
        zero: 0,
        grad_accum: if layout.grad_accum == 1 { 1 } else { PIPELINE_CUT_MICRO_BATCHES },
        ..one_chunk(layout)
    })
}

/// The micro-batches a pipeline cut of an accumulating layout runs.
pub(super) const PIPELINE_CUT_MICRO_BATCHES: usize = 3;

/// The cut compiled for the staging of a layout's reductions of the weights' gradients over
/// dp and cp: dp 2 (dp 4 over groups of 2 ep ranks; 1 without dp) and cp up to 2 at its ZeRO
/// stage, with and without accumulation (reductions bucket differently), at the smallest
/// micro-batch.
pub(super) fn staging_cut(layout: &Layout, micro_batch: usize) -> Option<Layout> {
    let accumulates = layout.grad_accum > 1 || layout.pp > 1;
    // A gradient reduced over several data axes (dp, the groups of ep, cp) is reduced in
    // steps, each smaller than one reduction over all: the cut keeps the axes.
    let ep = layout.ep.min(2);
    let groups = layout.ep > 1 && layout.ep < layout.dp;
    let dp = match layout.dp {
        1 => 1,
        _ if groups => 2 * ep,
        _ => 2,
    };
    (layout.dp > 1 || layout.cp > 1).then(|| Layout {
        tp: layout.tp,
        cp: layout.cp.min(2),
        cp_comm_type: "all_gather".into(),
        pp: 1,
        dp,
        ep,
        zero: layout.zero,
        micro_batch,
        grad_accum: if accumulates { 2 } else { 1 },
        recompute: "none".into(),
        schedule: "1f1b".into(),
        virtual_stages: 1,
        sequence_parallel: layout.sequence_parallel,
        offload_optimizer: false,
        offload_param: false,
    })
}

/// The `autotp compile` arguments of a layout.
pub(super) fn layout_args(request: &SearchRequest, precision: &str, layout: &Layout, cuts: &[String]) -> Vec<String> {
    let mut out = vec![request.model.display().to_string()];
    let mut flag = |name: &str, value: String| out.extend([format!("--{name}"), value]);
    flag("seq-len", request.seq_len.to_string());
    flag("micro-batch", layout.micro_batch.to_string());
    flag("grad-accum", layout.grad_accum.to_string());
    for (name, value) in [("tp", layout.tp), ("cp", layout.cp), ("pp", layout.pp), ("dp", layout.dp), ("ep", layout.ep)]
    {
        if value > 1 {
            flag(name, value.to_string());
        }
    }
    if layout.cp > 1 && layout.cp_comm_type != "all_gather" {
        flag("cp-comm-type", layout.cp_comm_type.clone());
    }
    if layout.zero > 0 {
        flag("zero", layout.zero.to_string());
    }
    if precision != "f32" {
        flag("precision", precision.to_string());
    }
    if layout.recompute != "none" {
        flag("recompute", layout.recompute.clone());
    }
    if layout.schedule != "1f1b" {
        flag("schedule", layout.schedule.clone());
    }
    if layout.virtual_stages > 1 {
        flag("virtual-stages", layout.virtual_stages.to_string());
    }
    if !cuts.is_empty() {
        flag("pp-cuts", cuts.join(","));
    }
    if layout.offload_optimizer {
        flag("offload-optimizer", "cpu".into());
    }
    if layout.offload_param {
        flag("offload-param", "cpu".into());
    }
    if layout.sequence_parallel {
        out.push("--sequence-parallel".into());
    }
    if let Some(factor) = request.moe_expert_capacity_factor {
        out.extend(["--moe-expert-capacity-factor".into(), factor.to_string()]);
    }
    out
}

/// Layers per pipeline stage: as even as can be, the extra ones on the middle stages (the
/// first holds the embedding, the last the head).
pub(super) fn stage_layers(layers: usize, pp: usize) -> Vec<usize> {
    let mut counts = vec![layers / pp; pp];
    let order: Vec<usize> = if pp > 2 { (1..pp - 1).chain([0, pp - 1]).collect() } else { (0..pp).collect() };
    for &s in order.iter().cycle().take(layers % pp) {
        counts[s] += 1;
    }
    counts
}

pub(super) fn divisors(n: usize) -> Vec<usize> {
    (1..=n).filter(|&d| n.is_multiple_of(d)).collect()
}

/// `--pp-cuts` that give each of `pp` stages (virtual stages, with model chunks)
/// [`stage_layers`]'s layers.
pub(super) fn pipeline_cuts(
    numbered: &autotp_passes::pipeline::NumberedLayers,
    pp: usize,
    layers: usize,
) -> Vec<String> {
    let counts = stage_layers(layers, pp);
    let mut first = 0;
    let mut cuts = Vec::new();
    for count in &counts[..pp - 1] {
        first += count;
        cuts.push(format!("{}.{}", numbered.prefix, numbered.numbers[first]));
    }
    cuts
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stages_get_their_share_of_layers() {
        assert_eq!(stage_layers(80, 8), vec![10; 8]);
        assert_eq!(stage_layers(10, 4), vec![2, 3, 3, 2]);
        assert_eq!(stage_layers(5, 2), vec![3, 2]);
        assert_eq!(stage_layers(4, 1), vec![4]);
    }
}
