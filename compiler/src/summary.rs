//! The compile summary `autotp compile` prints: the step's shape, parameters, per-rank memory
//! by category (a table by stage with a pipeline), recomputation and offload figures beside
//! the formulas they follow, instructions by kernel, communication, fingerprint.

use std::collections::BTreeMap;

use autotp_kernels::Kernel;
use autotp_program::offload::NvmeOffload;
use autotp_program::param_file::ParamSwap;
use autotp_program::plan::{RecomputeSummary, TrainingPlan};
use autotp_program::report::Report;
use autotp_program::step::SequenceOrder;
use autotp_program::{Instruction, Program, HOST_POOL};

/// The plan in a few lines: step shape, parameters, memory by category (rank 0's `report`; a
/// table by stage with a pipeline), kernels, communication.
pub fn summary(plan: &TrainingPlan, report: &Report) -> String {
    let mut lines = step_lines(plan);
    if plan.training.pipeline.is_some() {
        lines.extend(pipeline_table(plan, report));
    } else {
        lines.extend(memory_table(plan, report));
    }
    lines.extend(param_offload_lines(plan));
    if let Some(r) = &plan.training.recompute {
        lines.extend(recompute_lines(plan, r));
    }
    if let Some(nvme) = &plan.training.nvme {
        lines.extend(nvme_lines(plan, nvme));
    }
    lines.push(instructions_line(plan));
    lines.extend(idle_gpu_lines(plan));
    lines.extend(communication_line(plan, report));
    lines.extend(context_parallel_lines(plan));
    lines.extend(expert_parallel_lines(plan));
    lines.push(validation_line(&plan.evaluation));
    lines.push(format!("  fingerprint: {}", plan.fingerprint()));
    lines.join("\n") + "\n"
}

/// The plan's model, the step's shape and layout, the parameters and the padding rows.
fn step_lines(plan: &TrainingPlan) -> Vec<String> {
    let p = &plan.stages[0];
    let t = &plan.training;
    let params: Vec<&autotp_program::Slot> = plan.params().into_iter().map(|(_, slot)| slot).collect();
    let numel = |slots: &[&autotp_program::Slot]| slots.iter().map(|s| s.numel()).sum::<usize>();
    let frozen_slots: Vec<&autotp_program::Slot> =
        params.iter().copied().filter(|s| t.frozen.contains(&s.name)).collect();
    let total = numel(&params);
    let frozen = numel(&frozen_slots);
    let stage_size: usize = p.mesh.iter().map(|a| a.size).product();
    let mut layout = Vec::new();
    if plan.stages.len() > 1 {
        layout.push(format!("pp={}", plan.stages.len()));
    }
    layout.extend(p.mesh.iter().map(|a| format!("{}={}", a.name, a.size)));
    let mut lines = vec![
        format!("plan: {} ({})", plan.model.name, plan.model.path.display()),
        format!(
            "  step: {}micro-batch {} x seq-len {}{} = {} tokens; {}; lr {}{}",
            if layout.is_empty() {
                String::new()
            } else {
                format!("{} ({} ranks), ", layout.join(" x "), stage_size * plan.stages.len())
            },
            t.micro_batch,
            t.seq_len,
            if t.grad_accum > 1 { format!(" x {} micro-batches", t.grad_accum) } else { String::new() },
            t.global_batch * t.seq_len,
            t.optimizer,
            t.schedule,
            t.grad_clip.map(|c| format!("; grad-clip {c}")).unwrap_or_default()
        ),
        format!(
            "  parameters: {} in {} tensors ({} trainable, {} frozen in {} tensors)",
            grouped(total),
            params.len(),
            grouped(total - frozen),
            grouped(frozen),
            frozen_slots.len()
        ),
    ];
    for padding in &t.padding_rows {
        let why = match (padding.detected, padding.from_metadata) {
            (true, _) => "its one zero row at import".to_string(),
            (false, true) => format!("the model's metadata '{}'", autotp_frontend::PADDING_IDX_METADATA),
            (false, false) => "--padding-idx".to_string(),
        };
        lines.push(format!("  padding row: {} row {} gets no gradient ({why})", padding.table, padding.row));
    }
    lines
}

