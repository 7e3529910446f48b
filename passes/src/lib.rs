//! autotp-passes: the pass manager and every Graph -> Graph pass.
//!
//! A pass implements [`Pass`]; the [`PassManager`] runs a list of them, verifies the graph
//! after each one, and times them. Passes do no I/O.
//!
//! | pass        | what it does                                                        |
//! |-------------|---------------------------------------------------------------------|
//! | `accumulate` | gradient accumulation: A micro-batches per step, gradients summed as made ([`accumulate`]) |
//! | `autotp`    | tensor parallelism found from dataflow (Megatron's split), then `shard` ([`autotp`]) |
//! | `autodiff`  | appends the reverse-mode gradients of the loss ([`autodiff`])        |
//! | `dce`       | removes nodes and parameters no output depends on ([`dce`])          |
//! | `depth` | not a pass: the model cut to its first layers, the proxies `autotp plan` compiles ([`depth`]) |
//! | `expert-dispatch` | a mixture of experts' per-pair computation in expert parallelism's dispatched layout ([`expert_dispatch`]) |
//! | `expand-norms` | under `--tp`, a norm of a projection's output (OLMo 2's q/k norms) as arithmetic, so it splits ([`expand_norms`]) |
//! | `fusion`    | groups elementwise and row-reduction ops into generated kernels ([`fusion`]) |
//! | `loss`      | one scalar `loss` output: the model's, or mean cross-entropy ([`loss`]) |
//! | `optimize`  | AdamW/SGD updates of every parameter, optional grad clipping ([`optimize`]) |
//! | `peephole`  | e-graph rewrites: transpose and reshape chains, `x * 1`, `x + 0`, transposes into GEMMs ([`peephole`]) |
//! | `precision` | mixed precision: 16-bit weights, CUDA autocast's cast policy; gradients to the accumulation type ([`precision`]) |
//! | `recompute` | inside `fusion`: core attention recomputed in the backward (`--recompute selective`) ([`recompute`]) |
//! | `recognize` | rewrites decomposed GELU / RMSNorm / softmax into composite ops ([`recognize`]) |
//! | `split-fused` | fused projections (GPT-2 `c_attn`, Falcon's and BigCode's multi-query qkv) as one projection per part ([`split_fused`]) |
//! | `shard`     | places a training step on a device mesh, inserting collectives ([`shard`]) |
//! | `unmerge-heads` | attention over `[batch x heads, s, d]` (BLOOM) computed over `[batch, heads, s, d]` ([`unmerge_heads`]) |
//! | `zero`      | data parallelism with ZeRO stages 0-3, as seeds for `shard` ([`zero`]) |

pub mod accumulate;
pub mod attention;
pub mod autodiff;
pub mod autotp;
pub mod context_balance;
mod context_parallel;
pub mod cp_ring;
pub mod dce;
pub mod depth;
pub mod expand_norms;
pub mod expert_dispatch;
pub mod fusion;
pub mod loss;
pub mod optimize;
pub mod padding;
pub mod peephole;
pub mod pipeline;
pub mod precision;
pub mod recognize;
pub mod recompute;
mod reduction_buckets;
pub mod shard;
mod sink_slices;
pub mod split_fused;
pub mod unmerge_heads;
mod vocab;
pub mod zero;

use std::time::Instant;

use autotp_ir::{verify, Graph, Op, ValueId, VerifyErrors};

#[derive(Debug, thiserror::Error)]
pub enum PassError {
    #[error("the graph is invalid after pass '{pass}': {errors}")]
    Verify { pass: &'static str, errors: VerifyErrors },
    #[error("pass '{pass}': {op} has no gradient rule{detail}")]
    NoGradient { pass: &'static str, op: String, detail: String },
    #[error("pass '{pass}': {message}")]
    Invalid { pass: &'static str, message: String },
}

/// Appends `op` to `g`; a type error becomes `pass`'s `Invalid` error naming the op.
pub(crate) fn add_op(pass: &'static str, g: &mut Graph, op: Op, inputs: Vec<ValueId>) -> Result<ValueId, PassError> {
    let name = op.name();
    g.add(op, inputs).map_err(|m| PassError::Invalid { pass, message: format!("{name}: {m}") })
}

/// The names among `names` that are inputs of `graph` (a pipeline stage reads some of the
/// batch inputs only).
pub(crate) fn present_inputs<'a>(graph: &Graph, names: &'a [String]) -> impl Iterator<Item = &'a String> {
    let inputs: Vec<String> = graph.inputs().iter().filter_map(|&v| graph.name_of(v)).map(str::to_string).collect();
    names.iter().filter(move |n| inputs.contains(n))
}

/// The permutation that undoes `perm` (as a transpose's).
pub(crate) fn inverse_permutation(perm: &[usize]) -> Vec<usize> {
    let mut inverse = vec![0; perm.len()];
    for (i, &p) in perm.iter().enumerate() {
        inverse[p] = i;
    }
    inverse
}

/// A Graph -> Graph transformation.
pub trait Pass {
    /// The kebab-case name used on the command line.
    fn name(&self) -> &'static str;
    fn run(&self, graph: &mut Graph) -> Result<(), PassError>;
}

/// Runs passes in order, verifying after each.
pub struct PassManager {
    passes: Vec<Box<dyn Pass>>,
}

impl PassManager {
    pub fn new(passes: Vec<Box<dyn Pass>>) -> PassManager {
        PassManager { passes }
    }

    /// The post-import cleanup: recognise composite ops, simplify with the e-graph rewrites,
    /// then drop what became dead.
    pub fn simplify_pipeline() -> PassManager {
        PassManager::new(PassManager::simplify_passes())
    }

    /// [`PassManager::simplify_pipeline`]'s passes, for a longer list.
    pub fn simplify_passes() -> Vec<Box<dyn Pass>> {
        vec![
            Box::new(recognize::Recognize),
            Box::new(peephole::Peephole { rules: peephole::Rules::Algebraic }),
            Box::new(unmerge_heads::UnmergeHeads),
            Box::new(dce::Dce),
        ]
    }

    /// The passes' names, in order (a pass may appear more than once).
    pub fn pass_names(&self) -> Vec<&'static str> {
        self.passes.iter().map(|p| p.name()).collect()
    }

    pub fn run(&self, graph: &mut Graph) -> Result<(), PassError> {
        self.run_observed(graph, &mut |_, _, _| {})
    }

    /// Runs the passes; `observe(i, name, graph)` sees the graph after the i-th pass (1-based),
    /// once it verified. `--dump-ir` and `--print-after` are observers.
    pub fn run_observed(
        &self,
        graph: &mut Graph,
        observe: &mut dyn FnMut(usize, &'static str, &Graph),
    ) -> Result<(), PassError> {
        for (i, pass) in self.passes.iter().enumerate() {
            let start = Instant::now();
            pass.run(graph)?;
            verify(graph).map_err(|errors| PassError::Verify { pass: pass.name(), errors })?;
            tracing::debug!(
                pass = pass.name(),
                nodes = graph.num_nodes(),
                seconds = start.elapsed().as_secs_f64(),
                "ran pass"
            );
            observe(i + 1, pass.name(), graph);
        }
        Ok(())
    }
}
