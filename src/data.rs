//! `autotp data prepare INPUT... --tokenizer tokenizer.json -o PREFIX`: raw text to Megatron-LM's
//! indexed dataset (`PREFIX.bin` + `PREFIX.idx`, [`autotp_train::indexed`]), as Megatron's
//! `tools/preprocess_data.py --append-eod` makes it.
//!
//! Inputs: `.txt` files (each one document, or each line one with `--lines`) and `.jsonl`
//! files (each line a JSON object whose `--json-key` field is one document). Documents are
//! tokenized in batches by the Hugging Face `tokenizers` crate (the tokenizer's own special
//! tokens added, as `tokenizer(text)` adds them) on `--workers` threads, each followed by the
//! end-of-document token, and written in input order, one sequence per document.

use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use autotp_train::indexed::{IndexedDtype, IndexedWriter};
use clap::{Args, Subcommand};

#[derive(Subcommand)]
pub enum DataCommand {
    /// Tokenize text files into a Megatron-LM indexed dataset (PREFIX.bin and PREFIX.idx).
    Prepare(PrepareArgs),
}

#[derive(Args)]
pub struct PrepareArgs {
    /// Text files: .txt (one document each, or one per line with --lines) and .jsonl (one
    /// document per line, its --json-key field).
    #[arg(required = true)]
    inputs: Vec<PathBuf>,
    /// The Hugging Face tokenizer file (tokenizer.json; scripts/export_hf.py writes it).
    #[arg(long, value_name = "tokenizer.json")]
    tokenizer: PathBuf,
    /// The dataset to write: PREFIX.bin and PREFIX.idx.
    #[arg(short, long = "output-prefix", value_name = "PREFIX")]
    output: PathBuf,
    /// The field of each .jsonl line that holds the document's text.
    #[arg(long, default_value = "text")]
    json_key: String,
    /// Each line of a .txt file is a document.
    #[arg(long)]
    lines: bool,
    /// Tokenizing threads [default: the machine's cores].
    #[arg(long)]
    workers: Option<usize>,
    /// The end-of-document token appended to each document: a token of the tokenizer or an id
    /// (default: the `eos_token_id` of the config.json beside the tokenizer, else the
    /// tokenizer's `<|endoftext|>`, `</s>`, `<|end_of_text|>` or `<eos>`).
    #[arg(long, value_name = "TOKEN|ID", conflicts_with = "no_eod")]
    eod: Option<String>,
    /// Append no end-of-document token.
    #[arg(long)]
    no_eod: bool,
}

pub fn run(command: &DataCommand) -> Result<()> {
    match command {
        DataCommand::Prepare(args) => prepare(args),
    }
}

/// Documents per tokenizer batch.
const BATCH_DOCUMENTS: usize = 1024;
/// Bytes of text per tokenizer batch, at most (long documents make smaller batches).
const BATCH_BYTES: usize = 16 << 20;

