//! Composite neural-network kernels kept whole: softmax and log-softmax, layer norm, RMS norm,
//! GELU and softmax cross-entropy. Statistics accumulate in f64; half types are widened to f32.

use rayon::prelude::*;

use crate::elementwise::num_float::Float;
use crate::scalar::{narrow, widen, Num};
use crate::shape::rows_per_task;
use crate::{view, view_mut, DType, GeluApprox, KernelError, Reduction};

/// Runs a float kernel body for f32, f64, or half types through f32. `$inputs` are byte slices
/// viewed as the compute type; `$out` is the output byte slice.
macro_rules! float_kernel {
    ($kernel:literal, $dtype:expr, [$($input:ident),*], $out:ident, |$t:ident| $body:expr) => {
        match $dtype {
            DType::F32 => {
                type $t = f32;
                $(let $input = view::<f32>($input);)*
                let $out = view_mut::<f32>($out)?;
                $body
            }
            DType::F64 => {
                type $t = f64;
                $(let $input = view::<f64>($input);)*
                let $out = view_mut::<f64>($out)?;
                $body
            }
            DType::F16 | DType::BF16 => {
                type $t = f32;
                $(let $input = std::borrow::Cow::<[f32]>::Owned(widen($dtype, $input));)*
                let bytes_out = $out;
                let mut wide = vec![0f32; bytes_out.len() / 2];
                {
                    let $out = &mut wide[..];
                    $body
                }
                narrow($dtype, &wide, bytes_out)?;
            }
            other => return Err(KernelError::Unsupported { kernel: $kernel, what: format!("{other}") }),
        }
    };
}

fn softmax_line<F: Float>(input: &[F], out: &mut [F], len: usize, stride: usize, log: bool) {
    let at = |i: usize| input[i * stride];
    let max = (1..len).fold(at(0), |m, i| if at(i) > m { at(i) } else { m });
    if log {
        let sum: f64 = (0..len).map(|i| (at(i) - max).exp().to_f64()).sum();
        let log_sum = F::from_f64(sum.ln());
        for i in 0..len {
            out[i * stride] = at(i) - max - log_sum;
        }
    } else {
        // Each exponential once: kept in the output, then scaled.
        let mut sum = 0f64;
        for i in 0..len {
            let e = (at(i) - max).exp();
            out[i * stride] = e;
            sum += e.to_f64();
        }
        let inv = F::from_f64(1.0 / sum);
        for i in 0..len {
            out[i * stride] = out[i * stride] * inv;
        }
    }
}

/// Softmax over the middle axis of `[outer, len, inner]`.
pub(crate) fn softmax(
    dtype: DType,
    outer: usize,
    len: usize,
    inner: usize,
    log: bool,
    input: &[u8],
    out: &mut [u8],
) -> Result<(), KernelError> {
    if len == 0 || outer * inner == 0 {
        return Ok(());
    }
    float_kernel!("softmax", dtype, [input], out, |F| {
        out.par_chunks_mut(len * inner).with_min_len(rows_per_task(len * inner)).enumerate().for_each(|(o, block)| {
            let src = &input[o * len * inner..(o + 1) * len * inner];
            for i in 0..inner {
                softmax_line::<F>(&src[i..], &mut block[i..], len, inner, log);
            }
        });
    });
    Ok(())
}

/// `(x - mean) / sqrt(var + eps) * scale (+ bias)` over rows of `cols`.
pub(crate) fn layer_norm(
    dtype: DType,
    cols: usize,
    eps: f64,
    x: &[u8],
    scale: &[u8],
    bias: Option<&[u8]>,
    out: &mut [u8],
) -> Result<(), KernelError> {
    if cols == 0 {
        return Ok(());
    }
    let zeros = vec![0u8; scale.len()];
    let bias = bias.unwrap_or(&zeros);
    float_kernel!("layer_norm", dtype, [x, scale, bias], out, |F| {
        out.par_chunks_mut(cols).with_min_len(rows_per_task(cols)).zip(x.par_chunks(cols)).for_each(|(o, row)| {
            let mean = row.iter().map(|v| v.to_f64()).sum::<f64>() / cols as f64;
            let var = row.iter().map(|v| (v.to_f64() - mean).powi(2)).sum::<f64>() / cols as f64;
            let inv = F::from_f64(1.0 / (var + eps).sqrt());
            let mean = F::from_f64(mean);
            for i in 0..cols {
                o[i] = (row[i] - mean) * inv * scale[i] + bias[i];
            }
        });
    });
    Ok(())
}

/// `x / sqrt(mean(x^2) + eps) * scale` over rows of `cols`.
pub(crate) fn rms_norm(
    dtype: DType,
    cols: usize,
    eps: f64,
    x: &[u8],
    scale: &[u8],
    out: &mut [u8],
) -> Result<(), KernelError> {
    if cols == 0 {
        return Ok(());
    }
    float_kernel!("rms_norm", dtype, [x, scale], out, |F| {
        out.par_chunks_mut(cols).with_min_len(rows_per_task(cols)).zip(x.par_chunks(cols)).for_each(|(o, row)| {
            let mean_square = row.iter().map(|v| v.to_f64().powi(2)).sum::<f64>() / cols as f64;
            let inv = F::from_f64(1.0 / (mean_square + eps).sqrt());
            for i in 0..cols {
                o[i] = row[i] * inv * scale[i];
            }
        });
    });
    Ok(())
}

