//! `autotp plan`: the layout search ([`autotp_compiler::layout_search`]) from the command
//! line: its flags, and its result printed as a table of the fastest layouts that fit, the
//! refusals by reason, the `autotp compile` flags of the best, and `--json`.

use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use autotp_compiler::flags::parse_bytes;
use autotp_compiler::layout_search::{search, Considered, SearchRequest};
use autotp_compiler::summary::grouped;
use clap::Args;

#[derive(Args)]
pub struct PlanArgs {
    /// The ONNX model (its weights may be absent).
    model: PathBuf,
    /// Devices to lay the model out on.
    #[arg(long)]
    devices: usize,
    /// Memory of each device: bytes, or with a unit (80GiB, 141GB).
    #[arg(long, value_parser = parse_bytes)]
    memory_per_device: u64,
    /// Sequences per optimizer step, all devices together [default: --devices].
    #[arg(long)]
    global_batch: Option<usize>,
    /// Tokens per sequence.
    #[arg(long, default_value_t = 2048)]
    seq_len: usize,
    /// The device the cost model times: h100, h200 (bf16 tensor cores, NVLink in nodes of 8,
    /// InfiniBand between them) or cpu (ranks sharing this machine's cores).
    #[arg(long, default_value = "h100", value_parser = ["h100", "h200", "cpu"])]
    device: String,
    /// How many of the fastest layouts that fit to print.
    #[arg(long, default_value_t = 5)]
    top: usize,
    /// f32, bf16 or fp16 [default: bf16 on GPUs, f32 on cpu].
    #[arg(long, value_parser = ["f32", "bf16", "fp16"])]
    precision: Option<String>,
    /// The micro-batch sizes to try.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8")]
    micro_batches: Vec<usize>,
    /// The recomputations to try.
    #[arg(long, value_delimiter = ',', default_value = "none,selective,full", value_parser = ["none", "elementwise", "selective", "full"])]
    recompute: Vec<String>,
    /// Devices per node: tp stays inside one; a dp group wider than one crosses InfiniBand
    /// [default: 8 on GPUs, --devices on cpu].
    #[arg(long)]
    devices_per_node: Option<usize>,
    /// Link bandwidths in GB/s per device: inside a node (NVLink; cpu: shared memory) and
    /// between nodes (InfiniBand) [defaults: the device's].
    #[arg(long)]
    node_link_gbps: Option<f64>,
    #[arg(long)]
    network_gbps: Option<f64>,
    /// Compile the fastest N layouts that fit in full (shapes-only) and show their exact
    /// per-device peak beside the prediction; one the compiler refuses or that does not fit
    /// after all is refused, and the next is compiled in its place (up to 4N + 8 compiles).
    /// Slow for large models with many micro-batches (the 70B model: about a minute a layout).
    #[arg(long, default_value_t = 0)]
    verify: usize,
    /// Write every layout considered, with its figures or why it was refused, as JSON.
    #[arg(long, value_name = "FILE.json")]
    json: Option<PathBuf>,
    /// Bound each expert's pairs in every layout, as `autotp compile
    /// --moe-expert-capacity-factor` does (the search never chooses it: it drops pairs).
    #[arg(long, value_name = "F")]
    moe_expert_capacity_factor: Option<f64>,
}

/// `--json`: what the search knew of the model and the devices, and every layout considered.
#[derive(serde::Serialize)]
struct PlanDocument<'a> {
    device: &'a autotp_compiler::layout_search::Device,
    global_batch: usize,
    layer_kinds: Vec<LayerKind>,
    layers: usize,
    layouts: &'a [Considered],
    models: &'a BTreeMap<String, autotp_compiler::layout_search::Model>,
    parameters: usize,
    precision: &'a str,
    seq_len: usize,
}

/// A kind of layer in `--json`: its first layer's number and how many layers are of it.
#[derive(serde::Serialize)]
struct LayerKind {
    first: u64,
    layers: usize,
}

