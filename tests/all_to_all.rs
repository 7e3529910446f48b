//! The all-to-all collective (`all_to_all {split, concat}`: shard(concat) -> shard(split),
//! the exchange expert parallelism dispatches tokens with): its IR text round-trips, the SPMD
//! reference computes what one device does, and the lowered programs compute the reference on
//! rank threads, for pairs of dims over 2 and 3 ranks. MPI processes and NCCL (emulated) check
//! theirs in `bench-comm` (tests/processes.rs, tests/gpu.rs), the NCCL steps of every pair of
//! dims in `runtime/src/gpu/collectives.rs`.

use std::sync::Arc;

use autotp_ir::{Tensor, TensorType};
use autotp_runtime::comm::{Communicator, LocalComm};
use autotp_runtime::{Executor, HostTensor};

/// `x` (sharded on `concat`) exchanged to sharding on `split`, doubled, and gathered whole.
fn graph_text(n: usize, split: usize, concat: usize) -> String {
    format!(
        "graph \"exchange\" mesh [ep={n}] {{
  input %x : f32[6,6,12] {{ep = shard({concat})}}
  %0 = all_to_all %x {{axis = ep, split = {split}, concat = {concat}}} : f32[6,6,12] {{ep = shard({split})}}
  %1 = add %0, %0 : f32[6,6,12] {{ep = shard({split})}}
  %2 = all_gather %1 {{axis = ep, dim = {split}}} : f32[6,6,12]
  output \"y\" = %2
}}
"
    )
}

/// The block of `x` rank `rank` of `n` holds along `dim`.
fn block(x: &Tensor, dim: usize, rank: usize, n: usize) -> Vec<u8> {
    let shape = x.shape().to_vec();
    let mut out = shape.clone();
    out[dim] /= n;
    let mut starts = vec![0; shape.len()];
    starts[dim] = rank * out[dim];
    let slice = autotp_kernels::Kernel::Slice {
        dtype: autotp_kernels::DType::F32,
        shape: shape.clone(),
        starts,
        steps: vec![1; shape.len()],
        out: out.clone(),
    };
    let mut bytes = vec![0u8; out.iter().product::<usize>() * 4];
    slice.run(&[x.bytes()], &mut [&mut bytes]).unwrap();
    bytes
}

