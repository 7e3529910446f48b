//! `--cuda-graph`: a device's steps after the first as one CUDA graph. The first step runs as
//! usual (cuBLAS and NCCL set themselves up outside any capture), the second is captured
//! ([`super::Gpu::begin_capture`] ... [`super::Gpu::end_capture`]) and replayed, and every later step is the
//! replay alone: the host issues one launch per step. A program whose step copies through the
//! host or waits on it cannot be one graph ([`capture_blocker`]); asking for it is refused.

use autotp_kernels::Kernel;
use autotp_program::{Instruction, Program};

use super::{ChunkTable, CommPath, GpuDevice, Prepared};
use crate::streams::Device;
use crate::RuntimeError;

/// Why `--profile` and `--cuda-graph` do not go together.
const PROFILE_IN_GRAPH: &str =
    "--profile times each instruction between CUDA events, which a step replayed as a CUDA graph has not: drop \
     --cuda-graph to profile";

/// Where a device stands with `--cuda-graph`: off; the first step running as usual (cuBLAS and
/// NCCL set themselves up outside any capture); the next captured as a graph and replayed;
/// then every step the graph's replay.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum StepGraph {
    Off,
    Warming,
    Capture,
    Replay(usize),
}

/// Why a program's step cannot be one CUDA graph: the first instruction that copies through the
/// host or waits on it (a graph holds device work alone).
pub(super) fn capture_blocker(program: &Program, prepared: &[Prepared], paths: &[CommPath]) -> Option<String> {
    program.instructions.iter().zip(prepared).enumerate().find_map(|(i, (instruction, prepared))| {
        let label = instruction.label();
        let why = match (instruction, prepared) {
            (Instruction::Kernel { kernel: Kernel::Copy, .. }, _) => return None,
            (Instruction::Kernel { .. }, Prepared::Nothing) => "runs on the host".to_string(),
            (Instruction::Collective { op, .. } | Instruction::CollectiveStart { op, .. }, Prepared::Nothing) => {
                match paths.get(op.axis) {
                    Some(CommPath::Host { why }) => format!("communicates through host memory ({why})"),
                    _ => "communicates through host memory".to_string(),
                }
            }
            (Instruction::Send { .. } | Instruction::Recv { .. }, Prepared::Nothing) => {
                "is a pipeline message through host memory".to_string()
            }
            (Instruction::Send { .. } | Instruction::Recv { .. }, _) => {
                "is a pipeline message over NCCL, whose wait is timed (for the stages' idle shares) by events \
                 that a graph does not hold"
                    .to_string()
            }
            (_, Prepared::OptimizerStep(ChunkTable { offloaded: Some(_), .. })) => {
                "updates offloaded optimizer state on the host".to_string()
            }
            (_, Prepared::Collective { fetched: Some(_), .. }) => {
                "uploads an offloaded parameter shard from host memory first".to_string()
            }
            _ => return None,
        };
        Some(format!("instruction {i} ({label}) {why}"))
    })
}

impl GpuDevice {
    /// Times each instruction of its steps from now on (`--profile`), with a pair of timed events
    /// around it; refused for steps run as a CUDA graph, which replays without them.
    pub(crate) fn enable_profile(&mut self, instructions: usize) -> Result<(), RuntimeError> {
        if self.graph != StepGraph::Off {
            return Err(RuntimeError::InvalidProgram(PROFILE_IN_GRAPH.into()));
        }
        self.profile = Some(vec![std::time::Duration::ZERO; instructions]);
        Ok(())
    }

    /// Runs steps as a CUDA graph from now on (see [`StepGraph`]); refused, naming the first
    /// instruction that needs the host, where a step cannot be one.
    pub(crate) fn use_graph(&mut self) -> Result<(), RuntimeError> {
        if let Some(why) = &self.capture_blocker {
            return Err(RuntimeError::InvalidProgram(format!("--cuda-graph: a step cannot be one CUDA graph: {why}")));
        }
        if self.profile.is_some() {
            return Err(RuntimeError::InvalidProgram(PROFILE_IN_GRAPH.into()));
        }
        self.graph = StepGraph::Warming;
        Ok(())
    }

    /// Whether the next step issues its instructions one by one (not captured nor replayed as
    /// a graph), so that the host may look between them.
    pub(crate) fn steps_one_by_one(&self) -> bool {
        matches!(self.graph, StepGraph::Off | StepGraph::Warming)
    }

    /// Runs one step of `program` (its inputs uploaded) by `schedule`, with its updates, and
    /// waits for it: issued instruction by instruction, or as the captured graph.
    pub(crate) fn step(
        &mut self,
        program: &Program,
        schedule: &crate::streams::StreamSchedule,
    ) -> Result<(), RuntimeError> {
        match self.graph {
            StepGraph::Off | StepGraph::Warming => {
                crate::streams::drive(self, program, schedule)?;
                self.apply_updates(&program.updates)?;
                if self.graph == StepGraph::Warming {
                    self.graph = StepGraph::Capture;
                }
                Ok(())
            }
            StepGraph::Capture => {
                self.gpu().begin_capture()?;
                let issued =
                    crate::streams::issue(self, program, schedule).and_then(|()| self.apply_updates(&program.updates));
                // The capture ends whatever happened, so the streams run again.
                let graph = self.gpu().end_capture();
                let graph = issued.and(graph).map_err(|e| match e {
                    RuntimeError::Device(message) => RuntimeError::Device(format!("capturing the step: {message}")),
                    other => other,
                })?;
                self.graph = StepGraph::Replay(graph);
                self.replay(graph)
            }
            StepGraph::Replay(graph) => self.replay(graph),
        }
    }

    /// Runs captured graph `graph` and waits for it (reporting an indexed kernel's fault).
    fn replay(&mut self, graph: usize) -> Result<(), RuntimeError> {
        let result = self.gpu().replay(graph).and_then(|()| Device::synchronize(self));
        if let Err(e) = &result {
            Device::abort(self, e);
        }
        result
    }
}
