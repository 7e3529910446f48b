//! Loss scaling for fp16 training: the scale the loss is multiplied by before the backward, and
//! how it moves when the reduced gradients overflow (hold an inf or NaN), with the exact rules
//! of the two scalers users come with. The trainer (with `--precision fp16`, to come) asks
//! [`LossScaler::scale`] before a step, decides overflow across all ranks, skips the optimizer
//! step and the learning-rate schedule on overflow, and calls [`LossScaler::update`].
//!
//! - [`LossScaler::DeepSpeed`]: DeepSpeed's `DynamicLossScaler.update_scale` (its ZeRO
//!   optimizers), keys of its `fp16` config: `initial_scale_power` (2^16), `loss_scale_window`
//!   (1000), `hysteresis` (2, its `delayed_shift`), `consecutive_hysteresis` (false),
//!   `min_loss_scale` (1), factor 2. An overflow halves the scale only once `hysteresis`
//!   overflows have used up the hysteresis (an overflow at the floor is an error, as DeepSpeed
//!   raises); the scale doubles after `window` clean steps since the last overflow, refilling
//!   the hysteresis (with `consecutive_hysteresis`, every clean step refills it).
//! - [`LossScaler::Torch`]: `torch.amp.GradScaler` (`--loss-scaler torch`): init 2^16, growth 2,
//!   backoff 0.5, growth interval 2000; every overflow backs off (no floor, no hysteresis) and
//!   restarts the count; the interval-th consecutive clean step grows the scale, if the result
//!   is finite.
//! - [`LossScaler::Static`]: DeepSpeed's `loss_scale` > 0: a fixed scale; an overflow still
//!   skips the step.
//!
//! The state is plain data (serde), so checkpoints carry it. Tests: the traces of
//! tests/fixtures/loss_scale/ (DeepSpeed's `update_scale` transcribed, torch's real
//! `GradScaler` under injected infs), tests/precision.rs.

use serde::{Deserialize, Serialize};

/// A loss scaler and its state.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum LossScaler {
    Static { scale: f64 },
    DeepSpeed(DeepSpeedScaler),
    Torch(TorchScaler),
}

/// DeepSpeed's `DynamicLossScaler` (field names as its attributes).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DeepSpeedScaler {
    pub cur_scale: f64,
    pub cur_iter: u64,
    /// `None` before the first overflow (DeepSpeed's -1).
    pub last_overflow_iter: Option<u64>,
    pub scale_factor: f64,
    pub scale_window: u64,
    pub min_scale: f64,
    pub delayed_shift: u32,
    pub cur_hysteresis: u32,
    pub consecutive_hysteresis: bool,
}

/// `torch.amp.GradScaler`'s scale and growth tracker.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TorchScaler {
    pub scale: f64,
    pub growth_factor: f64,
    pub backoff_factor: f64,
    pub growth_interval: u64,
    pub growth_tracker: u64,
}

/// An overflow the scaler cannot back off from.
#[derive(Debug, thiserror::Error, PartialEq)]
#[error("the gradients overflowed with the loss scale already at its minimum, {min_scale}: fp16 cannot train this model at this learning rate (DeepSpeed stops here too)")]
pub struct ScaleAtMinimum {
    pub min_scale: f64,
}

impl DeepSpeedScaler {
    /// DeepSpeed's defaults for a dynamic `fp16` config: scale 2^16, window 1000, hysteresis 2,
    /// no consecutive hysteresis, floor 1.
    pub fn deepspeed_defaults() -> DeepSpeedScaler {
        DeepSpeedScaler::new(16, 1000, 2, false, 1.0)
    }

    /// A scaler from DeepSpeed's `fp16` keys.
    pub fn new(
        initial_scale_power: u32,
        loss_scale_window: u64,
        hysteresis: u32,
        consecutive_hysteresis: bool,
        min_loss_scale: f64,
    ) -> DeepSpeedScaler {
        DeepSpeedScaler {
            cur_scale: 2f64.powi(initial_scale_power as i32),
            cur_iter: 0,
            last_overflow_iter: None,
            scale_factor: 2.0,
            scale_window: loss_scale_window,
            min_scale: min_loss_scale,
            delayed_shift: hysteresis,
            cur_hysteresis: hysteresis,
            consecutive_hysteresis,
        }
    }

