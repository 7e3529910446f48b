//! TensorBoard event files (`run --tensorboard DIR`): the scalars of each step, written as
//! TensorBoard's own `SummaryWriter` writes them, so that `tensorboard --logdir DIR` plots them.
//!
//! A file `DIR/events.out.tfevents.<seconds>.<host>.<pid>` is a sequence of TFRecords: a
//! little-endian u64 length, the masked CRC-32C of those 8 bytes, the record, the masked
//! CRC-32C of the record. Each record is an `Event` protocol buffer (TensorFlow's
//! `event.proto`): the first says the file version (`brain.Event:2`), each later one holds a
//! step's `Summary` of scalar values by tag. A resumed run writes a new file beside the old one;
//! TensorBoard reads a directory's files together, by step.
//!
//! [`read_scalars`] reads such a file back (checking every CRC): the tests read autotp's files
//! with it, and a file TensorBoard's Python writer made (tests/fixtures/tensorboard).

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use prost::Message;

/// TensorFlow's `Event` (the fields autotp writes).
#[derive(Clone, PartialEq, prost::Message)]
struct Event {
    #[prost(double, tag = "1")]
    wall_time: f64,
    #[prost(int64, tag = "2")]
    step: i64,
    #[prost(string, optional, tag = "3")]
    file_version: Option<String>,
    #[prost(message, optional, tag = "5")]
    summary: Option<Summary>,
}

/// TensorFlow's `Summary`: values by tag.
#[derive(Clone, PartialEq, prost::Message)]
struct Summary {
    #[prost(message, repeated, tag = "1")]
    value: Vec<SummaryValue>,
}

/// `Summary.Value` with a scalar (`simple_value`).
#[derive(Clone, PartialEq, prost::Message)]
struct SummaryValue {
    #[prost(string, tag = "1")]
    tag: String,
    #[prost(float, optional, tag = "2")]
    simple_value: Option<f32>,
}

/// The version string of the files TensorBoard reads today.
const FILE_VERSION: &str = "brain.Event:2";

/// Why an event file cannot be written or read, naming it.
#[derive(Debug, thiserror::Error)]
#[error("TensorBoard event file {path}: {message}")]
pub struct EventFileError {
    pub path: PathBuf,
    pub message: String,
}

/// An event file being written.
pub struct EventWriter {
    path: PathBuf,
    file: BufWriter<File>,
}

