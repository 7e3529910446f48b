//! Element types shared by the IR, the kernels and the runtime.

use serde::{Deserialize, Serialize};

/// The element type of a tensor.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum DType {
    F32,
    F64,
    F16,
    BF16,
    I64,
    I32,
    I8,
    U8,
    Bool,
}

impl DType {
    pub const ALL: [DType; 9] =
        [DType::F32, DType::F64, DType::F16, DType::BF16, DType::I64, DType::I32, DType::I8, DType::U8, DType::Bool];

    /// Size of one element in bytes.
    pub fn size(self) -> usize {
        match self {
            DType::F64 | DType::I64 => 8,
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::I8 | DType::U8 | DType::Bool => 1,
        }
    }

    /// The name used in the IR text format (`f32`, `i64`, `bool`...).
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::I64 => "i64",
            DType::I32 => "i32",
            DType::I8 => "i8",
            DType::U8 => "u8",
            DType::Bool => "bool",
        }
    }

    pub fn from_name(name: &str) -> Option<DType> {
        DType::ALL.into_iter().find(|d| d.name() == name)
    }

    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F64 | DType::F16 | DType::BF16)
    }

    pub fn is_int(self) -> bool {
        matches!(self, DType::I64 | DType::I32 | DType::I8 | DType::U8)
    }

    /// The index of the first element of `bytes` (elements of this type) that is an inf or a
    /// NaN: one whose exponent bits are all set. `None` when every one is finite, and for a
    /// type that has no such values.
    pub fn first_non_finite(self, bytes: &[u8]) -> Option<usize> {
        fn find<const N: usize>(bytes: &[u8], exponent: u64) -> Option<usize> {
            bytes.chunks_exact(N).position(|element| {
                let mut word = [0u8; 8];
                word[..N].copy_from_slice(element);
                u64::from_le_bytes(word) & exponent == exponent
            })
        }
        match self {
            DType::F32 => find::<4>(bytes, 0x7f80_0000),
            DType::F64 => find::<8>(bytes, 0x7ff0_0000_0000_0000),
            DType::F16 => find::<2>(bytes, 0x7c00),
            DType::BF16 => find::<2>(bytes, 0x7f80),
            DType::I64 | DType::I32 | DType::I8 | DType::U8 | DType::Bool => None,
        }
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::DType;

    #[test]
    fn finds_the_first_inf_or_nan_of_every_float_type() {
        let f32s: Vec<u8> = [1.0f32, -3e38, f32::NEG_INFINITY, f32::NAN].iter().flat_map(|v| v.to_le_bytes()).collect();
        assert_eq!(DType::F32.first_non_finite(&f32s), Some(2));
        assert_eq!(DType::F32.first_non_finite(&f32s[..8]), None);
        let f64s: Vec<u8> = [f64::MAX, f64::NAN].iter().flat_map(|v| v.to_le_bytes()).collect();
        assert_eq!(DType::F64.first_non_finite(&f64s), Some(1));
        // bf16: the high half of an f32; f16 65504 is its largest finite value, 0x7c00 inf.
        let bf16s: Vec<u8> = [0x3f80u16, 0x7f7f, 0xff80].iter().flat_map(|v| v.to_le_bytes()).collect();
        assert_eq!(DType::BF16.first_non_finite(&bf16s), Some(2));
        let f16s: Vec<u8> = [0x7bffu16, 0x7e00].iter().flat_map(|v| v.to_le_bytes()).collect();
        assert_eq!(DType::F16.first_non_finite(&f16s), Some(1));
        assert_eq!(DType::I32.first_non_finite(&[0xff; 8]), None);
    }
}
