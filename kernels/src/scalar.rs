//! The `Num` trait: per-element arithmetic with ONNX semantics for every numeric dtype, and
//! the dtype dispatch macros. Integer arithmetic wraps and division by zero gives zero, so a
//! kernel never panics on user data.

use bytemuck::Pod;
use half::{bf16, f16};

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
        }
    };
}
impl_int!(i64);
impl_int!(i32);
impl_int!(i8);
impl_int!(u8);

/// Converts a half-precision buffer to f32.
pub(crate) fn widen(dtype: crate::DType, bytes: &[u8]) -> Vec<f32> {
    match dtype {
        crate::DType::F16 => crate::view::<f16>(bytes).iter().map(|v| v.to_f32()).collect(),
        crate::DType::BF16 => crate::view::<bf16>(bytes).iter().map(|v| v.to_f32()).collect(),
        _ => unreachable!("widen is only called for f16 and bf16"),
    }
}

/// Writes f32 values into a half-precision buffer, rounding to nearest.
pub(crate) fn narrow(dtype: crate::DType, values: &[f32], out: &mut [u8]) -> Result<(), crate::KernelError> {
    match dtype {
        crate::DType::F16 => {
            for (o, v) in crate::view_mut::<f16>(out)?.iter_mut().zip(values) {
                *o = f16::from_f32(*v);
            }
        }
        crate::DType::BF16 => {
            for (o, v) in crate::view_mut::<bf16>(out)?.iter_mut().zip(values) {
                *o = bf16::from_f32(*v);
            }
        }
        _ => unreachable!("narrow is only called for f16 and bf16"),
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
