//! Learning-rate schedules, computed on the host and fed to the step's `lr` input.
//!
//! `WarmupCosine` follows Hugging Face's `get_cosine_schedule_with_warmup` (the schedule most
//! users bring): at optimizer step `s` (0-based), `lr = base * s / warmup` while `s < warmup`,
//! then `min + (base - min) * 0.5 * (1 + cos(pi * (s - warmup) / (total - warmup)))`; with
//! `min = 0` it is exactly Hugging Face's. `total` is `decay_steps` when the plan fixes it,
//! otherwise the run's `--steps` (as Megatron's `--lr-decay-iters` defaults to `--train-iters`).

use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Schedule {
    Constant { lr: f64 },
    WarmupCosine { lr: f64, warmup_steps: usize, decay_steps: Option<usize>, min_lr: f64 },
}

impl Schedule {
    /// The learning rate of optimizer step `step` (0-based) in a run of `train_steps` steps.
    pub fn lr(&self, step: usize, train_steps: usize) -> f64 {
        match *self {
            Schedule::Constant { lr } => lr,
            Schedule::WarmupCosine { lr, warmup_steps, decay_steps, min_lr } => {
                let total_steps = decay_steps.unwrap_or(train_steps);
                if step < warmup_steps {
                    return lr * step as f64 / warmup_steps.max(1) as f64;
                }
                let progress = (step - warmup_steps) as f64 / total_steps.saturating_sub(warmup_steps).max(1) as f64;
                let cosine = 0.5 * (1.0 + (std::f64::consts::PI * progress.min(1.0)).cos());
                min_lr + (lr - min_lr) * cosine
            }
        }
    }
}

impl std::fmt::Display for Schedule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match *self {
            Schedule::Constant { lr } => write!(f, "constant {lr:e}"),
            Schedule::WarmupCosine { lr, warmup_steps, decay_steps, min_lr } => {
                let over = decay_steps.map(|s| format!("{s} steps")).unwrap_or_else(|| "the run".into());
                write!(f, "cosine {lr:e} (warmup {warmup_steps} steps, decay to {min_lr:e} over {over})")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warmup_then_cosine() {
        let s = Schedule::WarmupCosine { lr: 1.0, warmup_steps: 4, decay_steps: None, min_lr: 0.0 };
        let lrs: Vec<f64> = (0..=12).map(|i| s.lr(i, 12)).collect();
        assert_eq!(&lrs[..5], &[0.0, 0.25, 0.5, 0.75, 1.0]);
        assert!((lrs[8] - 0.5).abs() < 1e-12, "half way through the decay: {}", lrs[8]);
        assert!(lrs[12].abs() < 1e-12);
        assert!(lrs.windows(2).skip(4).all(|w| w[1] <= w[0]), "decays monotonically: {lrs:?}");
        let floored = Schedule::WarmupCosine { lr: 1.0, warmup_steps: 0, decay_steps: Some(10), min_lr: 0.1 };
        assert!((floored.lr(10, 1000) - 0.1).abs() < 1e-12, "decay_steps overrides the run's length");
        assert!((floored.lr(0, 1000) - 1.0).abs() < 1e-12);
        assert_eq!(Schedule::Constant { lr: 3e-4 }.lr(1000, 10), 3e-4);
    }
}
