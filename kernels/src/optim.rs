//! Optimizer updates with torch.optim's semantics: the builtin single-tensor `adamw` and `sgd`
//! kernels, and what the generated multi-tensor step (`autotp_llvm::optim`, as Apex's and
//! DeepSpeed's fused optimizers) shares with them: the chunk layout ([`TensorUpdate`]) and how
//! the step's constants follow from its scalars (below, with [`power`]). The generated step
//! computes those constants itself from the scalars in device memory, and repeats the
//! per-element arithmetic below operation for operation, so it is bit-identical to these
//! kernels (tested) and a GPU's step never waits for the host.
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
//! Python-float hyperparameters. `b^t` is [`power`]: repeated squaring over the bits of the
//! whole step count, IEEE multiplications that every target performs alike (a libm `pow`
//! differs between targets in the last bit).

use serde::{Deserialize, Serialize};

use crate::elementwise::num_float::Float;
use crate::{view, DType, KernelError};

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

/// An update rule and its hyperparameters.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Optimizer {
    /// States: the moments m and v. Scalars: the learning rate and the step (1-based).
    AdamW(AdamWConfig),
    /// State: the momentum buffer. Scalar: the learning rate.
    Sgd(SgdConfig),
}

impl Optimizer {
    pub fn name(&self) -> &'static str {
        match self {
            Optimizer::AdamW(_) => "adamw",
            Optimizer::Sgd(_) => "sgd",
        }
    }

    /// The name of its multi-tensor step (in profiles and summaries): `multi_tensor_adamw`.
    pub fn multi_tensor_name(&self) -> String {
        format!("multi_tensor_{}", self.name())
    }

    /// State tensors per parameter, each the parameter's size.
    pub fn num_states(&self) -> usize {
        match self {
            Optimizer::AdamW(_) => 2,
            Optimizer::Sgd(_) => 1,
        }
    }

    /// One-element scalar inputs (learning rate, step), in the parameter's dtype.
    pub fn num_scalars(&self) -> usize {
        match self {
            Optimizer::AdamW(_) => 2,
            Optimizer::Sgd(_) => 1,
        }
    }
}

/// Where one tensor's update reads and writes, `len` elements each: it reads the parameter, its
/// gradient and its states (as many as [`Optimizer::num_states`]; the rest are null) and writes
/// the new parameter and states. Each output is exactly its input (updated in place) or
/// overlaps nothing else of the update.
///
/// The layout is C's, eight 64-bit words in field order: a table of these is what the generated
/// multi-tensor kernels (`autotp_llvm::optim`, x86 and PTX) walk, one entry per chunk.
#[derive(Clone, Copy, Debug)]
#[repr(C)]
pub struct TensorUpdate {
    pub len: usize,
    pub param: *const u8,
    pub grad: *const u8,
    pub states: [*const u8; 2],
    pub param_out: *mut u8,
    pub states_out: [*mut u8; 2],
}

impl TensorUpdate {
    /// The update of elements `range` alone.
    ///
    /// # Safety
    /// `range` lies within `0..self.len`, and `dtype` is the element type of the pointers.
    pub unsafe fn part(&self, dtype: DType, range: std::ops::Range<usize>) -> TensorUpdate {
        let at = range.start * dtype.size();
        // Wrapping: the pointers may be a GPU's addresses, never dereferenced here.
        let add = |p: *const u8| if p.is_null() { p } else { p.wrapping_add(at) };
        let add_mut = |p: *mut u8| if p.is_null() { p } else { p.wrapping_add(at) };
        TensorUpdate {
            len: range.len(),
            param: add(self.param),
            grad: add(self.grad),
            states: self.states.map(add),
            param_out: add_mut(self.param_out),
            states_out: self.states_out.map(add_mut),
        }
    }
}

