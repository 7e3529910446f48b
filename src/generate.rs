//! `autotp generate MODEL.onnx [--checkpoint CKPT] --tokenizer tokenizer.json --prompt TEXT
//! [--max-new-tokens N] [--temperature T] [--top-k K] [--seed S]`: a continuation of the prompt,
//! for a quick look at what a model learned. Greedy by default (as `generate(do_sample=False)`);
//! with a temperature, sampled from the top k.
//!
//! The model's forward pass is compiled once for the prompt plus the new tokens; each new token
//! runs it over the whole sequence so far (the positions after it hold padding, which a causal
//! model's earlier logits do not see) and takes the logits of the last real position. No cache:
//! a look, not a server.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use autotp_frontend::ImportOptions;
use autotp_ir::DType;
use autotp_runtime::HostTensor;
use autotp_train::checkpoint::Checkpoint;
use autotp_train::dataset::SplitMix64;
use clap::Args;

#[derive(Args)]
pub struct GenerateArgs {
    /// The ONNX model (its logits output, as scripts/export_hf.py exports it).
    model: PathBuf,
    /// The weights of this checkpoint instead of the model's (a --save directory or one step).
    #[arg(long, value_name = "DIR")]
    checkpoint: Option<PathBuf>,
    /// The Hugging Face tokenizer file.
    #[arg(long, value_name = "tokenizer.json")]
    tokenizer: PathBuf,
    #[arg(long)]
    prompt: String,
    #[arg(long, default_value_t = 32)]
    max_new_tokens: usize,
    /// Sample with this temperature instead of taking the likeliest token (0: greedy).
    #[arg(long, default_value_t = 0.0)]
    temperature: f64,
    /// With a temperature, sample among the K likeliest tokens (0: all).
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

pub fn run(args: &GenerateArgs) -> Result<()> {
    if args.temperature < 0.0 || !args.temperature.is_finite() {
        bail!("--temperature {}: expected 0 (greedy) or more", args.temperature);
    }
    let tokenizer = tokenizers::Tokenizer::from_file(&args.tokenizer)
        .map_err(|e| anyhow::anyhow!("{}: not a tokenizer file: {e}", args.tokenizer.display()))?;
    let encoding =
        tokenizer.encode(args.prompt.as_str(), true).map_err(|e| anyhow::anyhow!("tokenizing the prompt: {e}"))?;
    let prompt: Vec<u32> = encoding.get_ids().to_vec();
    if prompt.is_empty() {
        bail!("--prompt '{}' has no tokens", args.prompt);
    }
    let length = prompt.len() + args.max_new_tokens;
    let input = autotp_frontend::onnx::input_names(&args.model)?;
    let [input] = &input[..] else {
        bail!(
            "{}: generate needs a model of one input (token ids); it takes {}",
            args.model.display(),
            input.join(", ")
        );
    };
    let options = ImportOptions { input_shapes: [(input.clone(), vec![1, length])].into(), ..ImportOptions::default() };
    let mut executor = crate::forward_executor(&args.model, &options)?;
    if let Some(dir) = &args.checkpoint {
        let checkpoint = Checkpoint::open(dir)?;
        for t in crate::export::trained_params(&checkpoint) {
            executor.load_slot(&t.name, &t.bytes).with_context(|| format!("the checkpoint's '{}'", t.name))?;
        }
    }
    let eos = crate::data::config_eos(&args.tokenizer)?;
    let mut ids = prompt.clone();
    let mut rng = SplitMix64::new(args.seed);
    while ids.len() < length {
        let padded = ids.iter().copied().chain(std::iter::repeat(0)).take(length);
        let feed = HostTensor {
            dtype: DType::I64,
            shape: vec![1, length],
            data: padded.flat_map(|id| i64::from(id).to_le_bytes()).collect(),
        };
        let outputs = executor.run(&[feed])?;
        let logits = outputs.first().context("the model has no output")?;
        let vocab = *logits.shape.last().context("the logits have no vocabulary dim")?;
        if logits.dtype != DType::F32 || logits.shape.iter().product::<usize>() != length * vocab {
            bail!(
                "the model's first output is {}{:?}, not f32 logits [1, {length}, vocab]",
                logits.dtype,
                logits.shape
            );
        }
        let row = (ids.len() - 1) * vocab;
        let scores: Vec<f32> = logits.data[row * 4..(row + vocab) * 4]
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        let next = if args.temperature == 0.0 { argmax(&scores) } else { sample(&scores, args, &mut rng) };
        ids.push(next as u32);
        if eos == Some(next as u32) {
            break;
        }
    }
    let new = &ids[prompt.len()..];
    let decode = |ids: &[u32]| tokenizer.decode(ids, true).map_err(|e| anyhow::anyhow!("decoding: {e}"));
    // The continuation as the whole sequence decodes it (spaces between words included).
    let (whole, before) = (decode(&ids)?, decode(&prompt)?);
    let continuation = whole
        .strip_prefix(before.as_str())
        .map_or_else(|| format!(" {}", decode(new).unwrap_or_default()), str::to_string);
    eprintln!("generated ids: {new:?}");
    println!("{}{continuation}", args.prompt);
    Ok(())
}

/// The first likeliest token (as torch.argmax).
fn argmax(scores: &[f32]) -> usize {
    (0..scores.len()).fold(0, |best, i| if scores[i] > scores[best] { i } else { best })
}

/// A token drawn from softmax(scores / temperature) over the top k.
fn sample(scores: &[f32], args: &GenerateArgs, rng: &mut SplitMix64) -> usize {
    let mut order: Vec<usize> = (0..scores.len()).collect();
    order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]));
    if args.top_k > 0 {
        order.truncate(args.top_k);
    }
    let top = f64::from(scores[order[0]]);
    let weights: Vec<f64> = order.iter().map(|&i| ((f64::from(scores[i]) - top) / args.temperature).exp()).collect();
    let mut left = rng.uniform() * weights.iter().sum::<f64>();
    for (&i, w) in order.iter().zip(&weights) {
        left -= w;
        if left <= 0.0 {
            return i;
        }
    }
    order[order.len() - 1]
}