/// With a pipeline: its schedule and bubble, and a table of each stage's FLOPs, idle share and
/// bytes per rank.
fn pipeline_table(plan: &TrainingPlan, report: &Report) -> Vec<String> {
    let t = &plan.training;
    let Some(pipeline) = &t.pipeline else { return Vec::new() };
    let stage_size: usize = plan.stages[0].mesh.iter().map(|a| a.size).product();
    let mut lines = Vec::new();
    let interleaved = if pipeline.virtual_stages > 1 {
        format!(" x {} model chunks per stage (interleaved)", pipeline.virtual_stages)
    } else {
        String::new()
    };
    lines.push(format!(
        "  pipeline: {} stages{interleaved}, {} schedule ({} backward) over {} micro-batches; bubble {} = {:.1}% \
         of a step",
        plan.stages.len(),
        pipeline.schedule,
        pipeline.backward,
        t.grad_accum,
        pipeline.bubble_formula(),
        100.0 * pipeline.bubble_fraction
    ));
    lines.push(format!(
        "  {:<6} {:>14} {:>7} {:>12} {:>14} {:>16} {:>14} {:>10} {:>14}",
        "stage",
        "forward FLOPs",
        "idle",
        "parameters",
        "optimizer",
        "activations peak",
        "arena",
        "in flight",
        "sent/step"
    ));
    for (s, (program, rank)) in plan.stages.iter().zip(report.ranks.iter().step_by(stage_size)).enumerate() {
        let m = &program.memory;
        lines.push(format!(
            "  {s:<6} {:>14} {:>6.1}% {:>12} {:>14} {:>16} {:>14} {:>10} {:>14}",
            grouped(pipeline.stage_flops.get(s).copied().unwrap_or(0) as usize),
            100.0 * pipeline.planned_idle(s),
            grouped(m.params_bytes),
            grouped(m.states_bytes + offloaded_states_bytes(program)),
            grouped(m.activations_peak_bytes),
            grouped(m.arena_bytes),
            rank.micro_batches_in_flight,
            grouped(rank.comm_bytes_per_step.send)
        ));
    }
    lines.push(
        "  (bytes per rank of each stage; idle: the share of a step the schedule leaves the stage idle, \
         by the cost model)"
            .to_string(),
    );
    lines
}

/// Without a pipeline: rank 0's memory by category.
fn memory_table(plan: &TrainingPlan, report: &Report) -> Vec<String> {
    let (p, rank, t) = (&plan.stages[0], &report.ranks[0], &plan.training);
    let mib = |b: usize| b as f64 / (1 << 20) as f64;
    let mut lines = Vec::new();
    let m = &p.memory;
    let offloaded_label = match t.nvme {
        Some(_) => "optimizer state offloaded (NVMe file)",
        None => "optimizer state offloaded (host pool)",
    };
    lines.push(format!("  {:<40} {:>15} {:>10}", "memory (per rank)", "bytes", "MiB"));
    let mut rows = vec![("parameters", m.params_bytes)];
    let in_file = params_in_file_bytes(p);
    if m.offloaded_params_bytes > in_file {
        rows.push(("parameters offloaded (host pool)", m.offloaded_params_bytes - in_file));
    }
    if in_file > 0 {
        rows.push(("parameters offloaded (NVMe file)", in_file));
    }
    for (what, bytes) in rows.into_iter().chain([
        ("optimizer state", m.states_bytes),
        (offloaded_label, offloaded_states_bytes(p)),
        ("gradients (inside activations)", rank.grads_bytes),
        ("activations peak (with gradients)", m.activations_peak_bytes),
        ("inputs", m.inputs_bytes),
        ("constants", m.constants_bytes),
        ("total arena", m.arena_bytes),
    ]) {
        lines.push(format!("  {what:<40} {:>15} {:>10.2}", grouped(bytes), mib(bytes)));
    }
    lines
}