pub(crate) fn gelu(dtype: DType, approx: GeluApprox, input: &[u8], out: &mut [u8]) -> Result<(), KernelError> {
    float_kernel!("gelu", dtype, [input], out, |F| {
        let half = F::from_f64(0.5);
        let one = F::one();
        match approx {
            GeluApprox::None => {
                let inv_sqrt2 = F::from_f64(std::f64::consts::FRAC_1_SQRT_2);
                out.par_iter_mut()
                    .with_min_len(crate::shape::GRAIN)
                    .zip(input.par_iter())
                    .for_each(|(o, &x)| *o = half * x * (one + (x * inv_sqrt2).error_function()));
            }
            GeluApprox::Tanh => {
                let c = F::from_f64((2.0 / std::f64::consts::PI).sqrt());
                let a = F::from_f64(0.044715);
                out.par_iter_mut()
                    .with_min_len(crate::shape::GRAIN)
                    .zip(input.par_iter())
                    .for_each(|(o, &x)| *o = half * x * (one + (c * (x + a * x * x * x)).tanh()));
            }
        }
    });
    Ok(())
}

/// Shapes and options of a classification loss: scores or log-probabilities `[n, classes,
/// inner]`, labels `[n, inner]`, optional class weights `[classes]`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct ClassLossDims {
    pub n: usize,
    pub classes: usize,
    pub inner: usize,
    pub ignore_index: Option<i64>,
    pub reduction: Reduction,
}

fn to_f64(dtype: DType, bytes: &[u8]) -> Vec<f64> {
    match dtype {
        DType::F32 => view::<f32>(bytes).iter().map(|&v| v as f64).collect(),
        DType::F64 => view::<f64>(bytes).into_owned(),
        _ => widen(dtype, bytes).into_iter().map(|v| v as f64).collect(),
    }
}

/// Negative log-likelihood over log-probabilities `lp`, as torch.nn.NLLLoss: position `i` with
/// label `t` contributes `-w[t] * lp[i, t]` (w = 1 without weights); ignored labels contribute 0;
/// the mean divides by the summed weights of the counted positions.
fn nll(
    dtype: DType,
    label_dtype: DType,
    d: &ClassLossDims,
    lp: &[f64],
    labels: &[u8],
    weights: Option<&[u8]>,
    loss: &mut [u8],
) -> Result<(), KernelError> {
    let labels: Vec<i64> = match label_dtype {
        DType::I64 => view::<i64>(labels).into_owned(),
        DType::I32 => view::<i32>(labels).iter().map(|&v| v as i64).collect(),
        other => return Err(KernelError::Unsupported { kernel: "nll_loss", what: format!("{other} labels") }),
    };
    let weights = weights.map(|w| to_f64(dtype, w));
    let mut per_position = vec![0f64; d.n * d.inner];
    let mut total_weight = 0f64;
    for (pos, (&label, slot)) in labels.iter().zip(per_position.iter_mut()).enumerate() {
        if Some(label) == d.ignore_index {
            continue;
        }
        if label < 0 || label as usize >= d.classes {
            return Err(KernelError::IndexOutOfRange { kernel: "nll_loss", index: label, bound: d.classes });
        }
        let (n, i) = (pos / d.inner, pos % d.inner);
        let w = weights.as_ref().map_or(1.0, |w| w[label as usize]);
        *slot = -w * lp[(n * d.classes + label as usize) * d.inner + i];
        total_weight += w;
    }
    let values: Vec<f64> = match d.reduction {
        Reduction::None => per_position,
        Reduction::Sum => vec![per_position.iter().sum()],
        Reduction::Mean => vec![per_position.iter().sum::<f64>() / total_weight],
    };
    write_f64(dtype, &values, loss)
}

/// Softmax cross-entropy: the loss (a scalar, or `[n, inner]` with no reduction) and, when
/// `log_prob` is given, the log-probabilities.
// Scores, labels, weights and both outputs are distinct buffers of this kernel.
#[allow(clippy::too_many_arguments)]
pub(crate) fn cross_entropy(
    dtype: DType,
    label_dtype: DType,
    d: &ClassLossDims,
    scores: &[u8],
    labels: &[u8],
    weights: Option<&[u8]>,
    loss: &mut [u8],
    log_prob: Option<&mut [u8]>,
) -> Result<(), KernelError> {
    let mut lp_bytes = vec![0u8; scores.len()];
    softmax(dtype, d.n, d.classes, d.inner, true, scores, &mut lp_bytes)?;
    nll(dtype, label_dtype, d, &to_f64(dtype, &lp_bytes), labels, weights, loss)?;
    if let Some(out) = log_prob {
        out.copy_from_slice(&lp_bytes);
    }
    Ok(())
}

/// Negative log-likelihood of log-probabilities.
pub(crate) fn nll_loss(
    dtype: DType,
    label_dtype: DType,
    d: &ClassLossDims,
    log_probs: &[u8],
    labels: &[u8],
    weights: Option<&[u8]>,
    loss: &mut [u8],
) -> Result<(), KernelError> {
    nll(dtype, label_dtype, d, &to_f64(dtype, log_probs), labels, weights, loss)
}

fn write_f64(dtype: DType, values: &[f64], out: &mut [u8]) -> Result<(), KernelError> {
    match dtype {
        DType::F32 => view_mut::<f32>(out)?.iter_mut().zip(values).for_each(|(o, &v)| *o = v as f32),
        DType::F64 => view_mut::<f64>(out)?.copy_from_slice(values),
        _ => narrow(dtype, &values.iter().map(|&v| v as f32).collect::<Vec<_>>(), out)?,
    }
    Ok(())
}