    fn update(&mut self, overflow: bool) -> Result<(), ScaleAtMinimum> {
        if overflow {
            if self.delayed_shift == 1 || self.cur_hysteresis == 1 {
                if self.cur_scale == self.min_scale {
                    return Err(ScaleAtMinimum { min_scale: self.min_scale });
                }
                self.cur_scale = (self.cur_scale / self.scale_factor).max(self.min_scale);
            } else {
                self.cur_hysteresis -= 1;
            }
            self.last_overflow_iter = Some(self.cur_iter);
        } else {
            if self.consecutive_hysteresis {
                self.cur_hysteresis = self.delayed_shift;
            }
            // DeepSpeed's `(cur_iter - last_overflow_iter) - 1`, with -1 before any overflow.
            let stable = match self.last_overflow_iter {
                Some(last) => self.cur_iter - last - 1,
                None => self.cur_iter,
            };
            if stable > 0 && stable % self.scale_window == 0 {
                if !self.consecutive_hysteresis {
                    self.cur_hysteresis = self.delayed_shift;
                }
                self.cur_scale *= self.scale_factor;
            }
        }
        self.cur_iter += 1;
        Ok(())
    }
}

impl TorchScaler {
    /// `torch.amp.GradScaler()`'s defaults.
    pub fn torch_defaults() -> TorchScaler {
        TorchScaler {
            scale: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
            growth_tracker: 0,
        }
    }

    fn update(&mut self, overflow: bool) {
        if overflow {
            self.scale *= self.backoff_factor;
            self.growth_tracker = 0;
            return;
        }
        let successful = self.growth_tracker + 1;
        if successful == self.growth_interval {
            let grown = self.scale * self.growth_factor;
            // torch computes the scale in f32 and grows it only to a finite value.
            if (grown as f32).is_finite() {
                self.scale = grown;
            }
            self.growth_tracker = 0;
        } else {
            self.growth_tracker = successful;
        }
    }
}

impl LossScaler {
    /// The scale the next step's loss is multiplied by.
    pub fn scale(&self) -> f64 {
        match self {
            LossScaler::Static { scale } => *scale,
            LossScaler::DeepSpeed(s) => s.cur_scale,
            LossScaler::Torch(s) => s.scale,
        }
    }

    /// Moves the scale after a step whose reduced gradients did (`overflow`) or did not hold an
    /// inf or NaN; the caller skips an overflowed step's update.
    pub fn update(&mut self, overflow: bool) -> Result<(), ScaleAtMinimum> {
        match self {
            LossScaler::Static { .. } => Ok(()),
            LossScaler::DeepSpeed(s) => s.update(overflow),
            LossScaler::Torch(s) => {
                s.update(overflow);
                Ok(())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Scales after each update of `pattern` (true: overflow).
    fn trace(mut scaler: LossScaler, pattern: &[bool]) -> Vec<f64> {
        pattern.iter().map(|&o| scaler.update(o).map(|_| scaler.scale()).unwrap()).collect()
    }

    #[test]
    fn deepspeed_hysteresis_keeps_the_scale_for_the_first_overflow() {
        let scaler = LossScaler::DeepSpeed(DeepSpeedScaler::new(4, 3, 2, false, 1.0));
        // 16: the first overflow spends the hysteresis, the second halves; the fourth clean
        // step after it (window + 1) doubles and refills, then two overflows halve once.
        let got = trace(scaler, &[true, true, false, false, false, false, true, true, false]);
        assert_eq!(got, [16.0, 8.0, 8.0, 8.0, 8.0, 16.0, 16.0, 8.0, 8.0]);
    }

    #[test]
    fn deepspeed_grows_on_the_window_plus_first_clean_step_and_stops_at_the_floor() {
        let scaler = LossScaler::DeepSpeed(DeepSpeedScaler::new(1, 2, 1, false, 1.0));
        // No overflow yet: stable = cur_iter, so the update at cur_iter 2 (the third) doubles.
        assert_eq!(trace(scaler.clone(), &[false, false, false, false, false]), [2.0, 2.0, 4.0, 4.0, 8.0]);
        let mut scaler = scaler;
        scaler.update(true).unwrap();
        assert_eq!(scaler.scale(), 1.0);
        assert_eq!(scaler.update(true), Err(ScaleAtMinimum { min_scale: 1.0 }));
    }

    #[test]
    fn torch_backs_off_every_overflow_and_grows_on_the_interval_th_clean_step() {
        let scaler = LossScaler::Torch(TorchScaler { growth_interval: 2, ..TorchScaler::torch_defaults() });
        let got = trace(scaler, &[true, true, false, false, false, true, false, false]);
        assert_eq!(got, [32768.0, 16384.0, 16384.0, 32768.0, 32768.0, 16384.0, 16384.0, 32768.0]);
    }

    #[test]
    fn the_state_round_trips_through_json() {
        let mut scaler = LossScaler::DeepSpeed(DeepSpeedScaler::deepspeed_defaults());
        scaler.update(true).unwrap();
        let json = serde_json::to_string(&scaler).unwrap();
        assert_eq!(serde_json::from_str::<LossScaler>(&json).unwrap(), scaler);
    }
}