/// Runs the search and prints it.
pub fn run(args: &PlanArgs) -> Result<()> {
    if args.devices == 0 || args.seq_len == 0 || args.top == 0 {
        bail!("--devices, --seq-len and --top must be at least 1");
    }
    let request = SearchRequest {
        model: args.model.clone(),
        devices: args.devices,
        memory_per_device: args.memory_per_device,
        global_batch: args.global_batch,
        seq_len: args.seq_len,
        device: args.device.clone(),
        precision: args.precision.clone(),
        micro_batches: args.micro_batches.clone(),
        recompute: args.recompute.clone(),
        devices_per_node: args.devices_per_node,
        node_link_gbps: args.node_link_gbps,
        network_gbps: args.network_gbps,
        verify: args.verify,
        moe_expert_capacity_factor: args.moe_expert_capacity_factor,
    };
    let result = search(&request)?;
    let (device, precision, layers, per_node) = (&result.device, &result.precision, result.layers, result.per_node);
    let (global_batch, considered) = (result.global_batch, &result.considered);
    let fitting: Vec<&Considered> = result.fitting.iter().map(|&i| &considered[i]).collect();
    let tokens = (global_batch * args.seq_len) as f64;
    // A model of several kinds of layer says how many of each: "2 like layer 0, 4 like layer 2".
    let kinds = match &result.layer_kinds[..] {
        [_] | [] => String::new(),
        kinds => {
            let each: Vec<String> = kinds.iter().map(|(count, first)| format!("{count} like layer {first}")).collect();
            format!(": {}", each.join(", "))
        }
    };
    println!(
        "plan: {} ({} parameters, {layers} layers{kinds}) on {} {} devices of {} bytes each ({per_node} per node); \
         global batch {global_batch} x seq-len {} = {tokens} tokens per step; {precision}",
        args.model.display(),
        grouped(result.parameters),
        args.devices,
        device.name,
        grouped(args.memory_per_device as usize),
        args.seq_len,
    );
    let (compiled_cuts, searched) = (result.compiled_cuts, result.search_seconds);
    println!(
        "searched {} layouts: {} fit, {} refused ({compiled_cuts} cuts of the model compiled in {searched:.1} s)",
        considered.len(),
        fitting.len(),
        considered.len() - fitting.len(),
    );
    if args.verify > 0 {
        println!(
            "verified {} by compiling {} whole in {:.1} s (column 'compiled')",
            result.verified, result.verify_tried, result.verify_seconds
        );
    }
    // Memory columns in GiB, or MiB for small devices.
    let unit =
        if args.memory_per_device >= 1 << 30 { ("GiB", (1u64 << 30) as f64) } else { ("MiB", (1u64 << 20) as f64) };
    println!();
    println!(
        "{:>3} {:>3} {:>2} {:>3} {:>3} {:>8} {:>4} {:>3} {:>4} {:>4} {:>3} {:>4} {:>9} {:>10} {:>12} {:>7} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>10}",
        "#",
        "tp",
        "sp",
        "cp",
        "pp",
        "schedule",
        "dp",
        "ep",
        "zero",
        "off",
        "mb",
        "acc",
        "recompute",
        "step (ms)",
        "tokens/s",
        "bubble",
        "params",
        "grads",
        "optim",
        "activ",
        "staging",
        format!("peak {}", unit.0),
        "compiled",
        "comm MB"
    );
    for (i, c) in fitting.iter().take(args.top).enumerate() {
        let (l, p) = (&c.layout, c.prediction.as_ref().expect("fits"));
        println!(
            "{:>3} {:>3} {:>2} {:>3} {:>3} {:>8} {:>4} {:>3} {:>4} {:>4} {:>3} {:>4} {:>9} {:>10.1} {:>12.0} {:>6.1}% {:>9.2} {:>9.2} {:>9.2} {:>9.2} {:>9.2} {:>9.2} {:>9} {:>10.1}",
            i + 1,
            l.tp,
            if l.sequence_parallel { "sp" } else { "-" },
            match l.cp_comm_type.as_str() {
                "p2p" => format!("{}r", l.cp),
                _ => l.cp.to_string(),
            },
            l.pp,
            schedule_label(l),
            l.dp,
            l.ep,
            l.zero,
            match (l.offload_optimizer, l.offload_param) {
                (_, true) => "o+p",
                (true, false) => "o",
                _ => "-",
            },
            l.micro_batch,
            l.grad_accum,
            l.recompute,
            1e3 * p.step_seconds,
            tokens / p.step_seconds,
            100.0 * p.bubble_fraction,
            p.memory.params / unit.1,
            p.memory.grads / unit.1,
            p.memory.optimizer / unit.1,
            p.memory.activations / unit.1,
            p.memory.staging / unit.1,
            p.memory.peak / unit.1,
            c.compiled_peak.map_or("-".to_string(), |peak| format!("{:.2}", peak / unit.1)),
            p.comm_bytes / 1e6
        );
    }
    if let Some(best) = fitting.first() {
        let p = best.prediction.as_ref().expect("fits");
        println!();
        println!(
            "best: compute {:.4} s, tp {:.4} s, cp {:.4} s, ep {:.4} s, pipeline bubble and sends {:.4} s, dp (exposed) \
             {:.4} s per step",
            p.compute_seconds, p.tp_seconds, p.cp_seconds, p.ep_seconds, p.pipeline_seconds, p.dp_seconds
        );
        if best.layout.offload_optimizer {
            println!(
                "  offloaded: {:.4} s per step on the host and its link; {:.2} {} of optimizer states and {:.2} {} of \
                 parameter shards per device in host memory",
                p.offload_seconds,
                p.memory.host_optimizer / unit.1,
                unit.0,
                p.memory.host_params / unit.1,
                unit.0
            );
        }
        let flags = best.compile_args.as_ref().expect("a layout that fits has its flags");
        println!("  autotp compile {} -o plan.atp", flags.join(" "));
    }
    // Refusals, by reason (numbers stripped), with a count and one example.
    let mut reasons: BTreeMap<String, (usize, String)> = BTreeMap::new();
    for c in considered.iter() {
        if let Some(why) = &c.refused {
            let kind: String = why.chars().filter(|ch| !ch.is_ascii_digit() && !matches!(ch, '.' | ',')).collect();
            let entry = reasons.entry(kind).or_insert((0, why.clone()));
            entry.0 += 1;
        }
    }
    if !reasons.is_empty() {
        println!();
        println!("refused:");
        let mut reasons: Vec<(usize, String)> = reasons.into_values().collect();
        reasons.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
        for (count, example) in reasons {
            println!("  {count:>5} x {example}");
        }
    }
    if let Some(path) = &args.json {
        let document = PlanDocument {
            device,
            global_batch,
            layer_kinds: result.layer_kinds.iter().map(|&(layers, first)| LayerKind { first, layers }).collect(),
            layers,
            layouts: considered,
            models: &result.models,
            parameters: result.parameters,
            precision,
            seq_len: args.seq_len,
        };
        // Written as it is serialised: the 70B search's 128,088 layouts held as one JSON value
        // took 500 MB.
        let file = std::fs::File::create(path).with_context(|| format!("cannot write {}", path.display()))?;
        let mut out = std::io::BufWriter::new(file);
        serde_json::to_writer_pretty(&mut out, &document)?;
        std::io::Write::flush(&mut out).with_context(|| format!("cannot write {}", path.display()))?;
    }
    if fitting.is_empty() {
        // A failure to a script too, after the reasons above.
        bail!(
            "no layout of {} devices fits {} bytes per device ({} considered, all refused: above)",
            args.devices,
            grouped(args.memory_per_device as usize),
            considered.len()
        );
    }
    Ok(())
}

/// A layout's pipeline schedule in the table: `-` without a pipeline, `1f1b`, `zb-h1`, or the
/// interleaved `1f1b x V`.
fn schedule_label(layout: &autotp_compiler::layout_search::Layout) -> String {
    match (layout.pp, layout.virtual_stages) {
        (1, _) => "-".to_string(),
        (_, 1) => layout.schedule.clone(),
        (_, v) => format!("{} x{v}", layout.schedule),
    }
}
