//! `Tensor`: a host tensor literal (constants, weights, evaluator values). Its bytes are a
//! `bytes::Bytes`, so a weight can be a slice of a memory-mapped model file with no copy.

use bytes::Bytes;

use crate::{DType, TensorType};
use autotp_kernels::AlignedBuf;

#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Tensor {
    pub ty: TensorType,
    data: Bytes,
}

impl std::fmt::Debug for Tensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Tensor({})", self.ty)
    }
}

struct AlignedOwner(AlignedBuf);

impl AsRef<[u8]> for AlignedOwner {
    fn as_ref(&self) -> &[u8] {
        self.0.as_slice()
    }
}

impl Tensor {
    /// A tensor over existing bytes; `None` when the byte count does not match the type.
    pub fn from_bytes(ty: TensorType, data: Bytes) -> Option<Tensor> {
        (data.len() == ty.size_bytes()).then_some(Tensor { ty, data })
    }

    /// A tensor owning an aligned buffer.
    pub fn from_aligned(ty: TensorType, buf: AlignedBuf) -> Tensor {
        assert_eq!(buf.len(), ty.size_bytes(), "buffer size must match the tensor type");
        Tensor { ty, data: Bytes::from_owner(AlignedOwner(buf)) }
    }

    pub fn zeros(ty: TensorType) -> Tensor {
        let buf = AlignedBuf::zeroed(ty.size_bytes());
        Tensor::from_aligned(ty, buf)
    }

    /// A tensor of `shape` with every element equal to `value`, converted to `dtype`.
    pub fn full(dtype: DType, shape: Vec<usize>, value: f64) -> Tensor {
        let one = autotp_kernels::scalar_bytes(dtype, value);
        let ty = TensorType::new(dtype, shape);
        let mut buf = AlignedBuf::zeroed(ty.size_bytes());
        for chunk in buf.as_mut_slice().chunks_mut(dtype.size()) {
            chunk.copy_from_slice(&one);
        }
        Tensor::from_aligned(ty, buf)
    }

    /// A tensor of `shape` holding `values` (row-major), each converted to `dtype`.
    pub fn from_f64_values(dtype: DType, shape: Vec<usize>, values: &[f64]) -> Tensor {
        let bytes: Vec<u8> = values.iter().flat_map(|&v| autotp_kernels::scalar_bytes(dtype, v)).collect();
        let ty = TensorType::new(dtype, shape);
        assert_eq!(bytes.len(), ty.size_bytes(), "{} values for {ty}", values.len());
        Tensor::from_aligned(ty, AlignedBuf::from_bytes(&bytes))
    }

    pub fn from_i64(shape: Vec<usize>, values: &[i64]) -> Tensor {
        Tensor::from_pod(DType::I64, shape, values)
    }

    pub fn from_f32(shape: Vec<usize>, values: &[f32]) -> Tensor {
        Tensor::from_pod(DType::F32, shape, values)
    }

    pub fn from_pod<T: bytemuck::Pod>(dtype: DType, shape: Vec<usize>, values: &[T]) -> Tensor {
        let ty = TensorType::new(dtype, shape);
        Tensor::from_aligned(ty, AlignedBuf::from_bytes(bytemuck::cast_slice(values)))
    }

    pub fn bytes(&self) -> &[u8] {
        &self.data
    }

    pub fn dtype(&self) -> DType {
        self.ty.dtype
    }

    pub fn shape(&self) -> &[usize] {
        &self.ty.shape
    }

    pub fn numel(&self) -> usize {
        self.ty.numel()
    }

    /// The same bytes under another shape with the same element count.
    pub fn reshaped(&self, shape: Vec<usize>) -> Option<Tensor> {
        Tensor::from_bytes(TensorType::new(self.ty.dtype, shape), self.data.clone())
    }

    /// Element `i` as f64 (exact for every dtype but i64 beyond 2^53).
    pub fn get_f64(&self, i: usize) -> f64 {
        let b = &self.data[i * self.ty.dtype.size()..(i + 1) * self.ty.dtype.size()];
        match self.ty.dtype {
            DType::F32 => f32::from_le_bytes(b.try_into().unwrap()) as f64,
            DType::F64 => f64::from_le_bytes(b.try_into().unwrap()),
            DType::F16 => half::f16::from_le_bytes(b.try_into().unwrap()).to_f64(),
            DType::BF16 => half::bf16::from_le_bytes(b.try_into().unwrap()).to_f64(),
            DType::I64 => i64::from_le_bytes(b.try_into().unwrap()) as f64,
            DType::I32 => i32::from_le_bytes(b.try_into().unwrap()) as f64,
            DType::I8 => b[0] as i8 as f64,
            DType::U8 | DType::Bool => b[0] as f64,
        }
    }

    /// Element `i` as i64 (floats truncate).
    pub fn get_i64(&self, i: usize) -> i64 {
        match self.ty.dtype {
            DType::I64 => {
                let b = &self.data[i * 8..(i + 1) * 8];
                i64::from_le_bytes(b.try_into().unwrap())
            }
            _ => self.get_f64(i) as i64,
        }
    }

    pub fn to_f64_vec(&self) -> Vec<f64> {
        (0..self.numel()).map(|i| self.get_f64(i)).collect()
    }

    pub fn to_i64_vec(&self) -> Vec<i64> {
        (0..self.numel()).map(|i| self.get_i64(i)).collect()
    }

    /// True when every element has the same bytes (a splat).
    pub fn is_splat(&self) -> bool {
        let size = self.ty.dtype.size();
        self.numel() > 0 && self.data.chunks(size).all(|c| c == &self.data[..size])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn element_access() {
        let t = Tensor::from_i64(vec![3], &[1, -2, i64::MAX]);
        assert_eq!(t.to_i64_vec(), vec![1, -2, i64::MAX]);
        let f = Tensor::full(DType::BF16, vec![2, 2], 0.5);
        assert!(f.is_splat());
        assert_eq!(f.get_f64(3), 0.5);
        assert!(Tensor::from_bytes(TensorType::new(DType::F32, vec![2]), Bytes::from_static(&[0; 4])).is_none());
    }
}
