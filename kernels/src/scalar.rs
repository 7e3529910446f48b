//! The `Num` trait: per-element arithmetic with ONNX semantics for every numeric dtype, and
//! the dtype dispatch macros. Integer arithmetic wraps and division by zero gives zero, so a
//! kernel never panics on user data.

use bytemuck::Pod;
use half::f16;

pub(crate) trait Num: Pod + PartialOrd + Send + Sync + 'static {
    /// Integers add exactly (wrapping); floats are best accumulated wider.
    const IS_INTEGER: bool;
    fn add(self, o: Self) -> Self;
    fn sub(self, o: Self) -> Self;
    fn mul(self, o: Self) -> Self;
    fn div(self, o: Self) -> Self;
    fn rem(self, o: Self) -> Self;
    fn pow(self, o: Self) -> Self;
    fn to_f64(self) -> f64;
    fn from_f64(v: f64) -> Self;
    fn neg(self) -> Self;
    fn zero() -> Self;
    fn is_nan(self) -> bool;
    /// Bitwise and, or, xor and not: integers only (the kernels refuse them on floats).
    fn bit_and(self, o: Self) -> Self;
    fn bit_or(self, o: Self) -> Self;
    fn bit_xor(self, o: Self) -> Self;
    fn bit_not(self) -> Self;
    fn max_of(self, o: Self) -> Self {
        // NaN propagates, as in torch.maximum.
        if self > o || self.is_nan() {
            self
        } else {
            o
        }
    }
    fn min_of(self, o: Self) -> Self {
        if self < o || self.is_nan() {
            self
        } else {
            o
        }
    }
}

macro_rules! impl_float {
    ($t:ty) => {
        impl Num for $t {
            const IS_INTEGER: bool = false;
            fn is_nan(self) -> bool {
                <$t>::is_nan(self)
            }
            fn add(self, o: Self) -> Self {
                self + o
            }
            fn sub(self, o: Self) -> Self {
                self - o
            }
            fn mul(self, o: Self) -> Self {
                self * o
            }
            fn div(self, o: Self) -> Self {
                self / o
            }
            fn rem(self, o: Self) -> Self {
                self % o
            }
            fn pow(self, o: Self) -> Self {
                if o == 2.0 {
                    self * self
                } else {
                    self.powf(o)
                }
            }
            fn to_f64(self) -> f64 {
                self as f64
            }
            fn from_f64(v: f64) -> Self {
                v as $t
            }
            fn neg(self) -> Self {
                -self
            }
            fn zero() -> Self {
                0.0
            }
            fn bit_and(self, o: Self) -> Self {
                <$t>::from_bits(self.to_bits() & o.to_bits())
            }
            fn bit_or(self, o: Self) -> Self {
                <$t>::from_bits(self.to_bits() | o.to_bits())
            }
            fn bit_xor(self, o: Self) -> Self {
                <$t>::from_bits(self.to_bits() ^ o.to_bits())
            }
            fn bit_not(self) -> Self {
                <$t>::from_bits(!self.to_bits())
            }
        }
    };
}
impl_float!(f32);
impl_float!(f64);

macro_rules! impl_int {
    ($t:ty) => {
        impl Num for $t {
            const IS_INTEGER: bool = true;
            fn is_nan(self) -> bool {
                false
            }
            fn add(self, o: Self) -> Self {
                self.wrapping_add(o)
            }
            fn sub(self, o: Self) -> Self {
                self.wrapping_sub(o)
            }
            fn mul(self, o: Self) -> Self {
                self.wrapping_mul(o)
            }
            fn div(self, o: Self) -> Self {
                self.checked_div(o).unwrap_or(0)
            }
            // Integer Mod follows the divisor's sign, like Python and ONNX Mod(fmod=0).
            #[allow(unused_comparisons)]
            fn rem(self, o: Self) -> Self {
                match self.checked_rem(o) {
                    Some(r) if r != 0 && ((r < 0) != (o < 0)) => r.wrapping_add(o),
                    Some(r) => r,
                    None => 0,
                }
            }
            #[allow(unused_comparisons)]
            fn pow(self, o: Self) -> Self {
                if o < (0 as $t) {
                    0
                } else {
                    self.wrapping_pow(o as u32)
                }
            }
            fn to_f64(self) -> f64 {
                self as f64
            }
            fn from_f64(v: f64) -> Self {
                v as $t
            }
            fn neg(self) -> Self {
                (0 as $t).wrapping_sub(self)
            }
            fn zero() -> Self {
                0
            }
            fn bit_and(self, o: Self) -> Self {
                self & o
            }
            fn bit_or(self, o: Self) -> Self {
                self | o
            }
            fn bit_xor(self, o: Self) -> Self {
                self ^ o
            }
            fn bit_not(self) -> Self {
                !self
            }
        }
    };
}
impl_int!(i64);
impl_int!(i32);
impl_int!(i8);
impl_int!(u8);

/// Elements converted per task when a conversion is split over threads.
const CONVERT_CHUNK: usize = 1 << 15;

/// bf16 bits as f32 (the high half of an f32).
pub(crate) fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