/// Each stage's ZeRO-3 parameter offload: where the shards lie and what the step reads.
fn param_offload_lines(plan: &TrainingPlan) -> Vec<String> {
    let mut lines = Vec::new();
    for (s, swap) in param_swaps(plan) {
        let m = &plan.stages[s].memory;
        let stage = if plan.stages.len() > 1 { format!(" (stage {s})") } else { String::new() };
        let where_ = match (&swap, &plan.training.nvme_params) {
            (Some(swap), Some(settings)) => {
                let in_file = params_in_file_bytes(&plan.stages[s]);
                format!(
                    "{} in host memory and {} in a file under {} (at most {} shard{}, {} bytes, in memory at once, of \
                     --buffer-count {}); the file is read {} bytes and written {} bytes per step",
                    grouped(m.offloaded_params_bytes - in_file),
                    grouped(in_file),
                    settings.path.display(),
                    swap.peak_params,
                    if swap.peak_params == 1 { "" } else { "s" },
                    grouped(swap.peak_bytes),
                    settings.buffer_count,
                    grouped(swap.read_bytes),
                    grouped(swap.written_bytes),
                )
            }
            _ => "in host memory".to_string(),
        };
        lines.push(format!(
            "  parameter offload{stage}: {} bytes of ZeRO-3 shards per rank, {where_}; arena {} bytes instead of {}; \
             {} bytes read from them per step by their gathers",
            grouped(m.offloaded_params_bytes),
            grouped(m.arena_bytes),
            grouped(m.arena_bytes + m.offloaded_params_bytes),
            grouped(m.param_fetch_bytes)
        ));
    }
    lines
}

/// The instructions by kernel (or collective), most frequent first.
fn instructions_line(plan: &TrainingPlan) -> String {
    let mut kernels: BTreeMap<String, usize> = BTreeMap::new();
    let instructions = plan.stages.iter().flat_map(|p| p.instructions.iter().map(move |i| (p, i)));
    for (program, instruction) in instructions {
        let name = match instruction {
            Instruction::Kernel { kernel, .. } => kernel.name().to_string(),
            Instruction::Generated { kernel, .. } => format!("gen.{}", program.kernels[*kernel].name),
            Instruction::Collective { op, .. } => op.kind.name().to_string(),
            Instruction::CollectiveStart { op, .. } => format!("{}_start", op.kind.name()),
            Instruction::Wait { .. } => "wait".to_string(),
            Instruction::Send { .. } => "send".to_string(),
            Instruction::Recv { .. } => "recv".to_string(),
            Instruction::OptimizerStep { optimizer, .. } => optimizer.multi_tensor_name(),
        };
        *kernels.entry(name).or_default() += 1;
    }
    let mut by_count: Vec<(String, usize)> = kernels.into_iter().collect();
    by_count.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    let listed: Vec<String> = by_count.iter().map(|(k, n)| format!("{k} {n}")).collect();
    let count: usize = plan.stages.iter().map(|p| p.instructions.len()).sum();
    format!("  instructions: {count} ({})", listed.join(", "))
}

/// The bytes rank 0 sends per step by collective kind, its staging and peak (none on one rank).
fn communication_line(plan: &TrainingPlan, report: &Report) -> Option<String> {
    let rank = &report.ranks[0];
    if plan.stages[0].mesh.is_empty() {
        return None;
    }
    let c = &rank.comm_bytes_per_step;
    // The exchanges only some layouts make: expert and Ulysses all-to-alls, the ring's shifts.
    let exchanges: String = [(", all-to-all", c.all_to_all), (", ring", c.ring_shift)]
        .iter()
        .filter(|&&(_, bytes)| bytes > 0)
        .map(|&(name, bytes)| format!("{name} {}", grouped(bytes)))
        .collect();
    Some(format!(
        "  communication per rank per step (bytes sent): all-reduce {}, reduce-scatter {}, all-gather {}{exchanges}; staging {}; peak {}",
        grouped(c.all_reduce),
        grouped(c.reduce_scatter),
        grouped(c.all_gather),
        grouped(rank.comm_buffer_bytes),
        grouped(rank.peak_bytes)
    ))
}

