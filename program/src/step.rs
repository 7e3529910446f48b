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

/// The order in which a step's token inputs hold each sequence's positions.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SequenceOrder {
    /// Position by position.
    #[default]
    Natural,
    /// Megatron's load balance for context parallelism over `cp` ranks: the sequence cut into
    /// `2 cp` chunks, rank `r`'s block of the order holding chunks `r` and `2 cp - 1 - r`, so
    /// that under a causal mask every rank's queries meet as many keys.
    LoadBalanced { cp: usize },
}

impl SequenceOrder {
    /// The position each slot of a sequence of `seq_len` holds; `None` where the order cannot
    /// cut it (`seq_len` not a multiple of `2 cp`).
    pub fn positions(self, seq_len: usize) -> Option<Vec<usize>> {
        match self {
            SequenceOrder::Natural => Some((0..seq_len).collect()),
            SequenceOrder::LoadBalanced { cp } => {
                let chunks = 2 * cp;
                if cp == 0 || !seq_len.is_multiple_of(chunks) {
                    return None;
                }
                let chunk = seq_len / chunks;
                let chunk_at = |slot: usize| if slot.is_multiple_of(2) { slot / 2 } else { chunks - 1 - slot / 2 };
                Some((0..seq_len).map(|i| chunk_at(i / chunk) * chunk + i % chunk).collect())
            }
        }
    }

    /// `tokens` (whole sequences of `seq_len`, one after another) in this order: as they are
    /// in the natural one.
    pub fn arrange<T: Copy>(self, tokens: &[T], seq_len: usize) -> Option<std::borrow::Cow<'_, [T]>> {
        if seq_len == 0 || !tokens.len().is_multiple_of(seq_len) {
            return None;
        }
        if self == SequenceOrder::Natural {
            return Some(std::borrow::Cow::Borrowed(tokens));
        }
        let positions = self.positions(seq_len)?;
        let sequences = tokens.chunks_exact(seq_len).map(|s| positions.iter().map(move |&p| s[p]));
        Some(std::borrow::Cow::Owned(sequences.flatten().collect()))
    }

    /// Each of the `cp` ranks' query-key pairs under a causal mask, per sequence and head: what
    /// its attention computes when each rank holds its contiguous block of the order.
    pub fn causal_pairs_per_rank(self, seq_len: usize, cp: usize) -> Option<Vec<u64>> {
        let positions = self.positions(seq_len)?;
        if cp == 0 || !seq_len.is_multiple_of(cp) {
            return None;
        }
        let block = seq_len / cp;
        Some(positions.chunks(block).map(|queries| queries.iter().map(|&p| p as u64 + 1).sum()).collect())
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

    #[test]
    fn load_balanced_order_gives_rank_r_chunks_r_and_2cp_minus_1_minus_r() {
        let order = SequenceOrder::LoadBalanced { cp: 2 };
        assert_eq!(order.positions(8), Some(vec![0, 1, 6, 7, 2, 3, 4, 5]));
        assert_eq!(order.positions(6), None);
        let arranged = order.arrange(&[10, 11, 12, 13, 20, 21, 22, 23], 4).map(|a| a.into_owned());
        assert_eq!(arranged, Some(vec![10, 13, 11, 12, 20, 23, 21, 22]));
        assert_eq!(SequenceOrder::Natural.arrange(&[1, 2, 3], 3).as_deref(), Some(&[1, 2, 3][..]));
        assert_eq!(SequenceOrder::Natural.arrange(&[1, 2, 3], 2), None);
        // Causal work: 1 + 2 + .. per query. Contiguous blocks of 16 over 4 ranks are unequal;
        // the balanced order gives every rank the same.
        let natural = SequenceOrder::Natural.causal_pairs_per_rank(16, 4).unwrap();
        assert_eq!(natural, vec![10, 26, 42, 58]);
        let balanced = SequenceOrder::LoadBalanced { cp: 4 }.causal_pairs_per_rank(16, 4).unwrap();
        assert_eq!(balanced, vec![34, 34, 34, 34]);
    }
}
