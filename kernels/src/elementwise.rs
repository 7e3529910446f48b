//! Elementwise kernels: unary functions, broadcasting binary functions, `where` and casts.
//! Half-precision inputs are computed in f32 and rounded once at the end.

use rayon::prelude::*;

use crate::scalar::{narrow, widen, with_num_type, Num};
use crate::shape::{rows_per_task, Broadcast, GRAIN};
use crate::{view, view_mut, BinaryOp, DType, KernelError, UnaryOp};

fn map_unary<A: Copy + Sync, B: Copy + Send>(input: &[A], out: &mut [B], f: impl Fn(A) -> B + Sync) {
    out.par_iter_mut().with_min_len(GRAIN).zip(input.par_iter()).for_each(|(o, &a)| *o = f(a));
}

fn unary_float<T: num_float::Float>(op: UnaryOp, input: &[T], out: &mut [T]) {
    use UnaryOp::*;
    match op {
        Neg => map_unary(input, out, |a| -a),
        Abs => map_unary(input, out, |a| a.abs()),
        Exp => map_unary(input, out, |a| a.exp()),
        Log => map_unary(input, out, |a| a.ln()),
        Sqrt => map_unary(input, out, |a| a.sqrt()),
        Rsqrt => map_unary(input, out, |a| T::one() / a.sqrt()),
        Reciprocal => map_unary(input, out, |a| T::one() / a),
        Tanh => map_unary(input, out, |a| a.tanh()),
        Erf => map_unary(input, out, |a| a.error_function()),
        Sigmoid => map_unary(input, out, |a| T::one() / (T::one() + (-a).exp())),
        // max(x, 0) + log(1 + exp(-|x|)): no overflow, and exp(x) itself far below zero.
        Softplus => map_unary(input, out, |a| {
            let positive = if a > T::zero() { a } else { T::zero() };
            positive + (-a.abs()).exp().ln_1p()
        }),
        Relu => map_unary(input, out, |a| if a > T::zero() { a } else { T::zero() }),
        Sin => map_unary(input, out, |a| a.sin()),
        Cos => map_unary(input, out, |a| a.cos()),
        Floor => map_unary(input, out, |a| a.floor()),
        Ceil => map_unary(input, out, |a| a.ceil()),
        Round => map_unary(input, out, |a| a.round_ties_even()),
        Sign => map_unary(input, out, |a| {
            if a > T::zero() {
                T::one()
            } else if a < T::zero() {
                -T::one()
            } else {
                a
            }
        }),
        // The IEEE difference itself (its NaN as the generated kernels make it).
        #[allow(clippy::eq_op)]
        FiniteZero => map_unary(input, out, |a| a - a),
        Not => unreachable!("checked by the caller"),
    }
}

fn unary_int<T: Num>(op: UnaryOp, input: &[T], out: &mut [T]) -> Result<(), KernelError> {
    match op {
        UnaryOp::Neg => map_unary(input, out, |a| a.neg()),
        UnaryOp::Abs => map_unary(input, out, |a| if a < T::zero() { a.neg() } else { a }),
        UnaryOp::Relu => map_unary(input, out, |a| if a < T::zero() { T::zero() } else { a }),
        UnaryOp::Not => map_unary(input, out, T::bit_not),
        UnaryOp::Sign => map_unary(input, out, |a| {
            T::from_f64(if a > T::zero() {
                1.0
            } else if a < T::zero() {
                -1.0
            } else {
                0.0
            })
        }),
        _ => return Err(KernelError::Unsupported { kernel: "unary", what: format!("{} on integers", op.name()) }),
    }
    Ok(())
}

