//! The transcendentals of generated kernels, built from plain arithmetic, `fma`, `rint` and bit
//! operations on f32 vectors, so x86 and NVPTX compute them identically and neither calls libm
//! (which would turn vector loops into scalar calls on x86 and does not exist on NVPTX).
//!
//! Maximum errors against the f64 function rounded to f32, measured by this module's test over
//! every 251st f32 bit pattern (17 million inputs covering every binade, both signs, subnormals,
//! infinities and NaN); the test fails if any grows:
//!
//! | function | method | max error |
//! |---|---|---|
//! | `exp` | Cody-Waite reduction by ln 2, degree-7 polynomial (Cephes `expf`), 2^n in two halves so results reach the subnormals | 1 ulp |
//! | `log` | mantissa in [sqrt(1/2), sqrt(2)), degree-9 polynomial (Cephes `logf`) | 1 ulp |
//! | `tanh` | odd polynomial below 0.625 (Cephes `tanhf`), else 1 - 2 / (exp(2x) + 1) | 1 ulp |
//! | `erf` | odd polynomial below 0.875 (Cephes `erff`); degree-13 fit around 2.4 up to 3.95; 1 above | 3 ulps |
//! | `sigmoid` | 1 / (1 + exp(-\|x\|)), times exp(x) for negative x | 3 ulps |
//! | `softplus` | max(x, 0) + log1p(exp(-\|x\|)), log1p(t) as log(u) t / (u - 1) with u = 1 + t (Goldberg) | 3 ulps |
//!
//! NaN propagates through every function; infinities give the limits (exp(-inf) = 0, log(0) =
//! -inf, log of a negative number is NaN).

// Coefficients are written as published (Cephes) or fitted, not rounded to what f32 keeps.
#![allow(clippy::excessive_precision)]

use inkwell::FloatPredicate;

use crate::emit::{Emitter, V};
use crate::LlvmError;

/// `c[0] + x * (c[1] + x * (...))` with fused multiply-adds.
fn horner<'ctx>(e: &Emitter<'_, 'ctx>, x: V<'ctx>, coefficients: &[f32]) -> Result<V<'ctx>, LlvmError> {
    let width = Emitter::width(x);
    let mut acc = e.f32(width, *coefficients.last().expect("a polynomial has coefficients"));
    for &c in coefficients.iter().rev().skip(1) {
        acc = e.fma(acc, x, e.f32(width, c))?;
    }
    Ok(acc)
}

fn is_nan<'ctx>(e: &Emitter<'_, 'ctx>, x: V<'ctx>) -> Result<V<'ctx>, LlvmError> {
    e.fcmp(FloatPredicate::UNO, x, x)
}

/// `x` with the sign of `sign` (both finite or infinite; NaN handled by the callers).
fn with_sign_of<'ctx>(e: &Emitter<'_, 'ctx>, x: V<'ctx>, sign: V<'ctx>) -> Result<V<'ctx>, LlvmError> {
    e.intrinsic("llvm.copysign", &[x, sign])
}

const LN2_HI: f32 = 0.693_359_4; // 0.693359375, exact in f32
const LN2_LO: f32 = -2.121_944_4e-4;

pub fn exp<'ctx>(e: &Emitter<'_, 'ctx>, x: V<'ctx>) -> Result<V<'ctx>, LlvmError> {
    let width = Emitter::width(x);
    // Clamped to where the arithmetic below overflows to +inf (above ln(f32::MAX) = 88.72284
    // the scaled result is at least 2^128) and underflows to 0 (below -103.97208 it is under
    // 2^-150), so no select fixes the limits up afterwards; a NaN to 0 first, so the integer
    // conversion below never sees one.
    let (hi, lo) = (89.0_f32, -104.0_f32);
    let clamped = e.select(e.fcmp(FloatPredicate::OGT, x, e.f32(width, hi))?, e.f32(width, hi), x)?;
    let clamped = e.select(e.fcmp(FloatPredicate::OLT, clamped, e.f32(width, lo))?, e.f32(width, lo), clamped)?;
    let nan = is_nan(e, x)?;
    let clamped = e.select(nan, e.f32(width, 0.0), clamped)?;
    let n = e.intrinsic("llvm.rint", &[e.fmul(clamped, e.f32(width, std::f32::consts::LOG2_E))?])?;
    let r = e.fma(n, e.f32(width, -LN2_HI), clamped)?;
    let r = e.fma(n, e.f32(width, -LN2_LO), r)?;
    let p = horner(e, r, &[5.000_000_1e-1, 1.666_666_5e-1, 4.166_579_6e-2, 8.333_452e-3, 1.398_2e-3, 1.987_569_1e-4])?;
    let r2 = e.fmul(r, r)?;
    let p = e.fma(p, r2, r)?;
    let p = e.fadd(p, e.f32(width, 1.0))?;
    // 2^n in two factors, so results reach the subnormals: p (in [0.7, 1.5)) times 2^(n/2) by
    // adding n/2 to its exponent (a normal float for n in [-150, 128]), then times 2^(n - n/2).
    let i32v = e.ctx.i32_type().vec_type(width);
    let n = e.b.build_float_to_signed_int(n, i32v, "")?;
    let half = e.b.build_right_shift(n, e.i32(width, 1), true, "")?;
    let rest = e.b.build_int_sub(n, half, "")?;
    let p_bits = e.b.build_bit_cast(p, i32v, "")?.into_vector_value();
    let scaled = e.b.build_int_add(p_bits, e.b.build_left_shift(half, e.i32(width, 23), "")?, "")?;
    let scaled = e.b.build_bit_cast(scaled, e.f32_type(width), "")?.into_vector_value();
    let biased = e.b.build_int_add(rest, e.i32(width, 127), "")?;
    let power = e.b.build_bit_cast(e.b.build_left_shift(biased, e.i32(width, 23), "")?, e.f32_type(width), "")?;
    let result = e.fmul(scaled, power.into_vector_value())?;
    e.select(nan, x, result)
}