/// Applies `optimizer` to one tensor, with `scalars` the one-element learning rate (and step).
///
/// # Safety
/// Every pointer of `t` that the optimizer uses is valid for `t.len` elements of `dtype` and
/// aligned for it, and outputs alias as [`TensorUpdate`] allows.
unsafe fn update(optimizer: &Optimizer, dtype: DType, scalars: &[&[u8]], t: &TensorUpdate) -> Result<(), KernelError> {
    match dtype {
        DType::F32 => unsafe { update_typed::<f32>(optimizer, scalars, t) },
        DType::F64 => unsafe { update_typed::<f64>(optimizer, scalars, t) },
        other => Err(KernelError::Unsupported {
            kernel: optimizer.name(),
            what: format!("{other} parameters (keep f32 master weights)"),
        }),
    }
}

/// `base^exponent` by repeated squaring: for each bit of `exponent` from the lowest, the
/// result is multiplied by the current square where the bit is set, then the square squared.
/// The generated step (`autotp_llvm::optim`) performs the same multiplications in the same order.
pub fn power(base: f64, exponent: u64) -> f64 {
    let (mut result, mut square, mut rest) = (1.0, base, exponent);
    while rest > 0 {
        if rest & 1 == 1 {
            result *= square;
        }
        square *= square;
        rest >>= 1;
    }
    result
}

fn scalar_of<F: Float>(bytes: &[u8]) -> f64 {
    view::<F>(bytes)[0].to_f64()
}

/// An optimizer's constants for one step, in the element type.
enum Step<F> {
    AdamW { decay: F, one_minus_b1: F, b2: F, one_minus_b2: F, step_size: F, bias2_sqrt: F, eps: F },
    Sgd { lr: F, weight_decay: Option<F>, momentum: Option<F>, nesterov: bool },
}

impl<F: Float> Step<F> {
    fn new(optimizer: &Optimizer, scalars: &[&[u8]]) -> Result<Step<F>, KernelError> {
        if scalars.len() != optimizer.num_scalars() || scalars.iter().any(|s| s.len() != std::mem::size_of::<F>()) {
            return Err(KernelError::Arity { kernel: optimizer.name(), inputs: scalars.len(), outputs: 0 });
        }
        let lr = scalar_of::<F>(scalars[0]);
        Ok(match optimizer {
            Optimizer::AdamW(c) => {
                // A whole step count (`as` saturates, as the generated step's conversion does).
                let t = scalar_of::<F>(scalars[1]) as u64;
                Step::AdamW {
                    decay: F::from_f64(1.0 - lr * c.weight_decay),
                    one_minus_b1: F::from_f64(1.0 - c.beta1),
                    b2: F::from_f64(c.beta2),
                    one_minus_b2: F::from_f64(1.0 - c.beta2),
                    step_size: F::from_f64(lr / (1.0 - power(c.beta1, t))),
                    bias2_sqrt: F::from_f64((1.0 - power(c.beta2, t)).sqrt()),
                    eps: F::from_f64(c.eps),
                }
            }
            Optimizer::Sgd(c) => Step::Sgd {
                lr: F::from_f64(lr),
                weight_decay: (c.weight_decay != 0.0).then(|| F::from_f64(c.weight_decay)),
                momentum: (c.momentum != 0.0).then(|| F::from_f64(c.momentum)),
                nesterov: c.nesterov,
            },
        })
    }

