//! Learning-rate schedules, computed on the host and fed to the step's `lr` input.
//!
//! `WarmupCosine` follows Hugging Face's `get_cosine_schedule_with_warmup` (the schedule most
//! users bring): at optimizer step `s` (0-based), `lr = base * s / warmup` while `s < warmup`,
//! then `min + (base - min) * 0.5 * (1 + cos(pi * (s - warmup) / (total - warmup)))`; with
//! `min = 0` it is exactly Hugging Face's. `total` is `decay_steps` when the plan fixes it,
//! otherwise the run's `--steps` (as Megatron's `--lr-decay-iters` defaults to `--train-iters`).
//!
//! `DeepSpeedWarmup` and `DeepSpeedWarmupCosine` are DeepSpeed's `WarmupLR`/`WarmupDecayLR` and
//! `WarmupCosineLR` (deepspeed/runtime/lr_schedules.py), step for step: DeepSpeed steps its
//! scheduler after each optimizer step, so optimizer step `s` runs at the scheduler's
//! `last_batch_iteration = s - 1` (the first at -1: `WarmupLR` gives its minimum there,
//! `WarmupCosineLR` 0); warmup lasts at least 2 iterations, log (`ln(i + 1) / ln(warmup)`, the
//! default) or linear (`i / warmup`).

use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum LrSchedule {
    Constant {
        lr: f64,
    },
    WarmupCosine {
        lr: f64,
        warmup_steps: usize,
        decay_steps: Option<usize>,
        min_lr: f64,
    },
    /// `WarmupLR` (`total_steps: None`: the maximum after the warmup) or `WarmupDecayLR`
    /// (then linearly down to 0 at `total_steps`).
    DeepSpeedWarmup {
        min_lr: f64,
        max_lr: f64,
        warmup_steps: usize,
        log_warmup: bool,
        total_steps: Option<usize>,
    },
    /// `WarmupCosineLR`: ratios of `lr`, from `warmup_min_ratio` to 1, then a cosine down to
    /// `cos_min_ratio` at `total_steps`.
    DeepSpeedWarmupCosine {
        lr: f64,
        total_steps: usize,
        warmup_min_ratio: f64,
        warmup_steps: usize,
        cos_min_ratio: f64,
        log_warmup: bool,
    },
}

/// DeepSpeed's warmup fraction at scheduler iteration `i` (0 ≤ i < warmup).
fn deepspeed_warmup(i: i64, warmup: usize, log: bool) -> f64 {
    match log {
        true => ((i + 1) as f64).ln() / (warmup as f64).ln(),
        false => i as f64 / warmup as f64,
    }
}

impl LrSchedule {
    /// The learning rate of optimizer step `step` (0-based) in a run of `train_steps` steps.
    pub fn lr(&self, step: usize, train_steps: usize) -> f64 {
        match *self {
            LrSchedule::Constant { lr } => lr,
            LrSchedule::WarmupCosine { lr, warmup_steps, decay_steps, min_lr } => {
                let total_steps = decay_steps.unwrap_or(train_steps);
                if step < warmup_steps {
                    return lr * step as f64 / warmup_steps.max(1) as f64;
                }
                let progress = (step - warmup_steps) as f64 / total_steps.saturating_sub(warmup_steps).max(1) as f64;
                let cosine = 0.5 * (1.0 + (std::f64::consts::PI * progress.min(1.0)).cos());
                min_lr + (lr - min_lr) * cosine
            }
            LrSchedule::DeepSpeedWarmup { min_lr, max_lr, warmup_steps, log_warmup, total_steps } => {
                let i = step as i64 - 1;
                let warmup = warmup_steps.max(2);
                let gamma = match total_steps {
                    _ if i < 0 => 0.0,
                    _ if i < warmup as i64 => deepspeed_warmup(i, warmup, log_warmup),
                    None => 1.0,
                    Some(total) => ((total as f64 - i as f64) / (total as f64 - warmup as f64).max(1.0)).max(0.0),
                };
                min_lr + (max_lr - min_lr) * gamma
            }
            LrSchedule::DeepSpeedWarmupCosine {
                lr,
                total_steps,
                warmup_min_ratio,
                warmup_steps,
                cos_min_ratio,
                log_warmup,
            } => {
                let i = step as i64 - 1;
                let warmup = warmup_steps.max(2);
                let ratio = if i < 0 {
                    0.0
                } else if i < warmup as i64 {
                    warmup_min_ratio + deepspeed_warmup(i, warmup, log_warmup) * (1.0 - warmup_min_ratio)
                } else {
                    let progress =
                        ((i - warmup as i64 + 1) as f64 / total_steps.saturating_sub(warmup).max(1) as f64).min(1.0);
                    let cosine = (1.0 + (std::f64::consts::PI * progress).cos()) / 2.0;
                    (cos_min_ratio + (1.0 - cos_min_ratio) * cosine).max(0.0)
                };
                lr * ratio
            }
        }
    }
}

