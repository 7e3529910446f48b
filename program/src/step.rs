//! The training step's contract between the compiler and the trainer: the inputs the trainer
//! feeds and the outputs it reads, by the names the step's program gives their slots. The
//! passes that add them (`loss`, `optimize`, `precision`) and the trainer name them through
//! these enums, never through strings of their own.

/// An input of the training step, fed by the trainer each step.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum StepInput {
    /// The window's first `seq_len` tokens, `i64`.
    InputIds,
    /// The next tokens (or the input ids for a model with its own loss), `i64`.
    Labels,
    /// The learning rate of this step, an `f32` scalar.
    Lr,
    /// The 1-based optimizer step (AdamW's bias correction), an `f32` scalar.
    Step,
    /// fp16's loss scale of this step, an `f32` scalar.
    LossScale,
}

impl StepInput {
    pub const ALL: [StepInput; 5] =
        [StepInput::InputIds, StepInput::Labels, StepInput::Lr, StepInput::Step, StepInput::LossScale];

    /// The slot's name in the step's program (and the graph input's in the IR).
    pub const fn name(self) -> &'static str {
        match self {
            StepInput::InputIds => "input_ids",
            StepInput::Labels => "labels",
            StepInput::Lr => "lr",
            StepInput::Step => "step",
            StepInput::LossScale => "loss_scale",
        }
    }

    pub fn from_name(name: &str) -> Option<StepInput> {
        Self::ALL.into_iter().find(|input| input.name() == name)
    }

    /// Whether it is a batch of tokens, split over the data-parallel ranks and micro-batches.
    pub fn is_tokens(self) -> bool {
        matches!(self, StepInput::InputIds | StepInput::Labels)
    }
}

/// An output of the training step that the trainer reads.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum StepOutput {
    /// The global batch's mean loss, an `f32` scalar.
    Loss,
    /// Whether the reduced gradients held an inf or NaN (mixed precision skips that step), a
    /// `bool` scalar.
    Overflow,
    /// The gradients' global norm before clipping (`--grad-clip`), an `f32` scalar.
    GradNorm,
}

impl StepOutput {
    /// The slot's name in the step's program (and the graph output's in the IR).
    pub const fn name(self) -> &'static str {
        match self {
            StepOutput::Loss => "loss",
            StepOutput::Overflow => "overflow",
            StepOutput::GradNorm => "grad_norm",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for input in StepInput::ALL {
            assert_eq!(StepInput::from_name(input.name()), Some(input));
        }
        assert_eq!(StepInput::from_name("attention_mask"), None);
    }
}