impl EventWriter {
    /// Creates a new event file under `dir` (made if missing) and writes its version record.
    pub fn create(dir: &Path) -> Result<EventWriter, EventFileError> {
        let failed = |path: &Path, action: &str, e: std::io::Error| EventFileError {
            path: path.to_path_buf(),
            message: format!("cannot {action}: {e}"),
        };
        std::fs::create_dir_all(dir).map_err(|e| failed(dir, "create the directory", e))?;
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        let name = format!("events.out.tfevents.{}.{}.{}", now.as_secs(), host_name(), std::process::id());
        let path = dir.join(name);
        let file =
            File::options().write(true).create_new(true).open(&path).map_err(|e| failed(&path, "create it", e))?;
        let mut writer = EventWriter { path, file: BufWriter::new(file) };
        let version = Event { wall_time: wall_time(), file_version: Some(FILE_VERSION.into()), ..Default::default() };
        writer.write(&version)?;
        Ok(writer)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Writes one step's scalars (tag, value) and flushes, so a TensorBoard watching the
    /// directory sees the step at once.
    pub fn scalars(&mut self, step: u64, values: &[(&str, f64)]) -> Result<(), EventFileError> {
        let value = (values.iter())
            .map(|&(tag, v)| SummaryValue { tag: tag.to_string(), simple_value: Some(v as f32) })
            .collect();
        let event =
            Event { wall_time: wall_time(), step: step as i64, summary: Some(Summary { value }), ..Default::default() };
        self.write(&event)
    }

    fn write(&mut self, event: &Event) -> Result<(), EventFileError> {
        let data = event.encode_to_vec();
        let length = (data.len() as u64).to_le_bytes();
        let mut record = Vec::with_capacity(data.len() + 16);
        record.extend_from_slice(&length);
        record.extend_from_slice(&masked_crc(&length).to_le_bytes());
        record.extend_from_slice(&data);
        record.extend_from_slice(&masked_crc(&data).to_le_bytes());
        (self.file.write_all(&record).and_then(|()| self.file.flush()))
            .map_err(|e| EventFileError { path: self.path.clone(), message: format!("cannot write: {e}") })
    }
}

/// One scalar of an event file.
#[derive(Clone, Debug, PartialEq)]
pub struct Scalar {
    pub tag: String,
    pub step: i64,
    pub value: f32,
}

/// Every scalar of the event file `path`, in file order; a damaged record (a length or CRC
/// that does not check, an event that does not parse, a file that is not version 2) is an
/// error naming its offset.
pub fn read_scalars(path: &Path) -> Result<Vec<Scalar>, EventFileError> {
    let bad = |message: String| EventFileError { path: path.to_path_buf(), message };
    let bytes = std::fs::read(path).map_err(|e| bad(format!("cannot read: {e}")))?;
    let mut scalars = Vec::new();
    let mut at = 0;
    let mut versioned = false;
    while at < bytes.len() {
        let header = bytes.get(at..at + 12).ok_or_else(|| bad(format!("a record at byte {at} is cut short")))?;
        let (length, length_crc) = header.split_at(8);
        if masked_crc(length).to_le_bytes() != length_crc {
            return Err(bad(format!("the record at byte {at} has a damaged length")));
        }
        let length = u64::from_le_bytes(length.try_into().expect("8 bytes"));
        let end = usize::try_from(length).ok().and_then(|n| (at + 12).checked_add(n)).filter(|&e| e + 4 <= bytes.len());
        let end = end.ok_or_else(|| bad(format!("the record at byte {at} runs past the end of the file")))?;
        let data = &bytes[at + 12..end];
        if masked_crc(data).to_le_bytes() != bytes[end..end + 4] {
            return Err(bad(format!("the record at byte {at} is damaged (its CRC does not check)")));
        }
        let event = Event::decode(data).map_err(|e| bad(format!("the record at byte {at} is not an Event: {e}")))?;
        if let Some(version) = &event.file_version {
            if version != FILE_VERSION {
                return Err(bad(format!("is version '{version}'; this reads '{FILE_VERSION}'")));
            }
            versioned = true;
        }
        for value in event.summary.into_iter().flat_map(|s| s.value) {
            if let Some(v) = value.simple_value {
                scalars.push(Scalar { tag: value.tag, step: event.step, value: v });
            }
        }
        at = end + 4;
    }
    if !versioned {
        return Err(bad("has no file version record".into()));
    }
    Ok(scalars)
}

/// TFRecord's masked CRC-32C.
fn masked_crc(bytes: &[u8]) -> u32 {
    let crc = crc32c::crc32c(bytes);
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

fn wall_time() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}

/// This machine's name (as TensorBoard's writer puts it in the file name), or `localhost`.
fn host_name() -> String {
    let mut buffer = [0u8; 256];
    // SAFETY: the buffer is writable for its length; the name is NUL-terminated within it or cut.
    let status = unsafe { libc::gethostname(buffer.as_mut_ptr().cast(), buffer.len()) };
    let end = buffer.iter().position(|&b| b == 0).unwrap_or(buffer.len());
    let name = String::from_utf8_lossy(&buffer[..end]);
    let name: String = name.chars().filter(|c| c.is_ascii_alphanumeric() || *c == '-' || *c == '.').collect();
    if status != 0 || name.is_empty() {
        "localhost".to_string()
    } else {
        name
    }
}
