//! What `--data` names: a raw token stream ([`TokenData`], the data contract's windows in
//! order), or Megatron-LM's indexed datasets ([`crate::indexed`]), one prefix or a weighted
//! blend (`"0.3 A 0.7 B"`, as Megatron's `--data-path`).
//!
//! An indexed dataset's samples are Megatron's GPT samples: the split's documents, shuffled by
//! the run's seed anew each epoch, are concatenated and cut into windows of seq + 1 tokens with
//! stride seq (consecutive samples share one token); the windows of an epoch are shuffled by the
//! seed too, and epoch follows epoch. `--split 969,30,1` gives train, validation and test
//! contiguous ranges of each dataset's documents, as Megatron does. A blend gives global sample
//! k to the dataset furthest below its share of the first k + 1 samples (Megatron's
//! `BlendedDataset`), each dataset drawing its own samples in order. Sample k is a function of
//! k, the data and the seed alone: a resumed run continues the exact order.

use std::path::{Path, PathBuf};
use std::sync::Mutex;

use crate::data::{Batch, DataError, TokenData, TokenDtype};
use crate::indexed::IndexedDataset;

/// The parts of `--split`: train, validation, test.
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct Split {
    pub weights: [f64; 3],
}

impl Split {
    /// `969,30,1` (weights, normalised; missing parts are 0).
    pub fn parse(text: &str) -> Result<Split, DataError> {
        let bad = || DataError::Spec(format!("--split '{text}': expected up to three weights, as 969,30,1"));
        let parts: Vec<f64> =
            text.split(',').map(|p| p.trim().parse::<f64>().map_err(|_| bad())).collect::<Result<_, _>>()?;
        if parts.is_empty() || parts.len() > 3 || parts.iter().any(|w| !w.is_finite() || *w < 0.0) {
            return Err(bad());
        }
        let total: f64 = parts.iter().sum();
        if total <= 0.0 {
            return Err(bad());
        }
        let mut weights = [0.0; 3];
        for (w, p) in weights.iter_mut().zip(&parts) {
            *w = p / total;
        }
        Ok(Split { weights })
    }

    /// The documents `[start, end)` of part `part` (0 train, 1 validation, 2 test) of
    /// `documents`, as Megatron rounds them.
    fn range(&self, part: usize, documents: usize) -> (usize, usize) {
        let mut bounds = [0usize; 4];
        for i in 0..3 {
            bounds[i + 1] = bounds[i] + (self.weights[i] * documents as f64).round() as usize;
        }
        let shift = bounds[3] as isize - documents as isize;
        for bound in &mut bounds[1..] {
            *bound = (*bound as isize - shift).max(0) as usize;
        }
        (bounds[part], bounds[part + 1])
    }
}

/// Training (or validation) data.
pub enum TrainingData {
    /// A raw token file: the contract's windows in order.
    Stream(TokenData),
    /// Megatron indexed datasets, blended.
    Indexed(Blend),
}

impl TrainingData {
    /// Opens `--data`: a blend (`"W1 P1 W2 P2 ..."`), a Megatron prefix (`P.idx` and `P.bin`
    /// exist), or a raw token file. `part` of `split` (0 train, 1 validation) for indexed data.
    pub fn open(
        spec: &str,
        dtype: TokenDtype,
        seq_len: usize,
        seed: u64,
        split: Option<Split>,
        part: usize,
    ) -> Result<TrainingData, DataError> {
        let words: Vec<&str> = spec.split_whitespace().collect();
        let is_prefix = |p: &str| crate::indexed::paths(Path::new(p)).1.is_file();
        if words.len() == 1 && !is_prefix(words[0]) {
            if split.is_some() {
                return Err(DataError::Spec(format!(
                    "--split divides a Megatron dataset's documents; {spec} is a raw token file"
                )));
            }
            return Ok(TrainingData::Stream(TokenData::open(Path::new(spec), dtype, seq_len)?));
        }
        let pairs: Vec<(f64, &str)> = if words.len() == 1 {
            vec![(1.0, words[0])]
        } else if words.len().is_multiple_of(2) {
            let weight = |w: &str| {
                w.parse::<f64>().ok().filter(|w| w.is_finite() && *w > 0.0).ok_or_else(|| {
                    DataError::Spec(format!(
                        "--data '{spec}': '{w}' is not a weight (a blend is \"W1 PREFIX1 W2 PREFIX2 ...\")"
                    ))
                })
            };
            words.chunks(2).map(|pair| Ok((weight(pair[0])?, pair[1]))).collect::<Result<_, DataError>>()?
        } else {
            return Err(DataError::Spec(format!(
                "--data '{spec}': a blend is pairs of a weight and a Megatron prefix (\"0.3 A 0.7 B\")"
            )));
        };
        let total: f64 = pairs.iter().map(|(w, _)| w).sum();
        let mut parts = Vec::new();
        for (seed_offset, (weight, prefix)) in pairs.into_iter().enumerate() {
            if !is_prefix(prefix) {
                return Err(DataError::Spec(format!(
                    "--data '{spec}': {prefix}.idx is not there (a blend names Megatron prefixes, PREFIX.bin + PREFIX.idx)"
                )));
            }
            let samples =
                DocumentSamples::open(Path::new(prefix), seq_len, seed.wrapping_add(seed_offset as u64), split, part)?;
            parts.push((weight / total, samples));
        }
        Ok(TrainingData::Indexed(Blend { spec: spec.to_string(), parts, assigned: Mutex::new((0, Vec::new())) }))
    }

