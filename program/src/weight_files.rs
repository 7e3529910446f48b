//! Initial weights a plan names where they already are instead of copying them: in the model
//! file's raw data or its external-data file (a Hugging Face model exported by
//! scripts/export_hf.py keeps them there). The `.atp` header's `autotp.weight_files` records
//! each file (absolute path, size in bytes, CRC-32C of its bytes) and each parameter's file and
//! offset; loading a plan maps the files, checks their size and checksum, and reads every
//! parameter at its offset. A file that is missing, changed or shorter than a parameter needs
//! is refused, naming it: the plan would otherwise train from other weights than it was
//! compiled from. Checking reads each file once per load at checksum speed (CRC-32C runs at
//! memory bandwidth); the ranks then read their blocks from the page cache.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::ProgramError;

/// Where a parameter's initial weights are: `offset` into `file` (absolute).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WeightReference {
    pub file: PathBuf,
    pub offset: u64,
}

/// The header's record of the files a plan reads its weights from.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct WeightFiles {
    pub files: Vec<WeightFile>,
    /// Parameter name -> (index into `files`, offset).
    pub tensors: BTreeMap<String, (usize, u64)>,
}

/// A weights file as the plan was compiled against it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WeightFile {
    pub path: PathBuf,
    pub bytes: u64,
    /// CRC-32C of the whole file, hex.
    pub crc32c: String,
}

impl WeightFiles {
    /// Records `references` (parameter name -> where), measuring each file once.
    pub fn record(references: &BTreeMap<String, WeightReference>) -> Result<WeightFiles, ProgramError> {
        let mut recorded = WeightFiles::default();
        for (name, reference) in references {
            let index = match recorded.files.iter().position(|f| f.path == reference.file) {
                Some(index) => index,
                None => {
                    let map = map(&reference.file)?;
                    let crc32c = format!("{:08x}", crc32c::crc32c(&map));
                    recorded.files.push(WeightFile { path: reference.file.clone(), bytes: map.len() as u64, crc32c });
                    recorded.files.len() - 1
                }
            };
            recorded.tensors.insert(name.clone(), (index, reference.offset));
        }
        Ok(recorded)
    }

    /// Maps every file, checking it is the one the plan was compiled against.
    pub fn open(&self) -> Result<Vec<memmap2::Mmap>, ProgramError> {
        let mut maps = Vec::with_capacity(self.files.len());
        for file in &self.files {
            let changed = |what: String| ProgramError::File {
                path: file.path.clone(),
                message: format!(
                    "{what} since the plan was compiled from it: compile the plan again (or compile with \
                         --embed-weights for a plan that carries its weights)"
                ),
            };
            let map = map(&file.path)?;
            if map.len() as u64 != file.bytes {
                return Err(changed(format!("holds {} bytes, not {}: it changed", map.len(), file.bytes)));
            }
            if format!("{:08x}", crc32c::crc32c(&map)) != file.crc32c {
                return Err(changed("has other bytes (its CRC-32C differs): it changed".into()));
            }
            maps.push(map);
        }
        Ok(maps)
    }
}

/// A read-only map of `path`, its error naming the file.
fn map(path: &Path) -> Result<memmap2::Mmap, ProgramError> {
    let error = |e: std::io::Error| ProgramError::File {
        path: path.to_path_buf(),
        message: format!("cannot read this weights file the plan names: {e}"),
    };
    let file = std::fs::File::open(path).map_err(error)?;
    // SAFETY: read-only map; the checksum verified at load stands for the bytes read after it as
    // long as nobody rewrites the model in place while a run reads it.
    unsafe { memmap2::Mmap::map(&file) }.map_err(error)
}
