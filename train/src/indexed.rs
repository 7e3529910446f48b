//! Megatron-LM's indexed dataset (`megatron/core/datasets/indexed_dataset.py`, the
//! `MMapIndexedDataset` layout), written by `autotp data prepare` and read by Megatron's own
//! reader:
//! - `PREFIX.bin`: every sequence's tokens back to back, little-endian, of the index's dtype;
//! - `PREFIX.idx`: the header `MMIDIDX\0\0`, version u64 = 1, the dtype's code u8 (8 uint16,
//!   4 int32, ...), the sequence count u64 and the document-boundary count u64 (documents + 1),
//!   then each sequence's length (i32), each sequence's byte offset in `.bin` (i64), and the
//!   document boundaries (i64 indices of sequences: 0, then each document's end).
//!
//! autotp writes one sequence per document (Megatron's `preprocess_data.py` without sentence
//! splitting), uint16 tokens under a vocabulary of 65,500 and int32 above, as Megatron picks.
//! Both files are written under temporary names and renamed into place, `.idx` last.

use std::io::Write;
use std::path::{Path, PathBuf};

use autotp_program::tensor_file::{persist, temporary_path};

use crate::data::DataError;

const MAGIC: &[u8; 9] = b"MMIDIDX\x00\x00";
const VERSION: u64 = 1;
/// The largest vocabulary Megatron stores as uint16 (`preprocess_data.py`'s threshold).
pub const UINT16_VOCAB: usize = 65_500;

/// A token dtype of the index.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum IndexedDtype {
    U16,
    I32,
}

impl IndexedDtype {
    /// What Megatron picks for a vocabulary of `vocab` tokens.
    pub fn for_vocab(vocab: usize) -> IndexedDtype {
        if vocab < UINT16_VOCAB {
            IndexedDtype::U16
        } else {
            IndexedDtype::I32
        }
    }

    /// Megatron's `DType` code.
    fn code(self) -> u8 {
        match self {
            IndexedDtype::U16 => 8,
            IndexedDtype::I32 => 4,
        }
    }

    fn from_code(code: u8) -> Option<IndexedDtype> {
        match code {
            8 => Some(IndexedDtype::U16),
            4 => Some(IndexedDtype::I32),
            _ => None,
        }
    }

    /// Megatron's (numpy's) name of the dtype.
    pub fn name(self) -> &'static str {
        match self {
            IndexedDtype::U16 => "uint16",
            IndexedDtype::I32 => "int32",
        }
    }

    pub fn size(self) -> usize {
        match self {
            IndexedDtype::U16 => 2,
            IndexedDtype::I32 => 4,
        }
    }

    fn max(self) -> u32 {
        match self {
            IndexedDtype::U16 => u16::MAX as u32,
            IndexedDtype::I32 => i32::MAX as u32,
        }
    }
}

/// `PREFIX.bin` and `PREFIX.idx`.
pub fn paths(prefix: &Path) -> (PathBuf, PathBuf) {
    let with = |extension: &str| {
        let mut name = prefix.as_os_str().to_owned();
        name.push(extension);
        PathBuf::from(name)
    };
    (with(".bin"), with(".idx"))
}

fn invalid(path: &Path, message: String) -> DataError {
    DataError::Indexed { path: path.to_path_buf(), message }
}

fn io(path: &Path) -> impl Fn(std::io::Error) -> DataError + '_ {
    move |source| DataError::Io { path: path.to_path_buf(), source }
}

/// Writes an indexed dataset one document at a time; dropped before [`IndexedWriter::finish`]
/// (an input that fails midway), it removes what it wrote.
pub struct IndexedWriter {
    prefix: PathBuf,
    dtype: IndexedDtype,
    /// `None` once finished.
    bin: Option<std::io::BufWriter<std::fs::File>>,
    bin_staging: PathBuf,
    lengths: Vec<i32>,
    tokens: u64,
}

impl IndexedWriter {
    pub fn create(prefix: &Path, dtype: IndexedDtype) -> Result<IndexedWriter, DataError> {
        let (bin, _) = paths(prefix);
        let bin_staging = temporary_path(&bin);
        let file = std::fs::File::create(&bin_staging).map_err(io(&bin))?;
        Ok(IndexedWriter {
            prefix: prefix.to_path_buf(),
            dtype,
            bin: Some(std::io::BufWriter::with_capacity(1 << 20, file)),
            bin_staging,
            lengths: Vec::new(),
            tokens: 0,
        })
    }

