//! Tensor types, device meshes and per-value placements.

pub use autotp_kernels::DType;

/// A static tensor type: element type and shape.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct TensorType {
    pub dtype: DType,
    pub shape: Vec<usize>,
}

impl TensorType {
    pub fn new(dtype: DType, shape: impl Into<Vec<usize>>) -> TensorType {
        TensorType { dtype, shape: shape.into() }
    }

    pub fn scalar(dtype: DType) -> TensorType {
        TensorType { dtype, shape: vec![] }
    }

    pub fn rank(&self) -> usize {
        self.shape.len()
    }

    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    pub fn size_bytes(&self) -> usize {
        self.numel() * self.dtype.size()
    }
}

impl std::fmt::Display for TensorType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}[", self.dtype)?;
        for (i, d) in self.shape.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{d}")?;
        }
        f.write_str("]")
    }
}

/// How a value is laid out along one mesh axis (the DTensor / GSPMD model).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Placement {
    /// Every rank of the axis holds the whole value.
    Replicate,
    /// Each rank holds one contiguous slice along this tensor dimension.
    Shard(usize),
    /// Each rank holds a partial sum; the value is the sum over the axis.
    PartialSum,
}

impl std::fmt::Display for Placement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Placement::Replicate => f.write_str("replicate"),
            Placement::Shard(d) => write!(f, "shard({d})"),
            Placement::PartialSum => f.write_str("partial(sum)"),
        }
    }
}

/// The name of the data-parallel mesh axis: batch inputs (and pipeline messages laid out like
/// them) are split along their dim 0 over it.
pub const DATA_AXIS: &str = "dp";

/// A named mesh axis and its size.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct MeshAxis {
    pub name: String,
    pub size: usize,
}

/// The device mesh a graph runs on. An empty mesh is one device.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Mesh {
    pub axes: Vec<MeshAxis>,
}

impl Mesh {
    /// Placements of a value replicated on every axis.
    pub fn replicated(&self) -> Vec<Placement> {
        vec![Placement::Replicate; self.axes.len()]
    }
}