    /// Updates `param` and the states (`second` is empty for SGD) in place.
    #[inline(always)]
    fn apply(&self, param: &mut [F], grad: &[F], first: &mut [F], second: &mut [F]) {
        match *self {
            Step::AdamW { decay, one_minus_b1, b2, one_minus_b2, step_size, bias2_sqrt, eps } => {
                let states = first.iter_mut().zip(second.iter_mut());
                for ((p, &g), (m, v)) in param.iter_mut().zip(grad).zip(states) {
                    let decayed = *p * decay;
                    *m = *m + (g - *m) * one_minus_b1;
                    *v = *v * b2 + g * g * one_minus_b2;
                    let denom = v.sqrt() / bias2_sqrt + eps;
                    *p = decayed - step_size * (*m / denom);
                }
            }
            Step::Sgd { lr, weight_decay, momentum, nesterov } => {
                for ((p, &g), buf) in param.iter_mut().zip(grad).zip(first.iter_mut()) {
                    let d = match weight_decay {
                        None => g,
                        Some(wd) => g + wd * *p,
                    };
                    let step = match momentum {
                        None => d,
                        Some(momentum) => {
                            *buf = *buf * momentum + d;
                            if nesterov {
                                d + momentum * *buf
                            } else {
                                *buf
                            }
                        }
                    };
                    *p = *p - lr * step;
                }
            }
        }
    }

    /// [`Step::apply`] compiled for AVX2 where the active level has it (rustc's default x86-64
    /// target has SSE2 alone). The arithmetic is the same IEEE operations in the same order (rustc
    /// never contracts to FMA), so the result is too.
    fn apply_fastest(&self, param: &mut [F], grad: &[F], first: &mut [F], second: &mut [F]) {
        #[cfg(target_arch = "x86_64")]
        if crate::isa::IsaLevel::active() >= crate::isa::IsaLevel::V3 {
            #[target_feature(enable = "avx2")]
            unsafe fn avx2<F: Float>(step: &Step<F>, param: &mut [F], grad: &[F], first: &mut [F], second: &mut [F]) {
                step.apply(param, grad, first, second)
            }
            // SAFETY: the CPU has AVX2 (the active level is at most the host's).
            return unsafe { avx2(self, param, grad, first, second) };
        }
        self.apply(param, grad, first, second)
    }
}

unsafe fn update_typed<F: Float>(
    optimizer: &Optimizer,
    scalars: &[&[u8]],
    t: &TensorUpdate,
) -> Result<(), KernelError> {
    let step = Step::<F>::new(optimizer, scalars)?;
    let bytes = t.len * std::mem::size_of::<F>();
    let pairs = [(t.param, t.param_out), (t.states[0], t.states_out[0]), (t.states[1], t.states_out[1])];
    // An output not updated in place starts as a copy of its input (they do not overlap).
    for (input, output) in pairs.into_iter().take(1 + optimizer.num_states()) {
        if !std::ptr::eq(input, output) {
            unsafe { std::ptr::copy_nonoverlapping(input, output, bytes) };
        }
    }
    let slice = |p: *mut u8| -> &mut [F] {
        if p.is_null() {
            &mut []
        } else {
            unsafe { std::slice::from_raw_parts_mut(p as *mut F, t.len) }
        }
    };
    let grad = unsafe { std::slice::from_raw_parts(t.grad as *const F, t.len) };
    step.apply_fastest(slice(t.param_out), grad, slice(t.states_out[0]), slice(t.states_out[1]));
    Ok(())
}