/// The summary's lines on context parallelism (`--cp`), one per stage: how each sequence is
/// split, and the collectives over `cp` per rank per step with the bytes each kind sends:
/// attention's keys and values all-gathered (or passed around the ring), their gradients
/// reduce-scattered, the weights' gradients all-reduced.
fn context_parallel_lines(plan: &TrainingPlan) -> Vec<String> {
    let t = &plan.training;
    let mut lines = Vec::new();
    for (s, program) in plan.stages.iter().enumerate() {
        let Some(axis) = program.mesh.iter().position(|a| a.name == autotp_program::mesh::CONTEXT_AXIS) else {
            continue;
        };
        let n = program.mesh[axis].size;
        let sent = sent_over(program, axis);
        let kinds: Vec<String> = [
            ("all_gather", "all-gathers of keys and values"),
            ("reduce_scatter", "reduce-scatters of their gradients"),
            ("all_to_all", "all-to-alls of attention's operands, results and their gradients"),
            ("ring_shift", "ring shifts of keys and values, and of their gradients' sums"),
            ("all_reduce", "all-reduces of weight gradients and the loss"),
        ]
        .iter()
        .filter_map(|(kind, what)| sent.get(kind).map(|(count, bytes)| format!("{count} {what} ({})", grouped(*bytes))))
        .collect();
        let stage = if plan.stages.len() > 1 { format!(", stage {s}") } else { String::new() };
        let attention = if sent.contains_key("all_to_all") {
            "attention runs over the whole sequence for 1/cp of the heads, exchanged all-to-all (Ulysses)"
        } else if sent.contains_key("ring_shift") {
            "attention takes each rank's queries over the keys and values of one rank at a time, passed around a \
             ring (two ranks' held at once)"
        } else {
            "attention takes each rank's queries over the keys and values of all"
        };
        lines.push(format!(
            "  context parallelism{stage}: each sequence's {} tokens split over cp={n} ({} per rank); {attention}",
            t.seq_len,
            t.seq_len / n,
        ));
        if !sent.contains_key("all_to_all") {
            lines.push(format!("    {}", causal_work_line(t.sequence_order, t.seq_len, n)));
        }
        let kinds = if kinds.is_empty() { "none".to_string() } else { kinds.join(", ") };
        lines.push(format!("    over cp, per rank per step (bytes sent): {kinds}"));
    }
    lines
}

/// How the cp ranks hold each sequence, and the query-key pairs each rank's causal attention
/// computes per sequence and head, beside what contiguous blocks would give.
fn causal_work_line(order: SequenceOrder, seq_len: usize, cp: usize) -> String {
    let pairs = |order: SequenceOrder| order.causal_pairs_per_rank(seq_len, cp).unwrap_or_default();
    let range = |pairs: &[u64]| {
        let (low, high) = (pairs.iter().min().copied().unwrap_or(0), pairs.iter().max().copied().unwrap_or(0));
        if low == high {
            format!("{} each", grouped(low as usize))
        } else {
            format!("{} to {}", grouped(low as usize), grouped(high as usize))
        }
    };
    let contiguous = range(&pairs(SequenceOrder::Natural));
    match order {
        SequenceOrder::LoadBalanced { cp } => format!(
            "load-balanced (Megatron): the sequence in {} chunks, rank r holding chunks r and {}-r; causal \
             query-key pairs per rank per sequence and head: {} (contiguous blocks: {contiguous})",
            2 * cp,
            2 * cp - 1,
            range(&pairs(order)),
        ),
        SequenceOrder::Natural => {
            format!("contiguous blocks; causal query-key pairs per rank per sequence and head: {contiguous}")
        }
    }
}