    /// Appends one document (one sequence) of token ids.
    pub fn add_document(&mut self, tokens: &[u32]) -> Result<(), DataError> {
        let (bin, _) = paths(&self.prefix);
        if let Some(&too_large) = tokens.iter().find(|&&t| t > self.dtype.max()) {
            return Err(invalid(
                &bin,
                format!("would hold token id {too_large}, past its {} tokens", self.dtype.name()),
            ));
        }
        let length = i32::try_from(tokens.len())
            .map_err(|_| invalid(&bin, format!("a document of {} tokens is longer than i32", tokens.len())))?;
        let mut bytes = Vec::with_capacity(tokens.len() * self.dtype.size());
        for &t in tokens {
            match self.dtype {
                IndexedDtype::U16 => bytes.extend_from_slice(&(t as u16).to_le_bytes()),
                IndexedDtype::I32 => bytes.extend_from_slice(&(t as i32).to_le_bytes()),
            }
        }
        let writer = self.bin.as_mut().ok_or_else(|| invalid(&bin, "is already finished".into()))?;
        writer.write_all(&bytes).map_err(io(&bin))?;
        self.lengths.push(length);
        self.tokens += tokens.len() as u64;
        Ok(())
    }

    /// The documents and tokens written so far.
    pub fn counts(&self) -> (usize, u64) {
        (self.lengths.len(), self.tokens)
    }

    /// Writes the index and puts both files in place.
    pub fn finish(mut self) -> Result<(usize, u64), DataError> {
        let (bin, idx) = paths(&self.prefix);
        let writer = self.bin.take().ok_or_else(|| invalid(&bin, "is already finished".into()))?;
        writer.into_inner().map_err(|e| io(&bin)(e.into_error()))?;
        let mut index = Vec::with_capacity(34 + self.lengths.len() * 20 + 8);
        index.extend_from_slice(MAGIC);
        index.extend_from_slice(&VERSION.to_le_bytes());
        index.push(self.dtype.code());
        let sequences = self.lengths.len() as u64;
        index.extend_from_slice(&sequences.to_le_bytes());
        index.extend_from_slice(&(sequences + 1).to_le_bytes());
        for length in &self.lengths {
            index.extend_from_slice(&length.to_le_bytes());
        }
        let mut pointer = 0i64;
        for &length in &self.lengths {
            index.extend_from_slice(&pointer.to_le_bytes());
            pointer += i64::from(length) * self.dtype.size() as i64;
        }
        for boundary in 0..=sequences as i64 {
            index.extend_from_slice(&boundary.to_le_bytes());
        }
        let idx_staging = temporary_path(&idx);
        std::fs::write(&idx_staging, &index).map_err(io(&idx))?;
        let placed = |staging: &Path, path: &Path| persist(staging, path).map_err(|e| invalid(path, e.to_string()));
        placed(&self.bin_staging, &bin)?;
        placed(&idx_staging, &idx)?;
        Ok((self.lengths.len(), self.tokens))
    }
}

impl Drop for IndexedWriter {
    fn drop(&mut self) {
        if self.bin.take().is_some() {
            let _ = std::fs::remove_file(&self.bin_staging);
        }
    }
}

/// A memory-mapped indexed dataset.
pub struct IndexedDataset {
    bin: memmap2::Mmap,
    dtype: IndexedDtype,
    lengths: Vec<i32>,
    pointers: Vec<i64>,
    documents: Vec<i64>,
}

