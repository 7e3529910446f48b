//! Safetensors files: the one on-disk tensor format of autotp (`.atp` plans, checkpoints,
//! exported weights). Reading memory-maps the file and validates its header with the
//! `safetensors` crate; tensors are byte slices of the map, never copied here. Writing is
//! atomic: the file is written under a temporary name, fsynced, renamed over the final name,
//! and the directory is fsynced, so a reader sees the old file or the new one, never a torn one.

use std::collections::BTreeMap;
use std::io::Write;
use std::ops::Range;
use std::path::{Path, PathBuf};

use autotp_kernels::DType;

use crate::ProgramError;

/// One tensor to write: a name, its type and its bytes (borrowed; nothing is copied).
#[derive(Clone, Debug)]
pub struct TensorRef<'a> {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub bytes: &'a [u8],
}

fn to_safetensors(dtype: DType) -> safetensors::Dtype {
    use safetensors::Dtype as S;
    match dtype {
        DType::F32 => S::F32,
        DType::F64 => S::F64,
        DType::F16 => S::F16,
        DType::BF16 => S::BF16,
        DType::I64 => S::I64,
        DType::I32 => S::I32,
        DType::I8 => S::I8,
        DType::U8 => S::U8,
        DType::Bool => S::BOOL,
    }
}

fn from_safetensors(dtype: safetensors::Dtype) -> Option<DType> {
    use safetensors::Dtype as S;
    Some(match dtype {
        S::F32 => DType::F32,
        S::F64 => DType::F64,
        S::F16 => DType::F16,
        S::BF16 => DType::BF16,
        S::I64 => DType::I64,
        S::I32 => DType::I32,
        S::I8 => DType::I8,
        S::U8 => DType::U8,
        S::BOOL => DType::Bool,
        _ => return None,
    })
}

/// Maps an I/O error on `path` to [`ProgramError::Io`] ("cannot {action} {path}: ...").
pub fn io_error(path: &Path, action: &'static str) -> impl FnOnce(std::io::Error) -> ProgramError {
    let path = path.to_path_buf();
    move |source| ProgramError::Io { action, path, source }
}

fn file_error(path: &Path, message: impl Into<String>) -> ProgramError {
    ProgramError::File { path: path.to_path_buf(), message: message.into() }
}

/// Flushes a directory entry (a rename or a new file in it) to disk.
pub fn sync_dir(dir: &Path) -> Result<(), ProgramError> {
    std::fs::File::open(dir).and_then(|d| d.sync_all()).map_err(io_error(dir, "sync"))
}

/// The temporary sibling a file is written under before it is renamed into place.
pub fn temporary_path(path: &Path) -> PathBuf {
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    path.with_file_name(format!(".{name}.tmp-{}", std::process::id()))
}

/// Where a file for `path` is written before [`persist`] puts it in place: its temporary
/// sibling, or `path` itself when that exists and is not a regular file (`-o /dev/null`, a
/// pipe): such a file is written in place, never replaced by a rename.
fn staging_path(path: &Path) -> PathBuf {
    let special = std::fs::metadata(path).is_ok_and(|m| !m.is_file() && !m.is_dir());
    if special {
        path.to_path_buf()
    } else {
        temporary_path(path)
    }
}

/// Fsyncs `temporary`, renames it to `path` and fsyncs the directory (nothing when the file was
/// written in place, see [`staging_path`]).
pub fn persist(temporary: &Path, path: &Path) -> Result<(), ProgramError> {
    if temporary == path {
        return Ok(());
    }
    written_or_removed(std::fs::File::open(temporary).and_then(|f| f.sync_all()), temporary, path)?;
    std::fs::rename(temporary, path).map_err(io_error(path, "write"))?;
    sync_dir(path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new(".")))
}

/// Writes small bytes (a manifest, a pointer file) atomically.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), ProgramError> {
    let temporary = staging_path(path);
    written_or_removed(std::fs::write(&temporary, bytes), &temporary, path)?;
    persist(&temporary, path)
}

/// The outcome of writing `temporary` on its way to `path`: on failure (a full disk, a
/// directory gone) the partial file is removed, so that it holds no space, and the error
/// names `path`.
fn written_or_removed(written: std::io::Result<()>, temporary: &Path, path: &Path) -> Result<(), ProgramError> {
    written.map_err(|source| {
        // The write's error is the one worth reporting; a removal that fails too leaves a
        // temporary file that the next save of the directory removes. A special file written
        // in place (`-o /dev/null`) stays.
        if temporary != path {
            let _ = std::fs::remove_file(temporary);
        }
        ProgramError::Io { action: "write", path: path.to_path_buf(), source }
    })
}

/// The header metadata key of each tensor's CRC-32C (a JSON object of name -> checksum) that
/// [`write()`] records and [`TensorFile::verify`] checks.
pub const CHECKSUMS_KEY: &str = "autotp.crc32c";