/// The summary's line on expert parallelism (`--ep`, over dp or groups of it), one per stage
/// that exchanges pairs: the exchanges per rank per step and the bytes they send; and on an
/// expert capacity (`--moe-expert-capacity-factor`), which bounds them.
fn expert_parallel_lines(plan: &TrainingPlan) -> Vec<String> {
    use autotp_program::mesh::{expert_axis, CONTEXT_AXIS, DATA_AXIS};
    let flags =
        (plan.training.compile_flags.as_ref()).and_then(|recorded| crate::CompileFlags::from_recorded(recorded).ok());
    let capacity_factor = flags.as_ref().and_then(|flags| flags.moe_expert_capacity_factor);
    let kept = match flags.map(|flags| flags.moe_token_drop_policy) {
        Some(crate::flags::TokenDropPolicy::Probs) => "those of the largest routing weights",
        _ => "its first",
    };
    let room = match capacity_factor {
        Some(factor) => format!(
            "capacity factor {factor}: each expert keeps ceil({factor} x S x k / E) of each sequence's pairs, {kept}, \
             and drops the others"
        ),
        None => "dropless: room for every pair of a rank with each destination, of which only the pairs the \
                 routing sends there go"
            .to_string(),
    };
    let mut lines = Vec::new();
    if capacity_factor.is_some() && plan.stages.iter().all(|p| expert_axis(&p.mesh).is_none()) {
        lines.push(format!("  experts: {room} (every rank holds every expert)"));
    }
    for (s, program) in plan.stages.iter().enumerate() {
        let axis_of = |name: &str| program.mesh.iter().position(|a| a.name == name);
        let Some(axis) = expert_axis(&program.mesh) else {
            continue;
        };
        let n = program.mesh[axis].size;
        let over = match axis_of(DATA_AXIS).filter(|&dp| dp != axis) {
            Some(dp) => {
                let groups = program.mesh[dp].size;
                format!(
                    "ep={n} ranks in each of dp={groups} groups of the data-parallel ranks (the experts' gradients \
                     summed over the groups; ZeRO shards the dense parameters over dp x ep, the experts over dp)"
                )
            }
            None => format!("dp={n}"),
        };
        if let Some(&(count, bytes)) = sent_over(program, axis).get("all_to_all") {
            let stage = if plan.stages.len() > 1 { format!(", stage {s}") } else { String::new() };
            let among = match axis_of(CONTEXT_AXIS) {
                Some(cp) => format!(
                    " among the {} ranks of the same part of the sequence (cp={})",
                    program.mesh[axis].name, program.mesh[cp].size
                ),
                None => String::new(),
            };
            lines.push(format!(
                "  expert parallelism{stage}: the experts split by expert over {over}; each (token, choice) pair sent \
                 to its expert's rank{among} and back: {count} all-to-alls per rank per step (at most {} bytes sent; \
                 {room})",
                grouped(bytes)
            ));
        }
    }
    lines
}

/// The collectives of `program` over mesh axis `axis`, by kind: how many, and the bytes they
/// send per rank per step.
fn sent_over(program: &autotp_program::Program, axis: usize) -> BTreeMap<&'static str, (usize, usize)> {
    let size = program.mesh[axis].size;
    let mut sent: BTreeMap<&str, (usize, usize)> = BTreeMap::new();
    for instruction in &program.instructions {
        if let Instruction::Collective { op, input, .. } | Instruction::CollectiveStart { op, input, .. } = instruction
        {
            if op.axis == axis {
                let entry = sent.entry(op.kind.name()).or_default();
                entry.0 += 1;
                entry.1 += op.kind.bytes_sent(input.len, size);
            }
        }
    }
    sent
}

