//! autotp-frontend: model importers. Today: ONNX (opsets 13 to 28), memory-mapped, with
//! external data, into a verified, fully static [`autotp_ir::Graph`].
//!
//! The importer binds symbolic dims from [`ImportOptions`] (batch at dim 0 and sequence at
//! dim 1 of every input, or an explicit shape per input), converts node by node and folds
//! everything computable at compile time, so the result has no shape arithmetic left.
//! Weights are not copied: they are slices of the memory map. A shapes-only import
//! ([`ImportOptions::shapes_only`]) reads no parameter data at all, so a model can be planned
//! without its weights.

mod error;
pub mod onnx;

use std::collections::BTreeMap;

use autotp_ir::{Graph, Tensor};

pub use error::FrontendError;

/// How to bind the model's symbolic dims.
#[derive(Clone, Debug, Default)]
pub struct ImportOptions {
    /// Size of a symbolic dim 0 of any input.
    pub batch: Option<usize>,
    /// Size of a symbolic dim 1 of any input.
    pub seq_len: Option<usize>,
    /// Full shapes of named inputs; they override `batch` and `seq_len`.
    pub input_shapes: BTreeMap<String, Vec<usize>>,
    /// Import the parameters' types without their data (for `autotp plan` and `compile
    /// --report`): float initializers are parameters whether or not their data (inline or in
    /// external files, which may be absent) is there, and so are float graph inputs whose
    /// dims are all fixed, which is how `torch.onnx.export(..., export_params=False)` writes
    /// parameters. [`Model::weights`] is then empty.
    pub shapes_only: bool,
}

/// An imported model: the graph, the parameter tensors by name (none when imported
/// shapes-only: the graph's parameters have types alone), and the file's metadata (ONNX's
/// `metadata_props`, key to value).
#[derive(Clone, Debug)]
pub struct Model {
    pub graph: Graph,
    pub weights: BTreeMap<String, Tensor>,
    pub metadata: BTreeMap<String, String>,
    /// Where each weight's bytes lie in a file as they are (the model file's raw data, or an
    /// external-data file): a plan can name them there instead of copying them.
    pub weight_locations: BTreeMap<String, WeightLocation>,
}

/// A weight's bytes in a file: `length` bytes (the tensor's) from `offset`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WeightLocation {
    /// Absolute.
    pub file: std::path::PathBuf,
    pub offset: u64,
}

/// The metadata key under which an export records its embedding tables' padding rows, which
/// ONNX drops with `nn.Embedding`'s `padding_idx`: comma-separated entries spelled as
/// `--padding-idx` takes them (`N`, `none`, `TABLE=N`, `TABLE=none`; TABLE the initializer's
/// name).
pub const PADDING_IDX_METADATA: &str = "autotp.padding_idx";

/// The metadata key under which an export records the initializers that are the model's
/// buffers (comma-separated names): tensors PyTorch keeps but does not train (MiniMax's decay
/// rates, a registered mask), which the importer then takes as constants, not parameters.
pub const BUFFERS_METADATA: &str = "autotp.buffers";

/// The metadata key under which scripts/export_hf.py records the Hugging Face class of the
/// exported model (`LlamaForCausalLM`).
pub const HF_CLASS_METADATA: &str = "autotp.hf_class";

/// The metadata key under which scripts/export_hf.py records the model's own parameter names:
/// JSON, each initializer's name to the names the Hugging Face model gives that tensor (a tied
/// weight has several, the one `save_pretrained` keeps first). `autotp export --hf` writes
/// the trained weights under them.
pub const HF_PARAMETERS_METADATA: &str = "autotp.hf_parameters";

pub use onnx::import_file as import_onnx;
pub use onnx::metadata as onnx_metadata;