#[test]
fn all_to_all_exchanges_blocks_on_rank_threads() {
    let values: Vec<f64> = (0..6 * 6 * 12).map(|i| (i as f64 * 0.37).sin()).collect();
    let x = Tensor::from_f64_values(autotp_ir::DType::F32, vec![6, 6, 12], &values);
    let doubled: Vec<f64> = values.iter().map(|v| (2.0 * *v as f32) as f64).collect();
    for n in [2, 3] {
        for (split, concat) in [(0, 1), (1, 0), (0, 2), (2, 1), (1, 2)] {
            let text = graph_text(n, split, concat);
            let graph = autotp_ir::text::parse(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
            assert_eq!(autotp_ir::text::print(&graph), text, "the text round-trips");
            autotp_ir::verify(&graph).unwrap();
            let reference =
                autotp_ir::spmd::eval_spmd_step(&graph, &mut Default::default(), std::slice::from_ref(&x)).unwrap();
            assert_eq!(reference[0].to_f64_vec(), doubled, "the SPMD reference, split {split} concat {concat}");

            let program = autotp_codegen::lower_with(&graph, &Default::default()).unwrap();
            let comm: Arc<dyn Communicator> = LocalComm::new(&[n]);
            let outputs: Vec<Vec<u8>> = std::thread::scope(|scope| {
                let ranks: Vec<_> = (0..n)
                    .map(|rank| {
                        let (program, comm, x) = (program.clone(), comm.clone(), &x);
                        scope.spawn(move || {
                            let mut executor = Executor::for_rank(program, rank, comm).unwrap();
                            let mut shape = x.shape().to_vec();
                            shape[concat] /= n;
                            let input = HostTensor {
                                dtype: autotp_kernels::DType::F32,
                                shape,
                                data: block(x, concat, rank, n),
                            };
                            executor.run(&[input]).unwrap().remove(0).data
                        })
                    })
                    .collect();
                ranks.into_iter().map(|r| r.join().unwrap()).collect()
            });
            for (rank, output) in outputs.iter().enumerate() {
                let ty = TensorType::new(autotp_ir::DType::F32, vec![6, 6, 12]);
                let got = Tensor::from_bytes(ty, output.clone().into()).unwrap();
                assert_eq!(got.to_f64_vec(), doubled, "rank {rank} of {n}, split {split} concat {concat}");
            }
            let sent = comm.bytes_sent(0).all_to_all;
            assert_eq!(sent, (n - 1) * 6 * 6 * 12 * 4 / n / n, "each rank sends all but its own piece");
        }
    }
}

/// An all-to-all sends each piece's bytes up to its last element that is not zero, as expert
/// parallelism's send buffers are filled from the front with the pairs the routing sends and
/// zeros after: a rank's bytes sent are the filled elements of its pieces for the others (the
/// result unchanged), for contiguous pieces (split 0) and packed ones (split 2).
#[test]
fn all_to_all_sends_what_its_pieces_hold() {
    // Every 7th element and the last 3 of each row of 12 are zero: pieces end in zeros or not.
    let values: Vec<f64> =
        (0..6 * 6 * 12).map(|i| if i % 7 == 0 || i % 12 >= 9 { 0.0 } else { 1.0 + i as f64 }).collect();
    let x = Tensor::from_f64_values(autotp_ir::DType::F32, vec![6, 6, 12], &values);
    let doubled: Vec<f64> = values.iter().map(|v| 2.0 * v).collect();
    for (split, concat) in [(0, 1), (2, 1)] {
        let n = 3;
        let text = graph_text(n, split, concat);
        let graph = autotp_ir::text::parse(&text).unwrap();
        let program = autotp_codegen::lower_with(&graph, &Default::default()).unwrap();
        let comm: Arc<dyn Communicator> = LocalComm::new(&[n]);
        let mut block_shape = x.shape().to_vec();
        block_shape[concat] /= n;
        let outputs: Vec<Vec<u8>> = std::thread::scope(|scope| {
            let ranks: Vec<_> = (0..n)
                .map(|rank| {
                    let (program, comm, x, shape) = (program.clone(), comm.clone(), &x, block_shape.clone());
                    scope.spawn(move || {
                        let mut executor = Executor::for_rank(program, rank, comm).unwrap();
                        let input =
                            HostTensor { dtype: autotp_kernels::DType::F32, shape, data: block(x, concat, rank, n) };
                        executor.run(&[input]).unwrap().remove(0).data
                    })
                })
                .collect();
            ranks.into_iter().map(|r| r.join().unwrap()).collect()
        });
        let ty = TensorType::new(autotp_ir::DType::F32, vec![6, 6, 12]);
        for output in outputs {
            assert_eq!(Tensor::from_bytes(ty.clone(), output.into()).unwrap().to_f64_vec(), doubled);
        }
        for rank in 0..n {
            let held = Tensor::from_bytes(
                TensorType::new(autotp_ir::DType::F32, block_shape.clone()),
                block(&x, concat, rank, n).into(),
            )
            .unwrap();
            let filled: usize = (0..n)
                .filter(|&j| j != rank)
                .map(|j| {
                    let piece = block(&held, split, j, n);
                    let floats: Vec<f32> = piece.chunks(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect();
                    floats.iter().rposition(|&v| v != 0.0).map_or(0, |last| last + 1)
                })
                .sum();
            let whole = (n - 1) * 6 * 6 * 12 / n / n;
            assert!(filled < whole, "split {split}: some piece ends in zeros");
            assert_eq!(comm.bytes_sent(rank).all_to_all, 4 * filled, "split {split}, rank {rank}");
        }
    }
}