/// The summary's line on the validation step (`run --eval-every`): what its arena adds per
/// rank while it is loaded, or why the plan has none.
fn validation_line(evaluation: &autotp_program::plan::Evaluation) -> String {
    use autotp_program::plan::Evaluation;
    match evaluation {
        Evaluation::Programs(programs) => {
            let arena = programs.iter().map(|p| p.memory.arena_bytes).max().unwrap_or(0);
            format!("  validation step: forward only, its own arena of {} bytes per rank once loaded", grouped(arena))
        }
        Evaluation::Refused(why) => format!("  validation step: none ({why})"),
    }
}

/// The summary's line on the kernels that would leave a GPU's multiprocessors idle, for a plan
/// that carries PTX (`autotp_codegen::gpu_kernels::idle_launches`); none when there are none.
fn idle_gpu_lines(plan: &TrainingPlan) -> Vec<String> {
    use autotp_codegen::gpu_kernels::{idle_launches, largest_target_gpu};
    let (gpu, multiprocessors) = largest_target_gpu();
    let mut idle: Vec<String> = Vec::new();
    for (s, program) in plan.stages.iter().enumerate().filter(|(_, p)| !p.ptx.is_empty()) {
        let stage = if plan.stages.len() > 1 { format!("stage {s}: ") } else { String::new() };
        idle.extend(idle_launches(program, multiprocessors).into_iter().map(|k| {
            let blocks = if k.blocks == 1 { "1 block".to_string() } else { format!("{} blocks", k.blocks) };
            format!("{stage}{} ({blocks} for {} elements, {} per step)", k.kernel, grouped(k.elements), k.per_step)
        }));
    }
    if idle.is_empty() {
        return Vec::new();
    }
    vec![format!(
        "  idle GPU: {} kernels launch fewer blocks than an {gpu} has multiprocessors ({multiprocessors}) over more than \
         a million elements: {}",
        idle.len(),
        idle.join(", ")
    )]
}

/// The summary's lines on the optimizer state in files: per stage, its tiles, the buffers in
/// memory and the bytes each step reads and writes.
fn nvme_lines(plan: &TrainingPlan, nvme: &NvmeOffload) -> Vec<String> {
    let mut lines = vec![format!(
        "  optimizer state on NVMe under {}: tiles of at most {} elements, {} buffers",
        nvme.path.display(),
        grouped(nvme.tile_elements),
        nvme.buffer_count
    )];
    for (s, program) in plan.stages.iter().enumerate() {
        let Ok(layout) = autotp_program::offload::Layout::of(program, nvme.tile_elements) else { continue };
        let stage = if plan.stages.len() > 1 { format!("stage {s}: ") } else { String::new() };
        let buffers = layout.buffers(nvme.buffer_count);
        lines.push(format!(
            "    {stage}{} tiles, {} bytes in memory ({buffers} x {}); {} bytes read and {} written per step",
            layout.tiles,
            grouped(buffers * layout.tile_bytes),
            grouped(layout.tile_bytes),
            grouped(layout.file_bytes),
            grouped(layout.file_bytes),
        ));
    }
    lines
}

