//! What each stage recomputes (`--recompute`): the flag's choice, or with `auto` the cheapest
//! that fits `--memory-cap` (found by lowering the stage for its memory plan), and the plan's
//! record of it ([`RecomputeSummary`]: blocks, FLOPs, the activation peak without it, the
//! figures Korthikanti et al.'s formulas need). The `fusion` step applies the choice.

use std::collections::BTreeSet;

use autotp_codegen::LowerOptions;
use autotp_ir::Graph;
use autotp_passes::recompute::{Recompute, Recomputed};
use autotp_passes::Pass;
use autotp_program::plan::RecomputeSummary;

use crate::flags::RecomputeFlag;
use crate::{CompileError, CompileOptions};

/// The recomputation the options ask for, and how to measure a stage's memory.
pub struct Recomputation {
    flag: RecomputeFlag,
    /// `--recompute-layers`.
    layers: Option<usize>,
    memory_cap: Option<u64>,
    /// How to lower a stage to measure it (no PTX).
    measure: LowerOptions,
    /// Whether to measure each stage's activation peak without recomputation for the summary
    /// ([`RecomputeSummary::activations_peak_without`]).
    peak_without: bool,
}

impl Recomputation {
    pub fn new(options: &CompileOptions, measure: LowerOptions, peak_without: bool) -> Recomputation {
        let flags = &options.flags;
        Recomputation {
            flag: flags.recompute,
            layers: flags.recompute_layers.map(|k| k as usize),
            memory_cap: flags.memory_cap,
            measure,
            peak_without,
        }
    }

    /// Nothing recomputed (a step without a backward).
    pub fn none(measure: LowerOptions) -> Recomputation {
        Recomputation { flag: RecomputeFlag::None, layers: None, memory_cap: None, measure, peak_without: false }
    }

    /// Whether anything may be recomputed (the plan then records what, and its figures).
    pub fn rewrites(&self) -> bool {
        self.flag != RecomputeFlag::None
    }

    pub fn empty_summary(&self) -> RecomputeSummary {
        RecomputeSummary {
            mode: self.flag.name().to_string(),
            chosen: Vec::new(),
            layer_inputs: Vec::new(),
            layers: Vec::new(),
            memory_cap: self.memory_cap,
            blocks: Vec::new(),
            flops: Vec::new(),
            activations_peak_without: Vec::new(),
            probability_elements: Vec::new(),
        }
    }
}

/// Stage `stage`'s recomputation (of `graph`, its step sharded but not fused); with
/// recomputation asked for, adds the stage's figures to `summary`.
pub fn choose_recompute(
    r: &Recomputation,
    graph: &Graph,
    stage: Option<usize>,
    summary: &mut RecomputeSummary,
) -> Result<Recompute, CompileError> {
    let generated = r.measure.kernels == autotp_codegen::KernelChoice::Generated;
    let recompute = match r.flag {
        RecomputeFlag::None => return Ok(Recompute::None),
        RecomputeFlag::Elementwise => Recompute::Elementwise,
        RecomputeFlag::Selective => Recompute::Selective,
        RecomputeFlag::Full => Recompute::Full { layers: r.layers },
        RecomputeFlag::Auto => {
            let cap = r.memory_cap.expect("validated: --recompute auto has a --memory-cap");
            fitting_recompute(graph, generated, &r.measure, cap, stage)?
        }
    };
    // What it recomputes, found as fusion finds them, before its schedule (which may move a
    // backward node that reads only forward values into the forward).
    let blocks = autotp_passes::recompute::blocks(graph, recompute);
    summary.chosen.push(recompute_name(recompute));
    summary.blocks.push(blocks.len());
    summary.flops.push(autotp_passes::recompute::flops(graph, &blocks));
    let attention = autotp_passes::recompute::blocks(graph, Recompute::Selective);
    let elements = attention.first().map_or(0, |b| match b.what {
        Recomputed::Attention { probability_elements } => probability_elements,
        Recomputed::Layer { .. } | Recomputed::Elementwise { .. } => 0,
    });
    summary.probability_elements.push(elements);
    let input = blocks.first().and_then(|b| match b.what {
        Recomputed::Layer { input, .. } => input,
        Recomputed::Attention { .. } | Recomputed::Elementwise { .. } => None,
    });
    let numbers: BTreeSet<u64> = (blocks.iter())
        .filter_map(|b| match b.what {
            Recomputed::Layer { number, .. } => Some(number),
            Recomputed::Attention { .. } | Recomputed::Elementwise { .. } => None,
        })
        .collect();
    summary.layers.push(numbers.len());
    summary.layer_inputs.push(input.map_or((0, 0), |v| (graph.ty(v).numel(), graph.ty(v).size_bytes())));
    // The activation peak without it, lowered for its memory plan alone.
    if r.peak_without {
        let mut kept = graph.clone();
        if generated {
            autotp_passes::fusion::Fusion::default().run(&mut kept)?;
        }
        let peak = autotp_codegen::lower_with(&kept, &r.measure)?.memory.activations_peak_bytes;
        summary.activations_peak_without.push(peak);
    }
    Ok(recompute)
}

/// How a plan's summary names what a stage recomputes.
pub fn recompute_name(recompute: Recompute) -> String {
    match recompute {
        Recompute::None => "none".into(),
        Recompute::Elementwise => "elementwise".into(),
        Recompute::Selective => "selective".into(),
        Recompute::Full { layers: None } => "full".into(),
        Recompute::Full { layers: Some(k) } => format!("full (first {k} layers)"),
    }
}

/// The cheapest recomputation that fits a rank of `graph` (a stage's step, sharded) in `cap`
/// bytes: none, elementwise ops, core attention, then whole layers, the first K of the stage
/// for the smallest K that fits. Refused, with the smallest reachable arena, when every layer
/// recomputed does not fit.
fn fitting_recompute(
    graph: &Graph,
    generated: bool,
    options: &LowerOptions,
    cap: u64,
    stage: Option<usize>,
) -> Result<Recompute, CompileError> {
    let arena = |recompute: Recompute| -> Result<u64, CompileError> {
        let mut graph = graph.clone();
        if generated {
            autotp_passes::fusion::Fusion { recompute }.run(&mut graph)?;
        } else {
            graph = autotp_passes::recompute::recompute(&graph, recompute).0;
        }
        Ok(autotp_codegen::lower_with(&graph, options)?.memory.arena_bytes as u64)
    };
    for recompute in [Recompute::None, Recompute::Elementwise, Recompute::Selective] {
        if arena(recompute)? <= cap {
            return Ok(recompute);
        }
    }
    let layers = autotp_passes::pipeline::numbered_layers(graph).map_or(0, |l| l.numbers.len());
    let full = arena(Recompute::Full { layers: None })?;
    if full > cap {
        let stage = stage.map_or("a rank".to_string(), |s| format!("stage {s}"));
        return Err(CompileError::Options(format!(
            "--memory-cap {cap} cannot be met: {stage} needs at least {full} bytes, with every one of its {layers} \
             layers recomputed (--recompute full); raise the cap, or split the model further (--tp, --pp, --zero 3)"
        )));
    }
    // The fewest layers that fit (more recomputed layers never need more memory).
    let (mut low, mut high) = (1, layers.max(1));
    while low < high {
        let middle = (low + high) / 2;
        if arena(Recompute::Full { layers: Some(middle) })? <= cap {
            high = middle;
        } else {
            low = middle + 1;
        }
    }
    Ok(if low >= layers { Recompute::Full { layers: None } } else { Recompute::Full { layers: Some(low) } })
}