pub(crate) fn unary(op: UnaryOp, dtype: DType, input: &[u8], out: &mut [u8]) -> Result<(), KernelError> {
    match dtype {
        DType::Bool if op == UnaryOp::Not => {
            map_unary(input, out, |a: u8| (a == 0) as u8);
            Ok(())
        }
        _ if op == UnaryOp::Not && dtype.is_float() => {
            Err(KernelError::Unsupported { kernel: "unary", what: format!("not on {dtype}") })
        }
        DType::F32 => {
            unary_float::<f32>(op, &view(input), view_mut(out)?);
            Ok(())
        }
        DType::F64 => {
            unary_float::<f64>(op, &view(input), view_mut(out)?);
            Ok(())
        }
        DType::F16 | DType::BF16 => {
            let wide = widen(dtype, input);
            let mut result = vec![0f32; wide.len()];
            unary_float::<f32>(op, &wide, &mut result);
            narrow(dtype, &result, out)
        }
        _ => with_num_type!(dtype, T => unary_int::<T>(op, &view(input), view_mut(out)?),
            _ => Err(KernelError::Unsupported { kernel: "unary", what: format!("{} on {dtype}", op.name()) })),
    }
}

/// Applies `f` elementwise over the broadcast of `lhs` and `rhs` into `out`.
pub(crate) fn broadcast_map<A: Copy + Sync, B: Copy + Send>(
    lhs: &[A],
    lhs_shape: &[usize],
    rhs: &[A],
    rhs_shape: &[usize],
    out: &mut [B],
    out_shape: &[usize],
    f: impl Fn(A, A) -> B + Sync,
) {
    if lhs_shape == out_shape && rhs_shape == out_shape {
        out.par_iter_mut()
            .with_min_len(GRAIN)
            .zip(lhs.par_iter().zip(rhs.par_iter()))
            .for_each(|(o, (&a, &b))| *o = f(a, b));
        return;
    }
    let bc = Broadcast::new(&[lhs_shape, rhs_shape], out_shape);
    let inner = bc.inner();
    if inner == 0 {
        return;
    }
    let (sl, sr) = (bc.inner_stride(0), bc.inner_stride(1));
    out.par_chunks_mut(inner).with_min_len(rows_per_task(inner)).enumerate().for_each(|(row, o)| {
        let mut offs = [0usize; 2];
        bc.row_offsets(row, &mut offs);
        for (i, slot) in o.iter_mut().enumerate() {
            *slot = f(lhs[offs[0] + i * sl], rhs[offs[1] + i * sr]);
        }
    });
}

pub(crate) struct BinaryShapes<'a> {
    pub lhs: &'a [usize],
    pub rhs: &'a [usize],
    pub out: &'a [usize],
}

fn binary_num<T: Num>(
    op: BinaryOp,
    s: &BinaryShapes,
    lhs: &[u8],
    rhs: &[u8],
    out: &mut [u8],
) -> Result<(), KernelError> {
    let (l, r) = (view::<T>(lhs), view::<T>(rhs));
    macro_rules! arith {
        ($f:expr) => {
            broadcast_map(&l, s.lhs, &r, s.rhs, view_mut::<T>(out)?, s.out, $f)
        };
    }
    macro_rules! compare {
        ($f:expr) => {
            broadcast_map(&l, s.lhs, &r, s.rhs, view_mut::<u8>(out)?, s.out, |a: T, b: T| $f(a, b) as u8)
        };
    }
    match op {
        BinaryOp::Add => arith!(T::add),
        BinaryOp::Sub => arith!(T::sub),
        BinaryOp::Mul => arith!(T::mul),
        BinaryOp::Div => arith!(T::div),
        BinaryOp::Pow => arith!(T::pow),
        BinaryOp::Max => arith!(T::max_of),
        BinaryOp::Min => arith!(T::min_of),
        BinaryOp::Mod => arith!(T::rem),
        BinaryOp::Equal => compare!(|a, b| a == b),
        BinaryOp::Less => compare!(|a, b| a < b),
        BinaryOp::LessEqual => compare!(|a, b| a <= b),
        BinaryOp::Greater => compare!(|a, b| a > b),
        BinaryOp::GreaterEqual => compare!(|a, b| a >= b),
        BinaryOp::And if T::IS_INTEGER => arith!(T::bit_and),
        BinaryOp::Or if T::IS_INTEGER => arith!(T::bit_or),
        BinaryOp::Xor if T::IS_INTEGER => arith!(T::bit_xor),
        BinaryOp::And | BinaryOp::Or | BinaryOp::Xor => {
            return Err(KernelError::Unsupported { kernel: "binary", what: format!("{} on floats", op.name()) })
        }
    }
    Ok(())
}