/// The summary's lines on recomputation: per stage what it recomputes, at what cost, and the
/// activation peak with and without it, beside Korthikanti et al.'s formulas.
fn recompute_lines(plan: &TrainingPlan, r: &RecomputeSummary) -> Vec<String> {
    let mut lines = Vec::new();
    if let Some(cap) = r.memory_cap {
        let largest = plan.stages.iter().map(|p| p.memory.arena_bytes).max().unwrap_or(0);
        lines.push(format!("  memory cap {} per rank: largest arena {}", grouped(cap as usize), grouped(largest)));
    }
    for (s, program) in plan.stages.iter().enumerate() {
        let with = program.memory.activations_peak_bytes;
        // A cut of the model the layout search compiled has no figure without recomputation.
        let without = r.activations_peak_without.get(s).copied();
        let compared = without.map_or(String::new(), |without| {
            let change = 100.0 * (with as f64 - without as f64) / without.max(1) as f64;
            format!(" (without: {}, {change:+.1}%)", grouped(without))
        });
        let stage = if plan.stages.len() > 1 { format!("stage {s}: ") } else { String::new() };
        let chosen = r.chosen.get(s).map_or(r.mode.as_str(), String::as_str);
        let blocks = r.blocks[s];
        let what = match chosen {
            "elementwise" => "elementwise ops",
            "selective" => "attention blocks",
            _ => "layers",
        };
        lines.push(format!(
            "  recompute {chosen}: {stage}{blocks} {what} per step, +{} FLOPs; activations peak {}{compared}",
            grouped(r.flops[s] as usize),
            grouped(with),
        ));
        if blocks == 0 {
            let fused = |i: &Instruction| matches!(i, Instruction::Kernel { kernel: Kernel::Attention { .. }, .. });
            if chosen == "selective" && program.instructions.iter().any(fused) {
                lines.push(
                    "    fused attention keeps no scores or probabilities: nothing for selective recomputation to \
                     make again (Megatron's selective recomputation with flash attention)"
                        .to_string(),
                );
            }
            continue;
        }
        let Some(without) = without else { continue };
        let elements = r.probability_elements.get(s).copied().unwrap_or(0);
        let saved = without.saturating_sub(with);
        if let Some(&(sbh, bytes)) = r.layer_inputs.get(s).filter(|i| i.0 > 0) {
            let layers = r.layers.get(s).copied().unwrap_or(blocks).max(1);
            lines.push(format!(
                "    per layer: keeps its input, {} (Korthikanti et al. 2022: 2sbh = {} in 16-bit); the peak drops {} \
                 per layer recomputed (their sbh(34 + 5as/h) - 2sbh = {} in 16-bit, with dropout masks)",
                grouped(bytes),
                grouped(2 * sbh),
                grouped(saved / layers),
                grouped(34 * sbh + 5 * elements - 2 * sbh)
            ));
        } else if elements > 0 && chosen == "selective" {
            lines.push(format!(
                "    saved per attention block {}; Korthikanti et al. 2022: 5as^2b = {} per layer in 16-bit \
                 (scores 2, softmax 2, dropout mask 1 byte per probability; no dropout here)",
                grouped(saved / blocks),
                grouped(5 * elements)
            ));
        }
    }
    lines
}

/// `1234567` -> `1,234,567`.
pub fn grouped(n: usize) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// Each stage that offloads parameters, with the schedule of its shards in a file when
/// `--offload-param nvme` keeps some there.
fn param_swaps(plan: &TrainingPlan) -> Vec<(usize, Option<ParamSwap>)> {
    let settings = plan.training.nvme_params.as_ref();
    (plan.stages.iter().enumerate())
        .filter(|(_, p)| p.memory.offloaded_params_bytes > 0)
        .map(|(s, p)| {
            let swap = settings.and_then(|n| ParamSwap::of(p, n.buffer_count, n.buffer_size).ok().flatten());
            (s, swap)
        })
        .collect()
}

/// The bytes of a program's parameter shards in a file (`--offload-param nvme`): those in the
/// host pool's last `nvme_params_bytes`.
fn params_in_file_bytes(program: &Program) -> usize {
    let tail = HOST_POOL + program.memory.host_pool_bytes - program.memory.nvme_params_bytes;
    program.params.iter().filter(|s| s.region.in_host_pool() && s.region.offset >= tail).map(|s| s.region.len).sum()
}

/// The bytes of optimizer state in the host pool (`--offload-optimizer`).
fn offloaded_states_bytes(program: &Program) -> usize {
    program.states.iter().filter(|s| s.region.in_host_pool()).map(|s| s.region.len).sum()
}