/// f32 to bf16 bits: to nearest even, a NaN kept quiet (what `half::bf16::from_f32` gives),
/// without branches so that loops of it vectorise.
pub(crate) fn f32_to_bf16(x: f32) -> u16 {
    let u = x.to_bits();
    let rounded = u.wrapping_add(0x7FFF + ((u >> 16) & 1)) >> 16;
    let quiet = (u | 0x0040_0000) >> 16;
    (if x.is_nan() { quiet } else { rounded }) as u16
}

/// Converts a half-precision buffer to f32 (over threads when large).
pub(crate) fn widen(dtype: crate::DType, bytes: &[u8]) -> Vec<f32> {
    use half::slice::HalfFloatSliceExt;
    use rayon::prelude::*;
    let bits = crate::view::<u16>(bytes);
    let mut out = vec![0f32; bits.len()];
    let convert = |(o, b): (&mut [f32], &[u16])| match dtype {
        crate::DType::BF16 => o.iter_mut().zip(b).for_each(|(o, &b)| *o = bf16_to_f32(b)),
        crate::DType::F16 => bytemuck::cast_slice::<u16, f16>(b).convert_to_f32_slice(o),
        _ => unreachable!("widen is only called for f16 and bf16"),
    };
    if out.len() > CONVERT_CHUNK {
        out.par_chunks_mut(CONVERT_CHUNK).zip(bits.par_chunks(CONVERT_CHUNK)).for_each(convert);
    } else {
        convert((&mut out, &bits));
    }
    out
}

/// Writes f32 values into a half-precision buffer, rounding to nearest even (over threads
/// when large).
pub(crate) fn narrow(dtype: crate::DType, values: &[f32], out: &mut [u8]) -> Result<(), crate::KernelError> {
    use half::slice::HalfFloatSliceExt;
    use rayon::prelude::*;
    let out = crate::view_mut::<u16>(out)?;
    let convert = |(o, v): (&mut [u16], &[f32])| match dtype {
        crate::DType::BF16 => o.iter_mut().zip(v).for_each(|(o, &v)| *o = f32_to_bf16(v)),
        crate::DType::F16 => bytemuck::cast_slice_mut::<u16, f16>(o).convert_from_f32_slice(v),
        _ => unreachable!("narrow is only called for f16 and bf16"),
    };
    if out.len() > CONVERT_CHUNK {
        out.par_chunks_mut(CONVERT_CHUNK).zip(values.par_chunks(CONVERT_CHUNK)).for_each(convert);
    } else {
        convert((out, values));
    }
    Ok(())
}

/// Runs `$body` with `$t` bound to the Rust type of a numeric (non-half, non-bool) dtype;
/// `$other` handles the rest.
macro_rules! with_num_type {
    ($dtype:expr, $t:ident => $body:expr, $other:pat => $fallback:expr) => {
        match $dtype {
            $crate::DType::F32 => {
                type $t = f32;
                $body
            }
            $crate::DType::F64 => {
                type $t = f64;
                $body
            }
            $crate::DType::I64 => {
                type $t = i64;
                $body
            }
            $crate::DType::I32 => {
                type $t = i32;
                $body
            }
            $crate::DType::I8 => {
                type $t = i8;
                $body
            }
            $crate::DType::U8 => {
                type $t = u8;
                $body
            }
            $other => $fallback,
        }
    };
}

/// Runs `$body` with `$t` bound to an unsigned integer type of the dtype's size, for kernels
/// that only move elements.
macro_rules! with_bits_type {
    ($dtype:expr, $t:ident => $body:expr) => {
        match $dtype.size() {
            1 => {
                type $t = u8;
                $body
            }
            2 => {
                type $t = u16;
                $body
            }
            4 => {
                type $t = u32;
                $body
            }
            _ => {
                type $t = u64;
                $body
            }
        }
    };
}

pub(crate) use with_bits_type;
pub(crate) use with_num_type;

#[cfg(test)]
mod tests {
    use super::{bf16_to_f32, f32_to_bf16};
    use half::bf16;

    /// The branch-free rounding is `half`'s, bit for bit, over a sweep of f32 bit patterns
    /// (every 257th: ties, NaNs, infinities, subnormals among them) and the edge cases.
    #[test]
    fn bf16_conversions_are_halfs() {
        let edges = [0x7F7F_FFFFu32, 0x7F80_0000, 0xFF80_0000, 0x7FC0_0001, 0xFFFF_FFFF, 0x3F80_8000, 0x3F81_8000, 1];
        for bits in (0..=u32::MAX).step_by(257).chain(edges) {
            let x = f32::from_bits(bits);
            assert_eq!(f32_to_bf16(x), bf16::from_f32(x).to_bits(), "{bits:#010x}");
        }
        // Widening is exact; a NaN stays a NaN (`half` also sets its quiet bit).
        for bits in 0..=u16::MAX {
            let (ours, halfs) = (bf16_to_f32(bits), bf16::from_bits(bits).to_f32());
            assert!(ours.to_bits() == halfs.to_bits() || (ours.is_nan() && halfs.is_nan()), "{bits:#06x}");
        }
    }
}