pub fn log<'ctx>(e: &Emitter<'_, 'ctx>, x: V<'ctx>) -> Result<V<'ctx>, LlvmError> {
    let width = Emitter::width(x);
    let i32v = e.ctx.i32_type().vec_type(width);
    // Subnormals: scale into the normal range first.
    let subnormal = e.fcmp(FloatPredicate::OLT, x, e.f32(width, f32::MIN_POSITIVE))?;
    let scaled = e.select(subnormal, e.fmul(x, e.f32(width, 8_388_608.0))?, x)?;
    let bias = e.select(subnormal, e.i32(width, 126 + 23), e.i32(width, 126))?;
    let bits = e.b.build_bit_cast(scaled, i32v, "")?.into_vector_value();
    let exponent = e.b.build_right_shift(bits, e.i32(width, 23), false, "")?;
    let exponent = e.b.build_and(exponent, e.i32(width, 0xff), "")?;
    let exponent = e.b.build_int_sub(exponent, bias, "")?;
    // The mantissa as a float in [0.5, 1).
    let mantissa_bits =
        e.b.build_or(e.b.build_and(bits, e.i32(width, 0x007f_ffff), "")?, e.i32(width, 0x3f00_0000), "")?;
    let m = e.b.build_bit_cast(mantissa_bits, e.f32_type(width), "")?.into_vector_value();
    // Into [sqrt(1/2), sqrt(2)) as 1 + f: below sqrt(1/2), double it and take one from the exponent.
    let low = e.fcmp(FloatPredicate::OLT, m, e.f32(width, std::f32::consts::FRAC_1_SQRT_2))?;
    let exponent = e.b.build_int_sub(exponent, e.b.build_int_z_extend(low, i32v, "")?, "")?;
    let f = e.select(low, e.fsub(e.fadd(m, m)?, e.f32(width, 1.0))?, e.fsub(m, e.f32(width, 1.0))?)?;
    let exponent = e.b.build_signed_int_to_float(exponent, e.f32_type(width), "")?;
    let z = e.fmul(f, f)?;
    let p = horner(
        e,
        f,
        &[
            3.333_333_1e-1,
            -2.499_999_4e-1,
            2.000_071_5e-1,
            -1.666_805_8e-1,
            1.424_932_3e-1,
            -1.242_014_1e-1,
            1.167_699_9e-1,
            -1.151_461e-1,
            7.037_683_6e-2,
        ],
    )?;
    let y = e.fmul(e.fmul(p, f)?, z)?;
    let y = e.fma(exponent, e.f32(width, LN2_LO), y)?;
    let y = e.fma(z, e.f32(width, -0.5), y)?;
    let r = e.fadd(f, y)?;
    let r = e.fma(exponent, e.f32(width, LN2_HI), r)?;
    // Special values: log(+inf) = +inf, log(0) = -inf, log(x < 0) = NaN, NaN stays.
    let r = e.select(e.fcmp(FloatPredicate::OEQ, x, e.f32(width, f32::INFINITY))?, x, r)?;
    let r = e.select(e.fcmp(FloatPredicate::OEQ, x, e.f32(width, 0.0))?, e.f32(width, f32::NEG_INFINITY), r)?;
    let r = e.select(e.fcmp(FloatPredicate::OLT, x, e.f32(width, 0.0))?, e.f32(width, f32::NAN), r)?;
    e.select(is_nan(e, x)?, x, r)
}