fn binary_bool(op: BinaryOp, s: &BinaryShapes, lhs: &[u8], rhs: &[u8], out: &mut [u8]) -> Result<(), KernelError> {
    let f: fn(u8, u8) -> u8 = match op {
        BinaryOp::And => |a, b| ((a != 0) && (b != 0)) as u8,
        BinaryOp::Or => |a, b| ((a != 0) || (b != 0)) as u8,
        BinaryOp::Xor => |a, b| ((a != 0) != (b != 0)) as u8,
        BinaryOp::Equal => |a, b| ((a != 0) == (b != 0)) as u8,
        _ => return Err(KernelError::Unsupported { kernel: "binary", what: format!("{} on bool", op.name()) }),
    };
    broadcast_map(lhs, s.lhs, rhs, s.rhs, out, s.out, f);
    Ok(())
}

pub(crate) fn binary(
    op: BinaryOp,
    dtype: DType,
    s: &BinaryShapes,
    lhs: &[u8],
    rhs: &[u8],
    out: &mut [u8],
) -> Result<(), KernelError> {
    match dtype {
        DType::Bool => binary_bool(op, s, lhs, rhs, out),
        DType::F16 | DType::BF16 => {
            let (l, r) = (widen(dtype, lhs), widen(dtype, rhs));
            if op.is_comparison() {
                binary_num::<f32>(op, s, bytemuck::cast_slice(&l), bytemuck::cast_slice(&r), out)
            } else {
                let mut result = vec![0f32; crate::numel(s.out)];
                binary_num::<f32>(
                    op,
                    s,
                    bytemuck::cast_slice(&l),
                    bytemuck::cast_slice(&r),
                    bytemuck::cast_slice_mut(&mut result),
                )?;
                narrow(dtype, &result, out)
            }
        }
        _ => with_num_type!(dtype, T => binary_num::<T>(op, s, lhs, rhs, out), _ => unreachable!()),
    }
}

/// `out = cond ? x : y`, all three broadcast to `out`.
pub(crate) fn select(
    dtype: DType,
    shapes: [&[usize]; 3],
    out_shape: &[usize],
    cond: &[u8],
    x: &[u8],
    y: &[u8],
    out: &mut [u8],
) -> Result<(), KernelError> {
    crate::scalar::with_bits_type!(dtype, T => {
        let (x, y) = (view::<T>(x), view::<T>(y));
        let out = view_mut::<T>(out)?;
        let bc = Broadcast::new(&shapes, out_shape);
        let inner = bc.inner();
        if inner == 0 {
            return Ok(());
        }
        let strides = [bc.inner_stride(0), bc.inner_stride(1), bc.inner_stride(2)];
        out.par_chunks_mut(inner).with_min_len(rows_per_task(inner)).enumerate().for_each(|(row, o)| {
            let mut offs = [0usize; 3];
            bc.row_offsets(row, &mut offs);
            for (i, slot) in o.iter_mut().enumerate() {
                *slot = if cond[offs[0] + i * strides[0]] != 0 {
                    x[offs[1] + i * strides[1]]
                } else {
                    y[offs[2] + i * strides[2]]
                };
            }
        });
        Ok(())
    })
}

