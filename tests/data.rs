//! `autotp data prepare`: text to Megatron-LM's indexed dataset, against the ids the
//! `tokenizers` Python package gives the same documents and the files Megatron's own builder
//! writes for them (tests/fixtures/hf_export/corpus_ids.json and corpus_megatron.{bin,idx},
//! from make_hf_export_fixture.py), its errors, and training on its datasets.

use autotp_train::indexed::{paths, IndexedDataset, IndexedDtype};

use crate::common::{autotp, failure, fixture, scratch, success, train_hf_export};

fn prepare(inputs: &[&std::path::Path], extra: &[&str], prefix: &std::path::Path) -> std::process::Output {
    let tokenizer = fixture("hf_export", "tokenizer.json");
    let mut args: Vec<String> = vec!["data".into(), "prepare".into()];
    args.extend(inputs.iter().map(|p| p.display().to_string()));
    args.extend(["--tokenizer".into(), tokenizer.display().to_string(), "-o".into(), prefix.display().to_string()]);
    args.extend(extra.iter().map(|a| a.to_string()));
    autotp(&args)
}

#[test]
fn text_and_json_lines_become_megatrons_indexed_dataset() {
    let dir = scratch("data-prepare");
    let want: Vec<Vec<u32>> =
        serde_json::from_str(&std::fs::read_to_string(fixture("hf_export", "corpus_ids.json")).unwrap_or_default())
            .unwrap_or_default();
    assert_eq!(want.len(), 40);
    let (txt, jsonl) = (fixture("hf_export", "corpus.txt"), fixture("hf_export", "corpus.jsonl"));
    let (from_text, from_json) = (dir.join("text"), dir.join("json"));
    // The end-of-document id 1 comes from the config.json beside the tokenizer.
    let out = success(prepare(&[&txt], &["--lines", "--workers", "2"], &from_text));
    let tokens: usize = want.iter().map(Vec::len).sum();
    let summary = format!("40 documents, {tokens} tokens (uint16 per token, vocabulary 1000, end of document 1)");
    assert!(out.contains(&summary), "{out}");
    success(prepare(&[&jsonl], &[], &from_json));
    for prefix in [&from_text, &from_json] {
        let dataset = IndexedDataset::open(prefix).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!((dataset.sequences(), dataset.dtype()), (40, IndexedDtype::U16));
        assert_eq!(dataset.document_boundaries(), (0..=40).collect::<Vec<i64>>());
        let got: Vec<Vec<u32>> = (0..40).map(|i| dataset.sequence(i)).collect();
        assert_eq!(got, want);
    }
    // Byte for byte what Megatron's own IndexedDatasetBuilder writes for those ids.
    let (bin, idx) = paths(&from_text);
    let megatron = paths(&fixture("hf_export", "corpus_megatron"));
    for (ours, theirs) in [(&bin, &megatron.0), (&idx, &megatron.1), (&paths(&from_json).0, &megatron.0)] {
        assert!(
            std::fs::read(ours).ok() == std::fs::read(theirs).ok(),
            "{} differs from {}",
            ours.display(),
            theirs.display()
        );
    }

    // Two inputs in order; another end of document; none.
    let both = dir.join("both");
    success(prepare(&[&txt, &jsonl], &["--lines", "--eod", "<unk>"], &both));
    let dataset = IndexedDataset::open(&both).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(dataset.sequences(), 80);
    let last = dataset.sequence(79);
    assert_eq!(last[..last.len() - 1], want[39][..want[39].len() - 1]);
    assert_eq!(last.last(), Some(&2));
    let bare = dir.join("bare");
    success(prepare(&[&jsonl], &["--no-eod"], &bare));
    assert_eq!(IndexedDataset::open(&bare).map(|d| d.sequence(0).len()).ok(), Some(want[0].len() - 1));
}

#[test]
fn bad_data_inputs_are_named() {
    let dir = scratch("data-prepare-errors");
    let prefix = dir.join("out");
    let bad_json = dir.join("bad.jsonl");
    std::fs::write(&bad_json, "{\"text\": \"fine\"}\n{\"body\": \"no text\"}\n").unwrap_or_default();
    let err = failure(prepare(&[&bad_json], &[], &prefix));
    assert!(err.contains("bad.jsonl line 2: no string field 'text' (--json-key)"), "{err}");
    std::fs::write(&bad_json, "not json\n").unwrap_or_default();
    let err = failure(prepare(&[&bad_json], &[], &prefix));
    assert!(err.contains("bad.jsonl line 1: not a JSON object"), "{err}");
    let csv = dir.join("data.csv");
    std::fs::write(&csv, "a,b\n").unwrap_or_default();
    let err = failure(prepare(&[&csv], &[], &prefix));
    assert!(err.contains("data.csv: expected a .txt or .jsonl file"), "{err}");
    let err = failure(prepare(&[&fixture("hf_export", "corpus.txt")], &["--eod", "<nothing>"], &prefix));
    assert!(err.contains("--eod <nothing>: neither a token of") && err.contains("nor an id under 1000"), "{err}");
    let left: Vec<_> = std::fs::read_dir(&dir).into_iter().flatten().flatten().map(|e| e.file_name()).collect();
    assert_eq!(left.len(), 2, "nothing written on failure: {left:?}");
}

/// `autotp train` on a Megatron prefix and on a blend: samples shuffled by the seed; a run
/// resumed midway continues the exact sample order (bit-identical losses); another seed reads
/// other samples; the loss falls.
#[test]
fn training_reads_megatron_datasets_and_resumes_their_order() {
    let dir = scratch("data-train");
    let (prefix, other) = (dir.join("corpus"), dir.join("other"));
    success(prepare(&[&fixture("hf_export", "corpus.jsonl")], &[], &prefix));
    success(prepare(&[&fixture("hf_export", "corpus.txt")], &["--lines", "--eod", "<unk>"], &other));
    let train = |data: &str, extra: &[&str], name: &str| {
        let metrics = dir.join(format!("{name}.jsonl"));
        let args = [
            "--micro-batch",
            "2",
            "--lr",
            "2e-3",
            "--data",
            data,
            "--metrics-out",
            metrics.to_str().unwrap_or_default(),
        ];
        success(train_hf_export(&[&args[..], extra].concat()));
        crate::common::losses(&metrics).into_iter().map(|(_, loss)| loss).collect::<Vec<f64>>()
    };
    let corpus = prefix.display().to_string();
    let ckpt = dir.join("ckpt");
    let straight = train(&corpus, &["--steps", "8"], "straight");
    let first = train(&corpus, &["--steps", "4", "--save", ckpt.to_str().unwrap_or_default()], "first");
    let rest = train(&corpus, &["--steps", "8", "--resume", ckpt.to_str().unwrap_or_default()], "rest");
    assert_eq!([first, rest].concat(), straight, "a resumed run reads the same samples");
    assert!(straight[7] < straight[0], "{straight:?}");
    let reseeded = train(&corpus, &["--steps", "8", "--seed", "7"], "reseeded");
    assert_ne!(reseeded, straight);
    let blend = format!("0.3 {} 0.7 {}", prefix.display(), other.display());
    let blended = train(&blend, &["--steps", "4", "--split", "90,10"], "blend");
    assert_eq!(blended.len(), 4);
    let tokens = fixture("train", "tokens.bin").display().to_string();
    let err =
        failure(train_hf_export(&["--micro-batch", "2", "--steps", "1", "--data", &tokens, "--split", "969,30,1"]));
    assert!(err.contains("--split divides a Megatron dataset's documents"), "{err}");
}