pub fn tanh<'ctx>(e: &Emitter<'_, 'ctx>, x: V<'ctx>) -> Result<V<'ctx>, LlvmError> {
    let width = Emitter::width(x);
    let a = e.intrinsic("llvm.fabs", &[x])?;
    let z = e.fmul(x, x)?;
    let p = horner(e, z, &[-3.333_328_2e-1, 1.333_144_2e-1, -5.373_971_6e-2, 2.063_908_9e-2, -5.704_988_7e-3])?;
    let small = e.fma(e.fmul(p, z)?, x, x)?;
    let t = exp(e, e.fadd(a, a)?)?;
    let large = e.fsub(e.f32(width, 1.0), e.fdiv(e.f32(width, 2.0), e.fadd(t, e.f32(width, 1.0))?)?)?;
    let large = with_sign_of(e, large, x)?;
    let result = e.select(e.fcmp(FloatPredicate::OLT, a, e.f32(width, 0.625))?, small, large)?;
    e.select(is_nan(e, x)?, x, result)
}

/// Coefficients of erf(2.4 + t) for t = |x| - 2.4, |x| in [0.875, 3.95]: a least-squares fit
/// on Chebyshev nodes, rounded to f32 (`scripts/fit_erf.py` makes them).
const ERF_MID: [f32; 14] = [
    0.999_311_57,
    0.003_555_593_5,
    -0.008_536_364,
    0.012_469_551,
    -0.012_098_434,
    0.007_886_454_5,
    -0.003_132_003_4,
    0.000_248_977_9,
    0.000_580_572_3,
    -0.000_340_761_2,
    2.408_974_4e-5,
    3.782_370_2e-5,
    -7.671_595e-6,
    -9.541_327e-7,
];

pub fn erf<'ctx>(e: &Emitter<'_, 'ctx>, x: V<'ctx>) -> Result<V<'ctx>, LlvmError> {
    let width = Emitter::width(x);
    let a = e.intrinsic("llvm.fabs", &[x])?;
    let z = e.fmul(x, x)?;
    let p = horner(
        e,
        z,
        &[
            std::f32::consts::FRAC_2_SQRT_PI,
            -3.761_262_6e-1,
            1.128_358_5e-1,
            -2.685_381_2e-2,
            5.188_327_7e-3,
            -8.010_193_6e-4,
            7.853_861_4e-5,
        ],
    )?;
    let small = e.fmul(p, x)?;
    let mid = horner(e, e.fsub(a, e.f32(width, 2.4))?, &ERF_MID)?;
    let mid = e.fmin(mid, e.f32(width, 1.0))?;
    let large = e.select(e.fcmp(FloatPredicate::OLT, a, e.f32(width, 3.95))?, mid, e.f32(width, 1.0))?;
    let large = with_sign_of(e, large, x)?;
    let result = e.select(e.fcmp(FloatPredicate::OLT, a, e.f32(width, 0.875))?, small, large)?;
    e.select(is_nan(e, x)?, x, result)
}

/// `1 / (1 + exp(-x))` for x >= 0 and `exp(x) / (1 + exp(x))` below, so the small results of
/// large negative x keep their precision instead of rounding to 0.
pub fn sigmoid<'ctx>(e: &Emitter<'_, 'ctx>, x: V<'ctx>) -> Result<V<'ctx>, LlvmError> {
    let width = Emitter::width(x);
    let one = e.f32(width, 1.0);
    let t = exp(e, e.b.build_float_neg(e.intrinsic("llvm.fabs", &[x])?, "")?)?;
    let s = e.fdiv(one, e.fadd(one, t)?)?;
    let negative = e.fcmp(FloatPredicate::OLT, x, e.f32(width, 0.0))?;
    e.select(negative, e.fmul(t, s)?, s)
}

/// `log(1 + exp(x))`: `max(x, 0) + log1p(exp(-|x|))`, so that nothing overflows and far below
/// zero the result is `exp(x)` to the last bit. `log1p(t)` is `log(u) * t / (u - 1)` with
/// `u = 1 + t` rounded (Goldberg's: the quotient corrects `u`'s rounding), or `t` where `u` is 1.
pub fn softplus<'ctx>(e: &Emitter<'_, 'ctx>, x: V<'ctx>) -> Result<V<'ctx>, LlvmError> {
    let width = Emitter::width(x);
    let one = e.f32(width, 1.0);
    let t = exp(e, e.b.build_float_neg(e.intrinsic("llvm.fabs", &[x])?, "")?)?;
    let u = e.fadd(one, t)?;
    let corrected = e.fmul(log(e, u)?, e.fdiv(t, e.fsub(u, one)?)?)?;
    let log1p = e.select(e.fcmp(FloatPredicate::OEQ, u, one)?, t, corrected)?;
    e.fadd(e.fmax(x, e.f32(width, 0.0))?, log1p)
}

