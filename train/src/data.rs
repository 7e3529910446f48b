//! Training data, as the contract in DESIGN.md defines it: a little-endian token stream (u16 by
//! default, `--data-dtype u32`), memory-mapped; windows of S+1 tokens with stride S; W =
//! (N - 1) div S windows; global step s (0-based) uses windows (s*G + j) mod W for j < G, where
//! G is the global batch; input_ids = window[0..S], labels = window[1..S+1].

use std::path::{Path, PathBuf};

/// The element type of a token file.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum TokenDtype {
    U16,
    U32,
}

impl TokenDtype {
    pub fn size(self) -> usize {
        match self {
            TokenDtype::U16 => 2,
            TokenDtype::U32 => 4,
        }
    }

    /// The spelling of `--data-dtype`.
    pub fn name(self) -> &'static str {
        match self {
            TokenDtype::U16 => "u16",
            TokenDtype::U32 => "u32",
        }
    }

    pub fn parse(name: &str) -> Result<TokenDtype, DataError> {
        match name {
            "u16" => Ok(TokenDtype::U16),
            "u32" => Ok(TokenDtype::U32),
            other => Err(DataError::UnknownDtype(other.to_string())),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum DataError {
    #[error("cannot read {path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{0} is a directory, not a file of tokens")]
    Directory(PathBuf),
    #[error("unknown token dtype '{0}' (expected u16 or u32)")]
    UnknownDtype(String),
    #[error(
        "{path} is {bytes} bytes, not a whole number of {dtype} tokens ({size} bytes each): is --data-dtype right?"
    )]
    Misaligned { path: PathBuf, bytes: usize, dtype: &'static str, size: usize },
    #[error("{path} holds {tokens} tokens, fewer than one window of seq-len + 1 = {window}")]
    TooShort { path: PathBuf, tokens: usize, window: usize },
    /// A `--data` or `--split` that does not say what it must.
    #[error("{0}")]
    Spec(String),
    /// A Megatron indexed dataset ([`crate::indexed`]) that cannot be written or read.
    #[error("{path} {message}")]
    Indexed { path: PathBuf, message: String },
}

/// A memory-mapped token stream.
pub struct TokenData {
    path: PathBuf,
    map: memmap2::Mmap,
    dtype: TokenDtype,
    seq_len: usize,
    windows: usize,
}

/// One global batch: `G x S` input ids and labels, row-major.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Batch {
    pub input_ids: Vec<i64>,
    pub labels: Vec<i64>,
}

impl TokenData {
    pub fn open(path: &Path, dtype: TokenDtype, seq_len: usize) -> Result<TokenData, DataError> {
        let io = |source| DataError::Io { path: path.to_path_buf(), source };
        let file = std::fs::File::open(path).map_err(io)?;
        if file.metadata().map_err(io)?.is_dir() {
            return Err(DataError::Directory(path.to_path_buf()));
        }
        // SAFETY: read-only map of a data file that must not change during training.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io)?;
        if map.len() % dtype.size() != 0 {
            let (dtype, size) = (dtype.name(), dtype.size());
            return Err(DataError::Misaligned { path: path.to_path_buf(), bytes: map.len(), dtype, size });
        }
        let tokens = map.len() / dtype.size();
        let windows = tokens.saturating_sub(1) / seq_len.max(1);
        if windows == 0 {
            return Err(DataError::TooShort { path: path.to_path_buf(), tokens, window: seq_len + 1 });
        }
        Ok(TokenData { path: path.to_path_buf(), map, dtype, seq_len, windows })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn dtype(&self) -> TokenDtype {
        self.dtype
    }

    /// S, the tokens per sequence the windows were cut for.
    pub fn seq_len(&self) -> usize {
        self.seq_len
    }

    pub fn tokens(&self) -> usize {
        self.map.len() / self.dtype.size()
    }

    /// W, the number of windows.
    pub fn windows(&self) -> usize {
        self.windows
    }

    fn token(&self, i: usize) -> i64 {
        let b = &self.map[i * self.dtype.size()..];
        match self.dtype {
            TokenDtype::U16 => u16::from_le_bytes([b[0], b[1]]) as i64,
            TokenDtype::U32 => u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as i64,
        }
    }

    /// The global batch of (0-based) `step` with `global_batch` sequences.
    pub fn batch(&self, step: usize, global_batch: usize) -> Batch {
        let s = self.seq_len;
        let mut batch =
            Batch { input_ids: Vec::with_capacity(global_batch * s), labels: Vec::with_capacity(global_batch * s) };
        for j in 0..global_batch {
            let window = (step * global_batch + j) % self.windows;
            let start = window * s;
            batch.input_ids.extend((start..start + s).map(|i| self.token(i)));
            batch.labels.extend((start + 1..start + s + 1).map(|i| self.token(i)));
        }
        batch
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A token file of `bytes`, removed when dropped.
    fn write(bytes: &[u8]) -> tempfile::NamedTempFile {
        let mut file = tempfile::NamedTempFile::new().unwrap();
        std::io::Write::write_all(&mut file, bytes).unwrap();
        file
    }

    #[test]
    fn windows_follow_the_contract() {
        // 11 tokens 0..=10, S = 3: W = (11 - 1) / 3 = 3 windows starting at 0, 3, 6.
        let bytes: Vec<u8> = (0u16..11).flat_map(|t| t.to_le_bytes()).collect();
        let file = write(&bytes);
        let data = TokenData::open(file.path(), TokenDtype::U16, 3).unwrap();
        assert_eq!((data.tokens(), data.windows()), (11, 3));
        let b0 = data.batch(0, 2);
        assert_eq!(b0.input_ids, vec![0, 1, 2, 3, 4, 5]);
        assert_eq!(b0.labels, vec![1, 2, 3, 4, 5, 6]);
        // Step 1 uses windows 2 and (3 mod 3) = 0.
        let b1 = data.batch(1, 2);
        assert_eq!(b1.input_ids, vec![6, 7, 8, 0, 1, 2]);
        assert_eq!(b1.labels, vec![7, 8, 9, 1, 2, 3]);
    }

    #[test]
    fn u32_tokens() {
        let bytes: Vec<u8> = [70000u32, 1, 2, 3].iter().flat_map(|t| t.to_le_bytes()).collect();
        let file = write(&bytes);
        let data = TokenData::open(file.path(), TokenDtype::U32, 3).unwrap();
        assert_eq!(data.batch(0, 1).input_ids, vec![70000, 1, 2]);
    }

    #[test]
    fn clear_errors() {
        let short: Vec<u8> = (0u16..4).flat_map(|t| t.to_le_bytes()).collect();
        let err = TokenData::open(write(&short).path(), TokenDtype::U16, 4).err().unwrap().to_string();
        assert!(err.contains("holds 4 tokens, fewer than one window of seq-len + 1 = 5"), "{err}");
        let odd = [0u8; 6];
        let err = TokenData::open(write(&odd).path(), TokenDtype::U32, 1).err().unwrap().to_string();
        assert!(
            err.contains("is 6 bytes, not a whole number of u32 tokens (4 bytes each): is --data-dtype right?"),
            "{err}"
        );
        assert!(TokenDtype::parse("u8").unwrap_err().to_string().contains("unknown token dtype 'u8'"));
        let err = TokenData::open(Path::new("/nonexistent/tokens.bin"), TokenDtype::U16, 4).err().unwrap().to_string();
        assert!(err.contains("cannot read /nonexistent/tokens.bin"), "{err}");
    }
}