fn cast_values<T: Num>(from: DType, input: &[u8], out: &mut [T]) {
    // Going through f64 is exact for every source type except i64 beyond 2^53, which is
    // handled separately when both sides are integers.
    match from {
        DType::F16 | DType::BF16 => {
            out.iter_mut().zip(widen(from, input)).for_each(|(o, v)| *o = T::from_f64(v as f64))
        }
        DType::Bool => out.iter_mut().zip(input).for_each(|(o, &v)| *o = T::from_f64((v != 0) as u8 as f64)),
        _ => with_num_type!(from, S => {
            out.par_iter_mut().with_min_len(GRAIN).zip(view::<S>(input).par_iter()).for_each(|(o, &v)| *o = T::from_f64(v.to_f64()));
        }, _ => unreachable!()),
    }
}

pub(crate) fn cast(from: DType, to: DType, input: &[u8], out: &mut [u8]) -> Result<(), KernelError> {
    if from == to {
        out.copy_from_slice(input);
        return Ok(());
    }
    if from == DType::I64 && to.is_int() {
        let src = view::<i64>(input);
        with_num_type!(to, T => {
            view_mut::<T>(out)?.iter_mut().zip(src.iter()).for_each(|(o, &v)| *o = v as T);
        }, _ => unreachable!());
        return Ok(());
    }
    match to {
        DType::Bool => {
            let mut wide = vec![0f64; out.len()];
            cast_values::<f64>(from, input, &mut wide);
            out.iter_mut().zip(wide).for_each(|(o, v)| *o = (v != 0.0) as u8);
        }
        DType::F16 | DType::BF16 => {
            let mut wide = vec![0f64; out.len() / 2];
            cast_values::<f64>(from, input, &mut wide);
            let wide: Vec<f32> = wide.into_iter().map(|v| v as f32).collect();
            narrow(to, &wide, out)?;
        }
        _ => {
            with_num_type!(to, T => cast_values::<T>(from, input, view_mut::<T>(out)?), _ => unreachable!())
        }
    }
    Ok(())
}

/// The float functions the unary kernels need, for f32 and f64.
pub(crate) mod num_float {
    pub trait Float:
        crate::scalar::Num
        + std::ops::Neg<Output = Self>
        + std::ops::Add<Output = Self>
        + std::ops::Sub<Output = Self>
        + std::ops::Mul<Output = Self>
        + std::ops::Div<Output = Self>
    {
        fn one() -> Self;
        fn abs(self) -> Self;
        fn exp(self) -> Self;
        fn ln(self) -> Self;
        fn ln_1p(self) -> Self;
        fn sqrt(self) -> Self;
        fn tanh(self) -> Self;
        fn error_function(self) -> Self;
        fn sin(self) -> Self;
        fn cos(self) -> Self;
        fn floor(self) -> Self;
        fn ceil(self) -> Self;
        fn round_ties_even(self) -> Self;
    }

    macro_rules! impl_float {
        ($t:ty, $erf:path) => {
            impl Float for $t {
                fn one() -> Self {
                    1.0
                }
                fn abs(self) -> Self {
                    <$t>::abs(self)
                }
                fn exp(self) -> Self {
                    <$t>::exp(self)
                }
                fn ln(self) -> Self {
                    <$t>::ln(self)
                }
                fn ln_1p(self) -> Self {
                    <$t>::ln_1p(self)
                }
                fn sqrt(self) -> Self {
                    <$t>::sqrt(self)
                }
                fn tanh(self) -> Self {
                    <$t>::tanh(self)
                }
                fn error_function(self) -> Self {
                    $erf(self)
                }
                fn sin(self) -> Self {
                    <$t>::sin(self)
                }
                fn cos(self) -> Self {
                    <$t>::cos(self)
                }
                fn floor(self) -> Self {
                    <$t>::floor(self)
                }
                fn ceil(self) -> Self {
                    <$t>::ceil(self)
                }
                fn round_ties_even(self) -> Self {
                    <$t>::round_ties_even(self)
                }
            }
        };
    }
    impl_float!(f32, libm::erff);
    impl_float!(f64, libm::erf);
}
