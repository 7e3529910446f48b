//! A timeline of a rank's steps (`autotp run --trace FILE.json`): what each of its streams ran
//! and when, as Chrome's Trace Event Format, which Perfetto (ui.perfetto.dev) and
//! chrome://tracing open.
//!
//! A CPU rank records a [`Span`] per instruction its compute and peer streams run (kernels,
//! GEMMs, blocking collectives, pipeline sends, receives with the time they waited for their
//! message, optimizer steps), per collective its communication thread runs (from when the
//! thread took it up to when every rank's part was in), and per wait of a stream for the
//! collectives it depends on. Times are wall-clock nanoseconds, so the spans of several
//! processes of one machine line up. `autotp_train::trace` writes them as a Chrome trace.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use autotp_program::Instruction;

use crate::streams::Stream;

/// One interval of a rank's timeline.
#[derive(Clone, Debug, PartialEq)]
pub struct Span {
    /// The stream's lane: `compute`, `collectives`, `peer`.
    pub lane: String,
    /// The IR op (`matmul`, `all_reduce`, `recv`...) or `wait`.
    pub name: String,
    /// `kernel`, `generated`, `gemm`, `collective`, `send`, `recv`, `wait`, `optimizer`.
    pub category: String,
    /// The instruction's label (`node 12 (matmul)`), or what a wait waited for.
    pub label: String,
    /// Nanoseconds since the Unix epoch.
    pub start_ns: u64,
    pub duration_ns: u64,
}

/// A clock that turns the monotonic instants of one process into wall-clock nanoseconds.
#[derive(Clone, Copy, Debug)]
pub struct TraceClock {
    instant: Instant,
    wall_ns: u64,
}

impl TraceClock {
    pub fn now() -> TraceClock {
        let wall = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or(Duration::ZERO);
        TraceClock { instant: Instant::now(), wall_ns: nanos(wall) }
    }

    /// `at` in nanoseconds since the Unix epoch.
    pub fn nanos(&self, at: Instant) -> u64 {
        match at.checked_duration_since(self.instant) {
            Some(after) => self.wall_ns.saturating_add(nanos(after)),
            None => self.wall_ns.saturating_sub(nanos(self.instant.duration_since(at))),
        }
    }

    /// The span from `start` to `end`.
    pub fn span(
        &self,
        lane: Stream,
        name: String,
        category: &str,
        label: String,
        start: Instant,
        end: Instant,
    ) -> Span {
        Span {
            lane: lane_name(lane).to_string(),
            name,
            category: category.to_string(),
            label,
            start_ns: self.nanos(start),
            duration_ns: nanos(end.saturating_duration_since(start)),
        }
    }

    /// The span of `instruction`, run on `lane` from `start` to `end`.
    pub fn instruction(&self, lane: Stream, instruction: &Instruction, start: Instant, end: Instant) -> Span {
        let label = instruction.label().to_string();
        self.span(lane, op_of(&label), category(instruction), label, start, end)
    }
}

fn nanos(duration: Duration) -> u64 {
    u64::try_from(duration.as_nanos()).unwrap_or(u64::MAX)
}

fn lane_name(stream: Stream) -> &'static str {
    match stream {
        Stream::Compute => "compute",
        Stream::Collectives => "collectives",
        Stream::Peer => "peer",
        Stream::Transfer => "transfer",
    }
}

/// The IR op of a label `node N (%3 = op)` or `fusion F, nodes A..B (fused:...)`, or the label.
pub fn op_of(label: &str) -> String {
    let within = label.rsplit_once('(').and_then(|(_, op)| op.strip_suffix(')')).unwrap_or(label);
    within.rsplit_once(" = ").map_or(within, |(_, op)| op).to_string()
}

fn category(instruction: &Instruction) -> &'static str {
    match instruction {
        Instruction::Kernel { kernel, .. } if kernel.name().contains("matmul") => "gemm",
        Instruction::Kernel { .. } => "kernel",
        Instruction::Generated { .. } => "generated",
        Instruction::Collective { .. } | Instruction::CollectiveStart { .. } => "collective",
        Instruction::Wait { .. } => "wait",
        Instruction::Send { .. } => "send",
        Instruction::Recv { .. } => "recv",
        Instruction::OptimizerStep { .. } => "optimizer",
    }
}

#[cfg(test)]
mod tests {
    use super::op_of;

    #[test]
    fn the_op_of_a_label() {
        assert_eq!(op_of("node 136 (%201 = add)"), "add");
        assert_eq!(op_of("node 7 (%3, %4 = split)"), "split");
        assert_eq!(op_of("fusion f3, nodes 10..14 (fused:add+mul)"), "fused:add+mul");
        assert_eq!(op_of("memcpy"), "memcpy");
    }
}