#[cfg(test)]
mod tests {
    use autotp_kernels::kir::{Buffer, Expr, Index, Kernel, Stage, Store};
    use autotp_kernels::{DType, UnaryOp};

    /// The distance in representable f32 values between `a` and `b` (0 when both are NaN).
    pub(crate) fn ulps(a: f32, b: f32) -> u64 {
        if a.is_nan() || b.is_nan() {
            return if a.is_nan() && b.is_nan() { 0 } else { u64::MAX };
        }
        let ordered = |x: f32| {
            let bits = x.to_bits() as i32;
            (if bits < 0 { i32::MIN - bits } else { bits }) as i64
        };
        (ordered(a) - ordered(b)).unsigned_abs()
    }

    /// Runs `op` through a generated kernel on `xs`.
    pub(crate) fn generated(op: UnaryOp, xs: &[f32]) -> Vec<f32> {
        let row = 1024;
        assert_eq!(xs.len() % row, 0);
        let kernel = Kernel {
            name: op.name().into(),
            buffers: vec![Buffer { dtype: DType::F32, len: xs.len() }, Buffer { dtype: DType::F32, len: xs.len() }],
            num_inputs: 1,
            outer: xs.len() / row,
            inner: row,
            stages: vec![Stage::Map {
                exprs: vec![Expr::Load { buffer: 0, index: Index::row_major(row) }, Expr::Unary(op, 0)],
                stores: vec![Store { buffer: 1, index: Index::row_major(row), value: 1 }],
            }],
        };
        let compiled = crate::compile_cpu(std::slice::from_ref(&kernel)).unwrap();
        let mut ys = vec![0f32; xs.len()];
        let buffers = [xs.as_ptr() as *mut u8, ys.as_mut_ptr() as *mut u8];
        // SAFETY: the buffers match the kernel's.
        unsafe { compiled[0].run(&buffers, 0..kernel.outer) };
        ys
    }

    /// The largest error of `op` in ulps against `reference` (in f64, rounded) over every
    /// `stride`-th f32 bit pattern, and the input where it occurs.
    fn max_ulps(op: UnaryOp, reference: fn(f64) -> f64, stride: u32) -> (u64, f32) {
        let mut xs: Vec<f32> = (0..=u32::MAX / stride).map(|i| f32::from_bits(i * stride)).collect();
        xs.extend([0.0, -0.0, f32::INFINITY, f32::NEG_INFINITY, f32::NAN, f32::MIN_POSITIVE, 1e-45]);
        xs.resize(xs.len().div_ceil(1024) * 1024, 1.0);
        let ys = generated(op, &xs);
        let mut worst = (0, 0.0);
        for (&x, &y) in xs.iter().zip(&ys) {
            let want = reference(x as f64) as f32;
            let error = ulps(y, want);
            if error > worst.0 {
                worst = (error, x);
            }
        }
        worst
    }

    #[test]
    fn transcendentals_are_within_their_documented_ulps() {
        type Case = (UnaryOp, fn(f64) -> f64, u64);
        let cases: [Case; 6] = [
            (UnaryOp::Exp, f64::exp, 1),
            (UnaryOp::Log, f64::ln, 1),
            (UnaryOp::Tanh, f64::tanh, 1),
            (UnaryOp::Erf, libm::erf, 3),
            (UnaryOp::Sigmoid, |x| 1.0 / (1.0 + (-x).exp()), 3),
            (UnaryOp::Softplus, |x| x.max(0.0) + (-x.abs()).exp().ln_1p(), 3),
        ];
        for (op, reference, bound) in cases {
            let (error, at) = max_ulps(op, reference, 251);
            println!("{}: {error} ulps at {at:e}", op.name());
            assert!(error <= bound, "{} is {error} ulps off at {at:e} (documented: {bound})", op.name());
        }
    }

    /// Every f32 where `exp` overflows and underflows, and around: its limits come from the
    /// arithmetic, not from selects, so they are checked value by value.
    #[test]
    fn exp_is_within_one_ulp_at_every_value_near_its_limits() {
        for range in [87.5f32..90.0, -105.0..-102.5] {
            let mut xs: Vec<f32> = Vec::new();
            let mut x = range.start;
            while x < range.end {
                xs.push(x);
                x = f32::from_bits(if x > 0.0 { x.to_bits() + 1 } else { x.to_bits() - 1 });
            }
            xs.resize(xs.len().div_ceil(1024) * 1024, 0.0);
            let ys = generated(UnaryOp::Exp, &xs);
            for (&x, &y) in xs.iter().zip(&ys) {
                let want = (x as f64).exp() as f32;
                assert!(ulps(y, want) <= 1, "exp({x:e}) = {y:e}, not {want:e}");
            }
        }
    }
}
