//! Context parallelism's ring (`--cp-comm-type p2p`): attention meets the other ranks' keys and
//! values a block at a time, passed around the ring of cp ranks (`passes/src/cp_ring.rs`). It
//! trains like one rank under every layout, moves the bytes the formula says, and holds no
//! all-gathered keys and values.

use crate::common::{compile_shapes, fixture, scratch};
use crate::parallel::{train_model, within_contract};

/// A plan of `arch`'s fixture cut to `layers` layers, one sequence of `seq_len` tokens a rank,
/// over `flags`.
fn plan(arch: &str, layers: usize, seq_len: usize, flags: &[&str]) -> autotp_program::plan::TrainingPlan {
    let model = fixture(arch, "model.onnx");
    let args: Vec<String> = [model.to_str().unwrap(), "--micro-batch", "1", "--seq-len", &seq_len.to_string()]
        .iter()
        .chain(flags)
        .map(|s| s.to_string())
        .collect();
    compile_shapes(&args, layers)
}

/// 30 AdamW steps of one sequence a rank, 8 sequences a step, against one rank taking the 8 as
/// one micro-batch: within the contract (1e-5 at step 1, 1e-3 over the steps), for the
/// load-balanced order and contiguous blocks, beside tensor, pipeline and data parallelism, and
/// under `--recompute full`. Each plan passes keys and values around the ring (a plan that fell back to
/// all-gathering them would pass too, so this is checked).
#[test]
fn ring_attention_trains_like_one_rank() {
    let dir = scratch("cp-ring");
    let layouts: &[&[&str]] = &[
        &["--cp", "2", "--grad-accum", "8"],
        &["--cp", "4", "--grad-accum", "8"],
        &["--cp", "4", "--cp-contiguous", "--grad-accum", "8"],
        &["--cp", "2", "--tp", "2", "--grad-accum", "8"],
        &["--cp", "2", "--pp", "2", "--grad-accum", "8"],
        // Recomputation keeps the rounds' merged output and log-sum-exp, which the backward reads.
        &["--cp", "2", "--recompute", "full", "--grad-accum", "8"],
        &["--cp", "2", "--dp", "2", "--zero", "3", "--grad-accum", "4"],
        &["--cp", "2", "--dp", "2", "--tp", "2", "--zero", "1", "--grad-accum", "4"],
    ];
    for arch in ["llama", "gpt2"] {
        let single = train_model(&dir, arch, "model.onnx", 8, &[]);
        for flags in layouts {
            let flags: Vec<&str> = flags.iter().copied().chain(["--cp-comm-type", "p2p"]).collect();
            let label = format!("{arch} micro-batch 1 {}", flags.join(" "));
            let sent = &autotp_program::report::report(&plan(arch, 2, 32, &flags)).ranks[0].comm_bytes_per_step;
            assert!(sent.ring_shift > 0, "{label}: no ring");
            let got = train_model(&dir, arch, "model.onnx", 1, &flags);
            let (first, worst) = within_contract(&label, &got, &single);
            println!("{label}: step 1 {first:.2e}, worst {worst:.2e} relative to one rank");
        }
    }
}

/// Per layer and rank, with blocks of `4 h_kv (s/N) d` bytes (a rank's keys, or values, f32):
/// the forward passes the keys and values on N-1 times, the backward passes them on N-1 times
/// again and their gradients' sums N times (the last shift brings each home): `(4(N-1) + 2N)`
/// blocks. Nothing is all-gathered or reduce-scattered; the weights' gradients and the two
/// one-element values (the loss, the finite check's flag) are all-reduced over cp, `2(N-1)/N`
/// of their bytes, as with all-gather.
#[test]
fn ring_attention_passes_the_bytes_the_formula_says() {
    for (arch, s, kv_heads, head_dim) in [("llama", 1024usize, 2usize, 16usize), ("gpt2", 128, 4, 16)] {
        for n in [2, 4] {
            let cp = n.to_string();
            let plan = plan(arch, 2, s, &["--cp", &cp, "--cp-comm-type", "p2p"]);
            let sent = &autotp_program::report::report(&plan).ranks[0].comm_bytes_per_step;
            let params = plan.stages[0].memory.params_bytes;
            let block = 4 * kv_heads * (s / n) * head_dim;
            println!("{arch} cp {n} p2p: ring {} bytes per rank, all-reduce {}", sent.ring_shift, sent.all_reduce);
            assert_eq!(sent.ring_shift, 2 * (4 * (n - 1) + 2 * n) * block, "{arch} cp {n}: ring");
            assert_eq!((sent.all_gather, sent.reduce_scatter), (0, 0), "{arch} cp {n}");
            assert_eq!(sent.all_reduce, 2 * (n - 1) * (params + 8) / n, "{arch} cp {n}: all-reduces");
        }
    }
}

/// The all-gather keeps each layer's gathered keys and values (`2 x 4 h_kv s d` bytes) from
/// the forward to the backward; the ring keeps a rank's own (a `1/N` of them, which the
/// projections made anyway) and passes the others on: rank 0's activation peak falls by at
/// least the gathered blocks of every layer but one. (Llama at 1024 tokens over cp 4, where
/// the layers' activations make the peak.)
#[test]
fn ring_attention_holds_no_gathered_keys() {
    let (s, n, kv_heads, head_dim, layers) = (1024, 4, 2, 16, 2);
    let peak = |comm: &str| {
        let plan = plan("llama", layers, s, &["--cp", &n.to_string(), "--cp-comm-type", comm]);
        plan.stages[0].memory.activations_peak_bytes
    };
    let (gathered, ring) = (peak("all_gather"), peak("p2p"));
    let others = 2 * 4 * kv_heads * s * head_dim * (n - 1) / n;
    println!("llama cp {n} at {s} tokens: activation peak {gathered} bytes all-gathered, {ring} around the ring");
    assert!(ring + (layers - 1) * others <= gathered, "ring {ring} against all-gather {gathered}");
}