impl std::fmt::Display for LrSchedule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match *self {
            LrSchedule::Constant { lr } => write!(f, "constant {lr:e}"),
            LrSchedule::WarmupCosine { lr, warmup_steps, decay_steps, min_lr } => {
                let over = decay_steps.map(|s| format!("{s} steps")).unwrap_or_else(|| "the run".into());
                write!(f, "cosine {lr:e} (warmup {warmup_steps} steps, decay to {min_lr:e} over {over})")
            }
            LrSchedule::DeepSpeedWarmup { min_lr, max_lr, warmup_steps, log_warmup, total_steps } => {
                let kind = if log_warmup { "log" } else { "linear" };
                write!(f, "DeepSpeed warmup {min_lr:e} to {max_lr:e} ({kind}, {warmup_steps} steps)")?;
                match total_steps {
                    Some(total) => write!(f, ", linear decay to 0 at step {total}"),
                    None => Ok(()),
                }
            }
            LrSchedule::DeepSpeedWarmupCosine {
                lr,
                total_steps,
                warmup_min_ratio,
                warmup_steps,
                cos_min_ratio,
                log_warmup,
            } => {
                let kind = if log_warmup { "log" } else { "linear" };
                write!(
                    f,
                    "DeepSpeed warmup-cosine {lr:e} (x{warmup_min_ratio} to x1 {kind} over {warmup_steps} steps, cosine to \
                     x{cos_min_ratio} at step {total_steps})"
                )
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warmup_then_cosine() {
        let s = LrSchedule::WarmupCosine { lr: 1.0, warmup_steps: 4, decay_steps: None, min_lr: 0.0 };
        let lrs: Vec<f64> = (0..=12).map(|i| s.lr(i, 12)).collect();
        assert_eq!(&lrs[..5], &[0.0, 0.25, 0.5, 0.75, 1.0]);
        assert!((lrs[8] - 0.5).abs() < 1e-12, "half way through the decay: {}", lrs[8]);
        assert!(lrs[12].abs() < 1e-12);
        assert!(lrs.windows(2).skip(4).all(|w| w[1] <= w[0]), "decays monotonically: {lrs:?}");
        let floored = LrSchedule::WarmupCosine { lr: 1.0, warmup_steps: 0, decay_steps: Some(10), min_lr: 0.1 };
        assert!((floored.lr(10, 1000) - 0.1).abs() < 1e-12, "decay_steps overrides the run's length");
        assert!((floored.lr(0, 1000) - 1.0).abs() < 1e-12);
        assert_eq!(LrSchedule::Constant { lr: 3e-4 }.lr(1000, 10), 3e-4);
    }

    /// The learning rates of optimizer steps 0..15 under DeepSpeed's schedulers, from a Python
    /// transcription of deepspeed/runtime/lr_schedules.py (deepspeedai/DeepSpeed 22779f2)
    /// stepped as its engine steps them (after each optimizer step, from iteration -1).
    #[test]
    fn deepspeed_schedules_step_as_deepspeed_steps_them() {
        let cases = [
            (
                LrSchedule::DeepSpeedWarmup {
                    min_lr: 1e-5,
                    max_lr: 1e-3,
                    warmup_steps: 5,
                    log_warmup: true,
                    total_steps: None,
                },
                vec![1e-05, 1e-05, 0.00043636979249265915, 0.0006857801325411255, 0.0008627395849853183, 0.001],
            ),
            (
                LrSchedule::DeepSpeedWarmup {
                    min_lr: 0.0,
                    max_lr: 1e-3,
                    warmup_steps: 4,
                    log_warmup: false,
                    total_steps: Some(10),
                },
                vec![
                    0.0,
                    0.0,
                    0.00025,
                    0.0005,
                    0.00075,
                    0.001,
                    0.0008333333333333334,
                    0.0006666666666666666,
                    0.0005,
                    0.0003333333333333333,
                    0.00016666666666666666,
                    0.0,
                    0.0,
                ],
            ),
            (
                LrSchedule::DeepSpeedWarmupCosine {
                    lr: 1e-3,
                    total_steps: 12,
                    warmup_min_ratio: 0.1,
                    warmup_steps: 4,
                    cos_min_ratio: 0.01,
                    log_warmup: true,
                },
                vec![
                    0.0,
                    0.0001,
                    0.00055,
                    0.0008132331253245203,
                    0.001,
                    0.000962320368593087,
                    0.000855017856687341,
                    0.0006944282990207195,
                    0.000505,
                    0.0003155717009792806,
                    0.00015498214331265904,
                    4.7679631406913064e-05,
                    1e-05,
                    1e-05,
                    1e-05,
                ],
            ),
        ];
        for (schedule, want) in cases {
            let got: Vec<f64> = (0..want.len()).map(|s| schedule.lr(s, 1000)).collect();
            for (s, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!((g - w).abs() <= 1e-15 * w.abs().max(1e-3), "{schedule}: step {s}: {g} against {w}");
            }
        }
    }
}