/// Writes `tensors` and string `metadata` as one safetensors file, atomically, with each
/// tensor's CRC-32C in the header ([`CHECKSUMS_KEY`]). The layout is the `safetensors` crate's
/// (tensors by descending alignment, then name; header padded to 8 bytes); the file is
/// streamed, so nothing is copied, and created with the user's umask.
pub fn write(path: &Path, tensors: &[TensorRef], mut metadata: BTreeMap<String, String>) -> Result<(), ProgramError> {
    let checksums: BTreeMap<&str, u32> = tensors.iter().map(|t| (t.name.as_str(), crc32c::crc32c(t.bytes))).collect();
    metadata.insert(CHECKSUMS_KEY.into(), serde_json::to_string(&checksums).expect("numbers serialize"));
    let mut order: Vec<&TensorRef> = tensors.iter().collect();
    order.sort_by(|a, b| to_safetensors(b.dtype).cmp(&to_safetensors(a.dtype)).then(a.name.cmp(&b.name)));
    let mut header = serde_json::Map::new();
    if !metadata.is_empty() {
        header.insert("__metadata__".into(), serde_json::to_value(&metadata).expect("strings serialize"));
    }
    let mut offset = 0;
    for t in &order {
        if t.bytes.len() != t.shape.iter().product::<usize>() * t.dtype.size() {
            return Err(file_error(
                path,
                format!("tensor '{}' has {} bytes for {}{:?}", t.name, t.bytes.len(), t.dtype, t.shape),
            ));
        }
        if header.contains_key(&t.name) {
            return Err(file_error(path, format!("two tensors are named '{}'", t.name)));
        }
        let dtype = format!("{:?}", to_safetensors(t.dtype));
        let end = offset + t.bytes.len();
        header.insert(
            t.name.clone(),
            serde_json::json!({ "dtype": dtype, "shape": t.shape, "data_offsets": [offset, end] }),
        );
        offset = end;
    }
    let mut header = serde_json::Value::Object(header).to_string().into_bytes();
    header.resize(header.len().next_multiple_of(8), b' ');

    let temporary = staging_path(path);
    let write = || -> std::io::Result<()> {
        let mut out = std::io::BufWriter::with_capacity(1 << 20, std::fs::File::create(&temporary)?);
        out.write_all(&(header.len() as u64).to_le_bytes())?;
        out.write_all(&header)?;
        for t in &order {
            out.write_all(t.bytes)?;
        }
        out.flush()
    };
    written_or_removed(write(), &temporary, path)?;
    persist(&temporary, path)
}

/// Where one tensor lies in a [`TensorFile`].
#[derive(Clone, Debug)]
struct Entry {
    dtype: DType,
    shape: Vec<usize>,
    bytes: Range<usize>,
}

/// A memory-mapped safetensors file.
pub struct TensorFile {
    path: PathBuf,
    map: memmap2::Mmap,
    metadata: BTreeMap<String, String>,
    tensors: BTreeMap<String, Entry>,
}

