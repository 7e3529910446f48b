//! Tensor types, device meshes and per-value placements.

pub use autotp_kernels::DType;
pub use autotp_program::mesh::{MeshAxis, Placement, CONTEXT_AXIS, DATA_AXIS, EXPERT_AXIS};

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

    /// Refuses a shape past autotp's limits: more than 64 dims (PyTorch's own limit), or dims
    /// that, zeros left out, multiply past 2^48 elements (or overflow). Every shape the shape
    /// rules make and the importer reads passes here, so that no product of dims overflows
    /// downstream and no rule's work grows with a crafted rank.
    pub fn check_limits(&self) -> Result<(), String> {
        const MOST_DIMS: usize = 64;
        const MOST_ELEMENTS: usize = 1 << 48;
        if self.shape.len() > MOST_DIMS {
            return Err(format!("a shape of {} dims; autotp takes at most {MOST_DIMS}", self.shape.len()));
        }
        let elements = self.shape.iter().filter(|&&d| d > 0).try_fold(1usize, |n, &d| n.checked_mul(d));
        match elements {
            Some(n) if n <= MOST_ELEMENTS => Ok(()),
            _ => Err(format!("the shape {:?} has more than 2^48 elements", self.shape)),
        }
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
