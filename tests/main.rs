//! autotp's end-to-end tests, in one binary (each test binary links everything again).
//!
//! - `fixtures`: the tiny Hugging Face exports against PyTorch's outputs, and IR round trips.
//! - `golden`: golden IR files under tests/golden (input IR, pass list, expected IR).
//! - `verifier`: hand-made broken graphs and the verifier's messages.
//! - `cli`: the command line on bad input: one clear line, non-zero exit, no panic.
//! - `compile`: `autotp compile`'s summary, IR dumps, `--freeze`, damaged plans.
//! - `checkpoint`: save, resume (bit-identical), a save killed midway, refusal, export.
//! - `data`: `autotp data prepare` (text to Megatron's indexed dataset) against `tokenizers`.
//! - `parallel`: data parallelism on CPU rank threads against the single-rank run.
//! - `pipeline`: where the forward pass is cut into pipeline stages.
//! - `precision`: bf16 mixed precision against f32, one rank, its memory and checkpoints.
//! - `recompute`: core attention or whole layers recomputed in the backward against keeping
//!   them; `auto` under `--memory-cap`.
//! - `offload`: the optimizer's states in host memory outside the arena against keeping them.
//! - `processes`: ranks as MPI processes against ranks as threads; failures end the job.
//! - `fuzz_regressions`: the fuzz targets on their corpora and the inputs that once crashed them.
//! - `cluster`: one job across four network namespaces as nodes; a cut link, a hung and a
//!   killed rank; a resume on the nodes left (`scripts/cluster-test.sh`).
//! - `faults`: a scheduler's preempting signal stops every rank after one step, with a checkpoint.
//! - `sharding`: the `shard` pass on the fixtures' training steps, run by the SPMD evaluator,
//!   against the single-device step.
//! - `gpu`: the GPU device's host side on the emulated GPU against the CPU executor.
//! - `kernels`: every generated kernel against the builtin kernel of the same op.
//! - `isa`: the kernel and training tests again at x86-64-v3 (AVX2) on an AVX-512 host.
//! - `rewrites`: the egg rewrites of kernel index arithmetic against their golden file.
//! - `monitoring`: `--tensorboard`'s event files against the metrics and a file TensorBoard
//!   wrote; `--trace`'s Chrome/Perfetto timeline.
//! - `validation`: `--eval-every`'s evaluation step against the training step's loss, on
//!   every layout.
//! - `train`: `autotp train` against PyTorch's loss curves; `gradients`, `optimizers`,
//!   `conformance`: rules, optimizers and ONNX node tests against references.

mod all_to_all;
mod attention;
mod checkpoint;
mod cli;
mod cluster;
mod common;
mod compile;
mod conformance;
mod context_parallel;
mod cp_ring;
mod data;
mod deepspeed;
mod expert_parallel;
mod faults;
mod fixtures;
mod fuzz_regressions;
mod golden;
mod gpu;
mod gradients;
mod isa;
mod kernels;
mod monitoring;
mod offload;
mod optimizers;
mod parallel;
mod param_offload;
mod pipeline;
mod pipeline_schedules;
mod plan;
mod precision;
mod processes;
mod recompute;
mod rewrites;
mod sequence_parallel;
mod sharding;
mod train;
mod validation;
mod verifier;