    /// S, the tokens per sequence.
    pub fn seq_len(&self) -> usize {
        match self {
            TrainingData::Stream(data) => data.seq_len(),
            TrainingData::Indexed(blend) => blend.parts[0].1.seq_len,
        }
    }

    /// The global batch of (0-based) `step` with `global_batch` sequences.
    pub fn batch(&self, step: usize, global_batch: usize) -> Batch {
        match self {
            TrainingData::Stream(data) => data.batch(step, global_batch),
            TrainingData::Indexed(blend) => {
                let s = self.seq_len();
                let mut batch = Batch {
                    input_ids: Vec::with_capacity(global_batch * s),
                    labels: Vec::with_capacity(global_batch * s),
                };
                for j in 0..global_batch {
                    let sample = blend.sample(step * global_batch + j);
                    batch.input_ids.extend(sample[..s].iter().map(|&t| i64::from(t)));
                    batch.labels.extend(sample[1..].iter().map(|&t| i64::from(t)));
                }
                batch
            }
        }
    }

    /// What `--data` named.
    pub fn path(&self) -> PathBuf {
        match self {
            TrainingData::Stream(data) => data.path().to_path_buf(),
            TrainingData::Indexed(blend) => PathBuf::from(&blend.spec),
        }
    }

    /// The token dtype's name: `u16`/`u32` for a raw file, `megatron` for indexed data.
    pub fn dtype_name(&self) -> &'static str {
        match self {
            TrainingData::Stream(data) => data.dtype().name(),
            TrainingData::Indexed(_) => "megatron",
        }
    }

    /// Tokens read from: the file's, or the split's documents' over the blend.
    pub fn tokens(&self) -> usize {
        match self {
            TrainingData::Stream(data) => data.tokens(),
            TrainingData::Indexed(blend) => blend.parts.iter().map(|(_, p)| p.tokens).sum(),
        }
    }

    /// Samples per pass: the file's windows, or the samples of one epoch over the blend.
    pub fn windows(&self) -> usize {
        match self {
            TrainingData::Stream(data) => data.windows(),
            TrainingData::Indexed(blend) => blend.parts.iter().map(|(_, p)| p.samples).sum(),
        }
    }
}

/// Datasets with their weights (summing to 1).
pub struct Blend {
    spec: String,
    parts: Vec<(f64, DocumentSamples)>,
    /// The next global sample to assign and each dataset's samples so far: samples are asked
    /// for in order, so assigning them is amortised O(1); an earlier one restarts from 0.
    assigned: Mutex<(usize, Vec<usize>)>,
}

impl Blend {
    /// Global sample `k`: its dataset and that dataset's sample number.
    fn sample(&self, k: usize) -> Vec<u32> {
        let (part, index) = {
            let mut assigned = self.assigned.lock().unwrap_or_else(|e| e.into_inner());
            let (next, counts) = &mut *assigned;
            if *next > k || counts.is_empty() {
                *next = 0;
                *counts = vec![0; self.parts.len()];
            }
            let mut choice = (0, 0);
            while *next <= k {
                // The dataset furthest below its share of the first next + 1 samples.
                let target = |i: usize| self.parts[i].0 * (*next + 1) as f64 - counts[i] as f64;
                let i = (0..self.parts.len()).fold(0, |best, i| if target(i) > target(best) { i } else { best });
                choice = (i, counts[i]);
                counts[i] += 1;
                *next += 1;
            }
            choice
        };
        self.parts[part].1.sample(index)
    }
}

/// One indexed dataset's documents of a split, as samples of seq + 1 tokens.
struct DocumentSamples {
    dataset: IndexedDataset,
    /// The split's documents: each its range of sequences and its tokens.
    documents: Vec<(std::ops::Range<usize>, usize)>,
    seq_len: usize,
    seed: u64,
    /// Tokens of the split's documents.
    tokens: usize,
    /// Samples per epoch: (tokens - 1) / seq_len.
    samples: usize,
    epoch: Mutex<Option<Epoch>>,
}

