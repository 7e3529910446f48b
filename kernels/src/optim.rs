//! Optimizer updates with torch.optim's semantics (single-tensor implementations):
//!
//! AdamW (decoupled weight decay, bias correction), at step `t` (1-based) with learning rate
//! `lr`:  p *= 1 - lr*wd;  m = lerp(m, g, 1 - b1);  v = b2*v + (1 - b2)*g^2;
//!        p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
//!
//! SGD with momentum (dampening 0; weight decay added to the gradient as torch does):
//!        d = g + wd*p;  buf = momentum*buf + d;  d = nesterov ? d + momentum*buf : buf;
//!        p -= lr * d.   A zero `buf` on the first step gives torch's `buf = d`.
//!
//! Scalars are computed in f64 and rounded to the element type once, as torch does with
//! Python-float hyperparameters.

use serde::{Deserialize, Serialize};

use crate::elementwise::num_float::Float;
use crate::{view, view_mut, DType, KernelError};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AdamWConfig {
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SgdConfig {
    pub momentum: f64,
    pub weight_decay: f64,
    pub nesterov: bool,
}

fn scalar_of<F: Float>(bytes: &[u8]) -> f64 {
    view::<F>(bytes)[0].to_f64()
}

fn adamw_typed<F: Float>(c: &AdamWConfig, inputs: &[&[u8]], outputs: &mut [&mut [u8]]) -> Result<(), KernelError> {
    let (p, g, m, v) = (view::<F>(inputs[0]), view::<F>(inputs[1]), view::<F>(inputs[2]), view::<F>(inputs[3]));
    let (lr, t) = (scalar_of::<F>(inputs[4]), scalar_of::<F>(inputs[5]));
    let decay = F::from_f64(1.0 - lr * c.weight_decay);
    let (one_minus_b1, b2, one_minus_b2) =
        (F::from_f64(1.0 - c.beta1), F::from_f64(c.beta2), F::from_f64(1.0 - c.beta2));
    let step_size = F::from_f64(lr / (1.0 - c.beta1.powf(t)));
    let bias2_sqrt = F::from_f64((1.0 - c.beta2.powf(t)).sqrt());
    let eps = F::from_f64(c.eps);
    let [p_out, m_out, v_out] = outputs else {
        return Err(KernelError::Arity { kernel: "adamw", inputs: inputs.len(), outputs: outputs.len() });
    };
    let (p_out, m_out, v_out) = (view_mut::<F>(p_out)?, view_mut::<F>(m_out)?, view_mut::<F>(v_out)?);
    for i in 0..p.len() {
        let decayed = p[i] * decay;
        let m_new = m[i] + (g[i] - m[i]) * one_minus_b1;
        let v_new = v[i] * b2 + g[i] * g[i] * one_minus_b2;
        let denom = v_new.sqrt() / bias2_sqrt + eps;
        p_out[i] = decayed - step_size * (m_new / denom);
        m_out[i] = m_new;
        v_out[i] = v_new;
    }
    Ok(())
}

fn sgd_typed<F: Float>(c: &SgdConfig, inputs: &[&[u8]], outputs: &mut [&mut [u8]]) -> Result<(), KernelError> {
    let (p, g, buf) = (view::<F>(inputs[0]), view::<F>(inputs[1]), view::<F>(inputs[2]));
    let lr = F::from_f64(scalar_of::<F>(inputs[3]));
    let (wd, momentum) = (F::from_f64(c.weight_decay), F::from_f64(c.momentum));
    let [p_out, buf_out] = outputs else {
        return Err(KernelError::Arity { kernel: "sgd", inputs: inputs.len(), outputs: outputs.len() });
    };
    let (p_out, buf_out) = (view_mut::<F>(p_out)?, view_mut::<F>(buf_out)?);
    for i in 0..p.len() {
        let d = if c.weight_decay == 0.0 { g[i] } else { g[i] + wd * p[i] };
        let (step, b) = if c.momentum == 0.0 {
            (d, buf[i])
        } else {
            let b = buf[i] * momentum + d;
            (if c.nesterov { d + momentum * b } else { b }, b)
        };
        p_out[i] = p[i] - lr * step;
        buf_out[i] = b;
    }
    Ok(())
}

pub(crate) fn adamw(
    dtype: DType,
    c: &AdamWConfig,
    inputs: &[&[u8]],
    outputs: &mut [&mut [u8]],
) -> Result<(), KernelError> {
    match dtype {
        DType::F32 => adamw_typed::<f32>(c, inputs, outputs),
        DType::F64 => adamw_typed::<f64>(c, inputs, outputs),
        other => Err(KernelError::Unsupported {
            kernel: "adamw",
            what: format!("{other} parameters (keep f32 master weights)"),
        }),
    }
}

pub(crate) fn sgd(dtype: DType, c: &SgdConfig, inputs: &[&[u8]], outputs: &mut [&mut [u8]]) -> Result<(), KernelError> {
    match dtype {
        DType::F32 => sgd_typed::<f32>(c, inputs, outputs),
        DType::F64 => sgd_typed::<f64>(c, inputs, outputs),
        other => Err(KernelError::Unsupported {
            kernel: "sgd",
            what: format!("{other} parameters (keep f32 master weights)"),
        }),
    }
}