/// The single-tensor kernels: inputs param, grad, states..., scalars...; outputs param, states...
pub(crate) fn single_tensor(
    dtype: DType,
    optimizer: &Optimizer,
    inputs: &[&[u8]],
    outputs: &mut [&mut [u8]],
) -> Result<(), KernelError> {
    let states = optimizer.num_states();
    let arity = KernelError::Arity { kernel: optimizer.name(), inputs: inputs.len(), outputs: outputs.len() };
    if inputs.len() != 2 + states + optimizer.num_scalars() || outputs.len() != 1 + states {
        return Err(arity);
    }
    let bytes = inputs[0].len();
    if !bytes.is_multiple_of(dtype.size())
        || inputs[..2 + states].iter().map(|b| b.len()).chain(outputs.iter().map(|o| o.len())).any(|len| len != bytes)
    {
        return Err(arity);
    }
    let (tensors, scalars) = inputs.split_at(2 + states);
    let [param_out, states_out @ ..] = outputs else { return Err(arity) };
    // Inputs may lie anywhere (a memory-mapped file); outputs are aligned (`view_mut` checks).
    let copies: Vec<Option<crate::AlignedBuf>> = tensors
        .iter()
        .map(|b| (!(b.as_ptr() as usize).is_multiple_of(dtype.size())).then(|| crate::AlignedBuf::from_bytes(b)))
        .collect();
    let input = |k: usize| copies[k].as_ref().map_or(tensors[k].as_ptr(), |c| c.as_slice().as_ptr());
    for out in std::iter::once(&mut *param_out).chain(states_out.iter_mut()) {
        match dtype {
            DType::F64 => drop(crate::view_mut::<f64>(out)?),
            _ => drop(crate::view_mut::<f32>(out)?),
        }
    }
    let mut t = TensorUpdate {
        len: bytes / dtype.size(),
        param: input(0),
        grad: input(1),
        states: [std::ptr::null(); 2],
        param_out: param_out.as_mut_ptr(),
        states_out: [std::ptr::null_mut(); 2],
    };
    for (k, out) in states_out.iter_mut().enumerate() {
        t.states[k] = input(2 + k);
        t.states_out[k] = out.as_mut_ptr();
    }
    // SAFETY: every buffer holds `len` elements (checked above) and is aligned; the outputs
    // are distinct `&mut` slices, so they overlap no input.
    unsafe { update(optimizer, dtype, scalars, &t) }
}

/// A multi-tensor step kernel (`autotp-llvm` emits it for the CPU and for GPUs): an update
/// rule over parameters of one element type.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct OptimizerKernel {
    pub optimizer: Optimizer,
    /// `f32` or `f64`.
    pub dtype: DType,
}

impl OptimizerKernel {
    /// The PTX entry point: `autotp_multi_tensor_adamw_f32`, and for SGD the parts of the rule
    /// that the kernel applies (`autotp_multi_tensor_sgd_f32_wd_momentum_nesterov`).
    pub fn entry_name(&self) -> String {
        let mut name = format!("autotp_{}_{}", self.optimizer.multi_tensor_name(), self.dtype);
        if let Optimizer::Sgd(c) = &self.optimizer {
            for (part, applies) in [("wd", c.weight_decay != 0.0), ("momentum", c.momentum != 0.0)] {
                if applies {
                    name = format!("{name}_{part}");
                }
            }
            if c.nesterov && c.momentum != 0.0 {
                name.push_str("_nesterov");
            }
        }
        name
    }
}

#[cfg(test)]
mod tests {
    use super::power;

    /// Repeated squaring is exact where the power is representable, within `exponent` ulps of
    /// the exact power elsewhere (each squaring doubles the relative error so far), and the
    /// bias corrections it gives round to the same f32 as a libm `pow`'s over the steps of a
    /// run.
    #[test]
    fn power_by_squaring_is_the_power() {
        assert_eq!(power(0.9, 0), 1.0);
        assert_eq!(power(2.0, 10), 1024.0);
        assert_eq!(power(0.5, 1074), f64::from_bits(1), "the smallest subnormal");
        for (base, exponent) in [(0.9f64, 1u64), (0.9, 3), (0.999, 1000), (0.9999, 123_457), (0.99999, 1 << 23)] {
            let exact = base.powf(exponent as f64);
            let error = (power(base, exponent) - exact).abs() / exact;
            assert!(error < exponent as f64 * f64::EPSILON, "{base}^{exponent}: relative error {error:e}");
        }
        for base in [0.9f64, 0.95, 0.999] {
            for t in 1..=20_000 {
                let (squared, pow) = (1.0 - power(base, t), 1.0 - base.powf(t as f64));
                assert_eq!(squared as f32, pow as f32, "1 - {base}^{t}");
                assert_eq!(squared.sqrt() as f32, pow.sqrt() as f32, "sqrt(1 - {base}^{t})");
            }
        }
    }
}