/// One epoch's order: its documents' token offsets in the concatenation, and its samples.
struct Epoch {
    number: usize,
    /// The documents in this epoch's order, and where each starts in the concatenation.
    order: Vec<usize>,
    starts: Vec<usize>,
    permutation: Vec<usize>,
}

impl DocumentSamples {
    fn open(prefix: &Path, seq_len: usize, seed: u64, split: Option<Split>, part: usize) -> Result<Self, DataError> {
        let dataset = IndexedDataset::open(prefix)?;
        let boundaries = dataset.document_boundaries();
        let all: Vec<std::ops::Range<usize>> = boundaries
            .windows(2)
            .map(|w| w[0].max(0) as usize..(w[1].max(0) as usize).min(dataset.sequences()))
            .collect();
        let (start, end) = split.map_or((0, all.len()), |s| s.range(part, all.len()));
        let documents: Vec<(std::ops::Range<usize>, usize)> = (all[start..end].iter())
            .map(|sequences| (sequences.clone(), sequences.clone().map(|s| dataset.sequence_length(s)).sum()))
            .collect();
        let tokens: usize = documents.iter().map(|(_, length)| length).sum();
        let samples = tokens.saturating_sub(1) / seq_len.max(1);
        if samples == 0 {
            return Err(DataError::Spec(format!(
                "{}: the {} split ({} documents, {tokens} tokens) holds less than one sample of seq-len + 1 = {} tokens",
                prefix.display(),
                ["training", "validation", "test"][part],
                documents.len(),
                seq_len + 1
            )));
        }
        Ok(DocumentSamples { dataset, documents, seq_len, seed, tokens, samples, epoch: Mutex::new(None) })
    }

    /// Sample `k` (over epochs): seq + 1 tokens.
    fn sample(&self, k: usize) -> Vec<u32> {
        let (number, within) = (k / self.samples, k % self.samples);
        let mut epoch = self.epoch.lock().unwrap_or_else(|e| e.into_inner());
        if epoch.as_ref().is_none_or(|e| e.number != number) {
            *epoch = Some(self.epoch(number));
        }
        let Some(epoch) = epoch.as_ref() else { return Vec::new() };
        let (at, want) = (epoch.permutation[within] * self.seq_len, self.seq_len + 1);
        let mut tokens = Vec::with_capacity(want);
        // The document holding token `at` of the concatenation, then on to the next ones,
        // reading only the sample's tokens of each sequence.
        let d = epoch.starts.partition_point(|&s| s <= at) - 1;
        let mut offset = at - epoch.starts[d];
        for &document in &epoch.order[d..] {
            for s in self.documents[document].0.clone() {
                let length = self.dataset.sequence_length(s);
                if offset >= length {
                    offset -= length;
                    continue;
                }
                let take = (want - tokens.len()).min(length - offset);
                tokens.extend(self.dataset.tokens(s, offset..offset + take));
                offset = 0;
                if tokens.len() == want {
                    return tokens;
                }
            }
        }
        tokens
    }

    fn epoch(&self, number: usize) -> Epoch {
        let mut rng = SplitMix64::new(self.seed ^ (number as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15));
        let order = rng.permutation(self.documents.len());
        let mut starts = Vec::with_capacity(order.len());
        let mut at = 0;
        for &d in &order {
            starts.push(at);
            at += self.documents[d].1;
        }
        let permutation = rng.permutation(self.samples);
        Epoch { number, order, starts, permutation }
    }
}

/// SplitMix64: a small, fixed generator, so that an order or a draw does not change with a
/// crate (the samples here, `autotp generate`'s sampling).
pub struct SplitMix64(u64);