impl TensorFile {
    pub fn open(path: &Path) -> Result<TensorFile, ProgramError> {
        let file = std::fs::File::open(path).map_err(io_error(path, "read"))?;
        // SAFETY: read-only map; autotp only ever replaces these files by renaming a new one
        // over them, which leaves this mapping's inode intact. Populated at once (every reader
        // goes on to read every tensor): one pass of the kernel instead of a fault per 4 KiB
        // page while the weights are copied (GPT-2 124M plan load: 0.47 -> 0.34 s median).
        let map = unsafe { memmap2::MmapOptions::new().populate().map(&file) }.map_err(io_error(path, "read"))?;
        let parsed = safetensors::SafeTensors::deserialize(&map)
            .map_err(|e| file_error(path, format!("not a valid safetensors file ({e})")))?;
        let base = map.as_ptr() as usize;
        let mut tensors = BTreeMap::new();
        for (name, view) in parsed.iter() {
            let dtype = from_safetensors(view.dtype())
                .ok_or_else(|| file_error(path, format!("tensor '{name}' has unsupported dtype {:?}", view.dtype())))?;
            let start = view.data().as_ptr() as usize - base;
            let entry = Entry { dtype, shape: view.shape().to_vec(), bytes: start..start + view.data().len() };
            tensors.insert(name.to_string(), entry);
        }
        let (_, header) = safetensors::SafeTensors::read_metadata(&map).expect("parsed above");
        let metadata = header.metadata().clone().unwrap_or_default().into_iter().collect();
        Ok(TensorFile { path: path.to_path_buf(), map, metadata, tensors })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The header's string metadata (`__metadata__`).
    pub fn metadata(&self, key: &str) -> Option<&str> {
        self.metadata.get(key).map(String::as_str)
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    pub fn get(&self, name: &str) -> Option<TensorRef<'_>> {
        let e = self.tensors.get(name)?;
        Some(TensorRef {
            name: name.to_string(),
            dtype: e.dtype,
            shape: e.shape.clone(),
            bytes: &self.map[e.bytes.clone()],
        })
    }

    /// Checks every tensor's bytes against the CRC-32C [`write()`] recorded; names the first
    /// tensor that differs. A file without checksums (one autotp did not write) passes.
    pub fn verify(&self) -> Result<(), ProgramError> {
        let Some(recorded) = self.metadata(CHECKSUMS_KEY) else { return Ok(()) };
        let recorded: BTreeMap<String, u32> = serde_json::from_str(recorded)
            .map_err(|e| file_error(&self.path, format!("is damaged: its checksums do not parse ({e})")))?;
        for (name, entry) in &self.tensors {
            let computed = crc32c::crc32c(&self.map[entry.bytes.clone()]);
            match recorded.get(name) {
                Some(&written) if written == computed => {}
                Some(&written) => {
                    return Err(file_error(
                        &self.path,
                        format!(
                            "is damaged: tensor '{name}' has CRC-32C {computed:08x}, written {written:08x} \
                             (--no-verify reads it anyway)"
                        ),
                    ))
                }
                None => return Err(file_error(&self.path, format!("is damaged: tensor '{name}' has no checksum"))),
            }
        }
        if let Some(missing) = recorded.keys().find(|n| !self.tensors.contains_key(*n)) {
            return Err(file_error(
                &self.path,
                format!("is damaged: it lacks the tensor '{missing}' it was written with"),
            ));
        }
        Ok(())
    }

    /// The tensor `name`, which must have `dtype` and `shape`.
    pub fn expect(&self, name: &str, dtype: DType, shape: &[usize]) -> Result<&[u8], ProgramError> {
        let t = self.get(name).ok_or_else(|| file_error(&self.path, format!("has no tensor '{name}'")))?;
        if t.dtype != dtype || t.shape != shape {
            return Err(file_error(
                &self.path,
                format!("tensor '{name}' is {}{:?}, expected {dtype}{shape:?}", t.dtype, t.shape),
            ));
        }
        Ok(t.bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_flipped_byte_is_found_by_its_tensor_checksum() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.safetensors");
        let (a, b) = ([1u8, 2, 3, 4], [5u8; 8]);
        let tensors = [
            TensorRef { name: "a".into(), dtype: DType::U8, shape: vec![4], bytes: &a },
            TensorRef { name: "b".into(), dtype: DType::U8, shape: vec![8], bytes: &b },
        ];
        write(&path, &tensors, BTreeMap::new()).unwrap();
        TensorFile::open(&path).unwrap().verify().unwrap();
        let mut bytes = std::fs::read(&path).unwrap();
        *bytes.last_mut().unwrap() ^= 1;
        std::fs::write(&path, bytes).unwrap();
        let err = TensorFile::open(&path).unwrap().verify().unwrap_err().to_string();
        assert!(err.contains("t.safetensors: is damaged: tensor '") && err.contains("has CRC-32C"), "{err}");
    }

    #[test]
    fn round_trip_with_metadata() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.safetensors");
        let a: Vec<u8> = [1f32, 2.0, 3.0, 4.0].iter().flat_map(|v| v.to_le_bytes()).collect();
        let b: Vec<u8> = vec![1, 0, 1];
        let tensors = [
            TensorRef { name: "a".into(), dtype: DType::F32, shape: vec![2, 2], bytes: &a },
            TensorRef { name: "b".into(), dtype: DType::Bool, shape: vec![3], bytes: &b },
        ];
        write(&path, &tensors, BTreeMap::from([("k".to_string(), "v".to_string())])).unwrap();
        let file = TensorFile::open(&path).unwrap();
        assert_eq!(file.names().collect::<Vec<_>>(), ["a", "b"]);
        assert_eq!(file.expect("a", DType::F32, &[2, 2]).unwrap(), &a[..]);
        assert_eq!(file.get("b").unwrap().bytes, &b[..]);
        assert_eq!(file.metadata("k"), Some("v"));
        let err = file.expect("a", DType::F32, &[4]).unwrap_err().to_string();
        assert!(err.contains("tensor 'a' is f32[2, 2], expected f32[4]"), "{err}");
        assert!(!temporary_path(&path).exists(), "the temporary was renamed into place");

        std::fs::write(&path, b"not safetensors").unwrap();
        let err = TensorFile::open(&path).err().unwrap().to_string();
        assert!(err.contains("not a valid safetensors file"), "{err}");
    }

    /// `-o /dev/null` discards the output: a device is written in place, never replaced by a
    /// rename (which would turn /dev/null into a regular file for everyone, running as root).
    #[test]
    fn devices_are_written_in_place() {
        let null = Path::new("/dev/null");
        write_atomic(null, b"discarded").unwrap();
        write(null, &[], BTreeMap::new()).unwrap();
        let kind = std::fs::metadata(null).unwrap().file_type();
        assert!(!kind.is_file(), "/dev/null is still a device");
    }
}