fn prepare(args: &PrepareArgs) -> Result<()> {
    let mut tokenizer = tokenizers::Tokenizer::from_file(&args.tokenizer)
        .map_err(|e| anyhow::anyhow!("{}: not a tokenizer file: {e}", args.tokenizer.display()))?;
    // A tokenizer.json may carry padding or truncation settings: a document is neither (as
    // `tokenizer(text)` in Python, which sets them per call).
    tokenizer.with_padding(None);
    tokenizer
        .with_truncation(None)
        .map_err(|e| anyhow::anyhow!("{}: cannot turn its truncation off: {e}", args.tokenizer.display()))?;
    let eod = if args.no_eod { None } else { Some(end_of_document(args, &tokenizer)?) };
    for input in &args.inputs {
        match extension(input) {
            "txt" | "jsonl" | "json" => {}
            _ => bail!("{}: expected a .txt or .jsonl file", input.display()),
        }
    }
    let (bin, idx) = autotp_train::indexed::paths(&args.output);
    for written in [&bin, &idx] {
        for input in args.inputs.iter().chain([&args.tokenizer]) {
            crate::refuse_overwrite(written, input, "an input of data prepare")?;
        }
    }
    let vocab = tokenizer.get_vocab_size(true);
    let mut writer = IndexedWriter::create(&args.output, IndexedDtype::for_vocab(vocab))?;
    let total_bytes: u64 = args.inputs.iter().filter_map(|p| std::fs::metadata(p).ok()).map(|m| m.len()).sum();
    let progress = indicatif::ProgressBar::new(total_bytes).with_style(
        indicatif::ProgressStyle::with_template("{bar:40} {bytes}/{total_bytes} {bytes_per_sec} {msg}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let pool = rayon::ThreadPoolBuilder::new().num_threads(args.workers.unwrap_or(0)).build()?;
    let started = Instant::now();
    let mut batch: Vec<String> = Vec::new();
    let mut batch_bytes = 0;
    let flush = |batch: &mut Vec<String>, writer: &mut IndexedWriter| -> Result<()> {
        let encodings = pool
            .install(|| tokenizer.encode_batch(std::mem::take(batch), true))
            .map_err(|e| anyhow::anyhow!("tokenizing: {e}"))?;
        for encoding in encodings {
            let mut ids = encoding.get_ids().to_vec();
            ids.extend(eod);
            writer.add_document(&ids)?;
        }
        let (documents, tokens) = writer.counts();
        progress.set_message(format!("{documents} documents, {tokens} tokens"));
        Ok(())
    };
    for input in &args.inputs {
        for document in documents(input, args)? {
            let (text, bytes) = document?;
            progress.inc(bytes as u64);
            batch_bytes += text.len();
            batch.push(text);
            if batch.len() == BATCH_DOCUMENTS || batch_bytes >= BATCH_BYTES {
                flush(&mut batch, &mut writer)?;
                batch_bytes = 0;
            }
        }
    }
    flush(&mut batch, &mut writer)?;
    progress.finish_and_clear();
    let (documents, tokens) = writer.finish()?;
    let seconds = started.elapsed().as_secs_f64().max(1e-9);
    println!(
        "wrote {} and {}: {documents} documents, {tokens} tokens ({} per token, vocabulary {vocab}{}) in {seconds:.2} s: \
         {:.1} MB/s of text, {:.0} tokens/s on {} threads",
        bin.display(),
        idx.display(),
        IndexedDtype::for_vocab(vocab).name(),
        eod.map_or(", no end-of-document token".to_string(), |id| format!(", end of document {id}")),
        total_bytes as f64 / seconds / 1e6,
        tokens as f64 / seconds,
        pool.current_num_threads(),
    );
    Ok(())
}

fn extension(path: &Path) -> &str {
    path.extension().and_then(|e| e.to_str()).unwrap_or("")
}

/// The end-of-document id: `--eod` (a token or an id), else config.json's `eos_token_id` beside
/// the tokenizer, else a conventional end-of-text token of the vocabulary.
fn end_of_document(args: &PrepareArgs, tokenizer: &tokenizers::Tokenizer) -> Result<u32> {
    let vocab = tokenizer.get_vocab_size(true);
    if let Some(eod) = &args.eod {
        let id = tokenizer.token_to_id(eod).or_else(|| eod.parse().ok());
        return match id {
            Some(id) if (id as usize) < vocab => Ok(id),
            _ => bail!("--eod {eod}: neither a token of {} nor an id under {vocab}", args.tokenizer.display()),
        };
    }
    let config = args.tokenizer.with_file_name("config.json");
    if let Some(id) = config_eos(&args.tokenizer)? {
        if id as usize >= vocab {
            bail!(
                "{}: eos_token_id {id} is not an id of the tokenizer (under {vocab}); name one with --eod",
                config.display()
            );
        }
        return Ok(id);
    }
    ["<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>"].iter().find_map(|t| tokenizer.token_to_id(t)).with_context(
        || {
            format!(
                "no end-of-document token: {} has no eos_token_id and the tokenizer none of <|endoftext|>, </s>, \
             <|end_of_text|>, <eos>; name one with --eod TOKEN|ID, or --no-eod",
                config.display()
            )
        },
    )
}

/// `eos_token_id` of the config.json beside `tokenizer` (a list's first), if there is one.
pub(crate) fn config_eos(tokenizer: &Path) -> Result<Option<u32>> {
    let config = tokenizer.with_file_name("config.json");
    let Ok(text) = std::fs::read_to_string(&config) else { return Ok(None) };
    let json: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("{}: not JSON", config.display()))?;
    let eos = &json["eos_token_id"];
    Ok(eos.as_u64().or_else(|| eos.as_array()?.first()?.as_u64()).map(|id| id as u32))
}

/// One document's text and the bytes of input it took.
type Document = Result<(String, usize)>;

/// The documents of one input file, in order.
fn documents<'a>(path: &'a Path, args: &'a PrepareArgs) -> Result<Box<dyn Iterator<Item = Document> + 'a>> {
    let file = std::fs::File::open(path).with_context(|| format!("cannot read {}", path.display()))?;
    let lines = std::io::BufReader::with_capacity(1 << 20, file).lines().enumerate();
    let context = move |n: usize| format!("{} line {}", path.display(), n + 1);
    match extension(path) {
        "txt" if !args.lines => {
            let text =
                std::fs::read_to_string(path).with_context(|| format!("cannot read {} as UTF-8", path.display()))?;
            let bytes = text.len();
            Ok(Box::new(std::iter::once(Ok((text, bytes)))))
        }
        "txt" => Ok(Box::new(lines.filter_map(move |(n, line)| match line.with_context(|| context(n)) {
            Ok(line) if line.trim().is_empty() => None,
            Ok(line) => {
                let bytes = line.len() + 1;
                Some(Ok((line, bytes)))
            }
            Err(e) => Some(Err(e)),
        }))),
        _ => Ok(Box::new(lines.filter_map(move |(n, line)| {
            let line = match line.with_context(|| context(n)) {
                Ok(line) if line.trim().is_empty() => return None,
                Ok(line) => line,
                Err(e) => return Some(Err(e)),
            };
            let bytes = line.len() + 1;
            let text = serde_json::from_str::<serde_json::Value>(&line)
                .with_context(|| format!("{}: not a JSON object", context(n)))
                .and_then(|object| match &object[args.json_key.as_str()] {
                    serde_json::Value::String(text) => Ok(text.clone()),
                    _ => bail!("{}: no string field '{}' (--json-key)", context(n), args.json_key),
                });
            Some(text.map(|t| (t, bytes)))
        }))),
    }
}