impl SplitMix64 {
    pub fn new(seed: u64) -> SplitMix64 {
        SplitMix64(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1), from the top 53 bits.
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// A Fisher-Yates permutation of 0..n.
    pub fn permutation(&mut self, n: usize) -> Vec<usize> {
        let mut order: Vec<usize> = (0..n).collect();
        for i in (1..n).rev() {
            order.swap(i, (self.next_u64() % (i as u64 + 1)) as usize);
        }
        order
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::indexed::{IndexedDtype, IndexedWriter};

    /// Documents of distinct tokens: document d holds d*100 + 0..len.
    fn dataset(dir: &tempfile::TempDir, name: &str, lengths: &[u32]) -> Result<PathBuf, DataError> {
        let prefix = dir.path().join(name);
        let mut writer = IndexedWriter::create(&prefix, IndexedDtype::U16)?;
        for (d, &len) in lengths.iter().enumerate() {
            writer.add_document(&(0..len).map(|t| d as u32 * 100 + t).collect::<Vec<_>>())?;
        }
        writer.finish()?;
        Ok(prefix)
    }

    #[test]
    fn samples_cover_each_epoch_once_and_follow_the_seed() -> Result<(), DataError> {
        let dir = tempfile::tempdir().unwrap();
        let prefix = dataset(&dir, "epochs", &[7, 3, 12, 5])?;
        let spec = prefix.display().to_string();
        let data = TrainingData::open(&spec, TokenDtype::U16, 4, 1, None, 0)?;
        // 27 tokens: (27 - 1) / 4 = 6 samples of 5 tokens per epoch.
        assert_eq!((data.tokens(), data.windows()), (27, 6));
        let TrainingData::Indexed(blend) = &data else { panic!("a prefix is indexed data") };
        for epoch in 0..2 {
            let samples: Vec<Vec<u32>> = (0..6).map(|i| blend.sample(epoch * 6 + i)).collect();
            assert!(samples.iter().all(|s| s.len() == 5));
            // Each epoch's samples tile its concatenation: every sample's last token is the
            // first of another, save one, and together they hold every token but the last.
            let mut firsts: Vec<u32> = samples.iter().map(|s| s[0]).collect();
            firsts.sort();
            firsts.dedup();
            assert_eq!(firsts.len(), 6);
            let tokens: std::collections::BTreeSet<u32> = samples.iter().flatten().copied().collect();
            assert!(tokens.len() >= 25, "{samples:?}");
        }
        // The same seed, the same samples, in any order of asking; another seed, others.
        let again = TrainingData::open(&spec, TokenDtype::U16, 4, 1, None, 0)?;
        let other = TrainingData::open(&spec, TokenDtype::U16, 4, 2, None, 0)?;
        assert_eq!(data.batch(3, 2), again.batch(3, 2));
        assert_eq!(data.batch(0, 2), again.batch(0, 2));
        assert_ne!(
            (0..6).map(|s| data.batch(s, 2)).collect::<Vec<_>>(),
            (0..6).map(|s| other.batch(s, 2)).collect::<Vec<_>>()
        );
        let batch = data.batch(1, 2);
        assert_eq!(batch.input_ids[1..4], batch.labels[..3]);
        Ok(())
    }

    #[test]
    fn splits_and_blends_follow_megatron() -> Result<(), DataError> {
        let split = Split::parse("969,30,1")?;
        assert_eq!(
            (split.range(0, 1000), split.range(1, 1000), split.range(2, 1000)),
            ((0, 969), (969, 999), (999, 1000))
        );
        assert_eq!(Split::parse("8,2")?.range(1, 10), (8, 10));
        assert!(Split::parse("a,b").is_err() && Split::parse("0,0").is_err());
        let dir = tempfile::tempdir().unwrap();
        let a = dataset(&dir, "blend-a", &[40; 10])?;
        let b = dataset(&dir, "blend-b", &[40; 10])?;
        let spec = format!("0.25 {} 0.75 {}", a.display(), b.display());
        let data = TrainingData::open(&spec, TokenDtype::U16, 8, 0, None, 0)?;
        let TrainingData::Indexed(blend) = &data else { panic!("a blend is indexed data") };
        let samples: Vec<Vec<u32>> = (0..400).map(|k| blend.sample(k)).collect();
        assert!(samples.iter().all(|s| s.len() == 9));
        let counts = blend.assigned.lock().map(|g| g.1.clone()).unwrap_or_default();
        assert_eq!(counts, vec![100, 300]);
        // Asking again from the start gives the same samples.
        assert_eq!(blend.sample(0), samples[0]);
        // The validation split of 80,20 is the last 2 documents: 79 tokens, 9 samples of 9.
        let valid =
            TrainingData::open(&a.display().to_string(), TokenDtype::U16, 8, 0, Some(Split::parse("80,20")?), 1)?;
        assert_eq!((valid.tokens(), valid.windows()), (80, 9));
        let err = |spec: &str| TrainingData::open(spec, TokenDtype::U16, 8, 0, None, 0).err().map(|e| e.to_string());
        assert!(err("0.5 nowhere").unwrap_or_default().contains("nowhere.idx is not there"));
        assert!(err("0.5 a b").unwrap_or_default().contains("a blend is pairs of a weight and a Megatron prefix"));
        assert!(err("x a y b").unwrap_or_default().contains("'x' is not a weight"));
        Ok(())
    }
}