impl IndexedDataset {
    pub fn open(prefix: &Path) -> Result<IndexedDataset, DataError> {
        let (bin_path, idx_path) = paths(prefix);
        let index = std::fs::read(&idx_path).map_err(io(&idx_path))?;
        let bad = |message: &str| invalid(&idx_path, message.to_string());
        let mut at = 0usize;
        let mut take = |n: usize| -> Result<&[u8], DataError> {
            let end = at.checked_add(n).ok_or_else(|| bad("ends inside its index"))?;
            let bytes = index.get(at..end).ok_or_else(|| bad("ends inside its index"))?;
            at += n;
            Ok(bytes)
        };
        if take(9)? != MAGIC {
            return Err(bad("is not a Megatron indexed dataset (no MMIDIDX header)"));
        }
        let u64_at = |b: &[u8]| u64::from_le_bytes(b.try_into().unwrap_or_default());
        let version = u64_at(take(8)?);
        if version != VERSION {
            return Err(invalid(&idx_path, format!("has version {version}; autotp reads version {VERSION}")));
        }
        let code = take(1)?[0];
        let dtype = IndexedDtype::from_code(code).ok_or_else(|| {
            invalid(&idx_path, format!("has token dtype code {code}; autotp reads 8 (uint16) and 4 (int32)"))
        })?;
        let sequences = usize::try_from(u64_at(take(8)?)).map_err(|_| bad("has too many sequences"))?;
        let boundaries = usize::try_from(u64_at(take(8)?)).map_err(|_| bad("has too many documents"))?;
        let lengths: Vec<i32> = take(sequences.saturating_mul(4))?
            .chunks_exact(4)
            .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        let i64s = |bytes: &[u8]| -> Vec<i64> {
            bytes.chunks_exact(8).map(|b| i64::from_le_bytes(b.try_into().unwrap_or_default())).collect()
        };
        let pointers = i64s(take(sequences.saturating_mul(8))?);
        let documents = i64s(take(boundaries.saturating_mul(8))?);
        let file = std::fs::File::open(&bin_path).map_err(io(&bin_path))?;
        // SAFETY: read-only map of a data file that must not change while it is read.
        let bin = unsafe { memmap2::Mmap::map(&file) }.map_err(io(&bin_path))?;
        for (i, (&length, &pointer)) in lengths.iter().zip(&pointers).enumerate() {
            let end =
                usize::try_from(pointer).ok().zip(usize::try_from(length).ok()).map(|(p, l)| p + l * dtype.size());
            if end.is_none_or(|end| end > bin.len()) {
                return Err(invalid(&bin_path, format!("is shorter than sequence {i} of its index says")));
            }
        }
        Ok(IndexedDataset { bin, dtype, lengths, pointers, documents })
    }

    pub fn dtype(&self) -> IndexedDtype {
        self.dtype
    }

    pub fn sequences(&self) -> usize {
        self.lengths.len()
    }

    /// The document boundaries: indices of sequences, from 0 to the sequence count.
    pub fn document_boundaries(&self) -> &[i64] {
        &self.documents
    }

    /// The length of sequence `i` in tokens.
    pub fn sequence_length(&self, i: usize) -> usize {
        self.lengths[i].max(0) as usize
    }

    /// The tokens of sequence `i`.
    pub fn sequence(&self, i: usize) -> Vec<u32> {
        self.tokens(i, 0..self.sequence_length(i))
    }

    /// Tokens `range` of sequence `i`.
    pub fn tokens(&self, i: usize, range: std::ops::Range<usize>) -> Vec<u32> {
        let size = self.dtype.size();
        let start = self.pointers[i] as usize + range.start * size;
        let bytes = &self.bin[start..start + range.len() * size];
        match self.dtype {
            IndexedDtype::U16 => bytes.chunks_exact(2).map(|b| u32::from(u16::from_le_bytes([b[0], b[1]]))).collect(),
            IndexedDtype::I32 => {
                bytes.chunks_exact(4).map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]) as u32).collect()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn documents_round_trip_in_megatrons_layout() -> Result<(), DataError> {
        let dir = tempfile::tempdir().unwrap();
        let prefix = dir.path().join("indexed");
        let mut writer = IndexedWriter::create(&prefix, IndexedDtype::U16)?;
        writer.add_document(&[5, 6, 7])?;
        writer.add_document(&[])?;
        writer.add_document(&[65535])?;
        assert!(writer.add_document(&[65536]).is_err());
        assert_eq!(writer.finish()?, (3, 4));
        let (bin, idx) = paths(&prefix);
        assert_eq!(std::fs::read(&bin).map_err(io(&bin))?, [5, 0, 6, 0, 7, 0, 255, 255]);
        let index = std::fs::read(&idx).map_err(io(&idx))?;
        let mut want = b"MMIDIDX\x00\x00".to_vec();
        want.extend(1u64.to_le_bytes());
        want.push(8);
        want.extend(3u64.to_le_bytes().into_iter().chain(4u64.to_le_bytes()));
        want.extend([3i32, 0, 1].iter().flat_map(|l| l.to_le_bytes()));
        want.extend([0i64, 6, 6].iter().flat_map(|p| p.to_le_bytes()));
        want.extend([0i64, 1, 2, 3].iter().flat_map(|d| d.to_le_bytes()));
        assert_eq!(index, want);
        let read = IndexedDataset::open(&prefix)?;
        assert_eq!((read.sequences(), read.dtype()), (3, IndexedDtype::U16));
        assert_eq!((read.sequence(0), read.sequence(1), read.sequence(2)), (vec![5, 6, 7], vec![], vec![65535]));
        assert_eq!(read.document_boundaries(), [0, 1, 2, 3]);
        std::fs::write(&idx, &index[..40]).map_err(io(&idx))?;
        let err = IndexedDataset::open(&prefix).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err.contains("ends inside its index"), "{err}");
        Ok(())
    }
}
