//! A program's collectives on GPUs with NCCL: each [`CollectiveOp`] as the calls a device makes,
//! worked out once when the program loads ([`device_steps`]), so that a step issues them in its
//! stream's order and never copies through the host.
//!
//! NCCL gathers and scatters contiguous rank-major blocks of a flat buffer, which is a
//! program's `all_gather`/`reduce_scatter` along `dim` only when the dims before `dim` are all
//! one. Otherwise (a column-split weight sharded by ZeRO, say) the `outer` rows of each rank's
//! block are strided in the program's layout, and the steps move them with 2-D copies through a
//! scratch buffer: after an all-gather, rank `r`'s block `[outer, part]` goes to columns
//! `r * part..` of each output row; before a reduce-scatter, each rank's columns are packed
//! into its block. A `shard_slice` is one 2-D copy, no communication. The arithmetic (the sums)
//! is all NCCL's.

use autotp_kernels::DType;
use autotp_program::mesh::{Collective, CollectiveOp};

/// One call of NCCL on a communicator (counts in elements of `dtype`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NcclCall {
    /// `recv = sum of every rank's send`, `count` elements.
    AllReduce { send: u64, recv: u64, count: usize, dtype: DType },
    /// `recv` = every rank's `count` elements of `send`, in rank order.
    AllGather { send: u64, recv: u64, count: usize, dtype: DType },
    /// `recv` = block `rank` (of `count` elements) of the sum of every rank's `send`.
    ReduceScatter { send: u64, recv: u64, count: usize, dtype: DType },
    /// Piece j (`count` elements) of `send` to rank j, rank i's piece for this one into piece
    /// i of `recv`: grouped sends and receives (NCCL has no all-to-all call).
    AllToAll { send: u64, recv: u64, count: usize, dtype: DType },
    /// `count` elements at `send` to rank `next`, rank `previous`'s into `recv`: a ring shift
    /// (a grouped send and receive).
    RingShift { send: u64, recv: u64, count: usize, dtype: DType, next: usize, previous: usize },
    /// `bytes` bytes at `send` to rank `peer`, whose matching [`NcclCall::Recv`] (its next from
    /// this rank) receives them: a pipeline message.
    Send { send: u64, bytes: usize, peer: usize },
    /// `bytes` bytes from rank `peer` into `recv`.
    Recv { recv: u64, bytes: usize, peer: usize },
}

impl NcclCall {
    /// The device buffers it reads and writes, (address, bytes), on a communicator of `ranks`.
    pub fn buffers(&self, ranks: usize) -> Vec<(u64, usize)> {
        match *self {
            NcclCall::Send { send: address, bytes, .. } | NcclCall::Recv { recv: address, bytes, .. } => {
                vec![(address, bytes)]
            }
            NcclCall::AllReduce { send, recv, count, dtype } | NcclCall::RingShift { send, recv, count, dtype, .. } => {
                vec![(send, count * dtype.size()), (recv, count * dtype.size())]
            }
            NcclCall::AllGather { send, recv, count, dtype } => {
                vec![(send, count * dtype.size()), (recv, ranks * count * dtype.size())]
            }
            NcclCall::ReduceScatter { send, recv, count, dtype } => {
                vec![(send, ranks * count * dtype.size()), (recv, count * dtype.size())]
            }
            NcclCall::AllToAll { send, recv, count, dtype } => {
                vec![(send, ranks * count * dtype.size()), (recv, ranks * count * dtype.size())]
            }
        }
    }
}

/// `rows` rows of `width` bytes from `from` to `to`, rows `from_pitch` and `to_pitch` bytes
/// apart (`cuMemcpy2DAsync`), between device buffers that do not overlap.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Copy2d {
    pub from: u64,
    pub from_pitch: usize,
    pub to: u64,
    pub to_pitch: usize,
    pub width: usize,
    pub rows: usize,
}

/// What a device does for a collective, in order, on the collective's stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceStep {
    Copy2d(Copy2d),
    /// An NCCL call on the communicator of the collective's mesh axis.
    Nccl(NcclCall),
}

/// Where a collective's operands lie on the device.
#[derive(Clone, Copy, Debug)]
pub struct Operands {
    pub input: u64,
    pub output: u64,
    /// At least [`CollectiveOp::device_scratch_bytes`], used by its steps alone meanwhile.
    pub scratch: u64,
}

/// The steps of `op` for the rank at coordinate `coord` of its `n` ranks (see the module doc);
/// `None` for a shape the collective does not divide.
pub fn device_steps(op: &CollectiveOp, n: usize, coord: usize, at: Operands) -> Option<Vec<DeviceStep>> {
    op.kind.output_shape(&op.shape, n)?;
    let dtype = op.dtype;
    let numel: usize = op.shape.iter().product();
    Some(match op.kind {
        Collective::AllReduce => {
            vec![DeviceStep::Nccl(NcclCall::AllReduce { send: at.input, recv: at.output, count: numel, dtype })]
        }
        Collective::RingShift { .. } => {
            let (next, previous) = ((coord + 1) % n, (coord + n - 1) % n);
            let (send, recv) = (at.input, at.output);
            vec![DeviceStep::Nccl(NcclCall::RingShift { send, recv, count: numel, dtype, next, previous })]
        }
        Collective::AllGather { dim } => {
            let (outer, row) = op.rows_along(dim);
            if outer == 1 {
                return Some(vec![DeviceStep::Nccl(NcclCall::AllGather {
                    send: at.input,
                    recv: at.output,
                    count: numel,
                    dtype,
                })]);
            }
            let block = (outer * row) as u64;
            let gather = NcclCall::AllGather { send: at.input, recv: at.scratch, count: numel, dtype };
            let unpack = (0..n).map(|r| {
                DeviceStep::Copy2d(Copy2d {
                    from: at.scratch + r as u64 * block,
                    from_pitch: row,
                    to: at.output + (r * row) as u64,
                    to_pitch: n * row,
                    width: row,
                    rows: outer,
                })
            });
            std::iter::once(DeviceStep::Nccl(gather)).chain(unpack).collect()
        }
        Collective::ReduceScatter { dim } => {
            let (outer, row) = op.rows_along(dim);
            let count = numel / n;
            if outer == 1 {
                return Some(vec![DeviceStep::Nccl(NcclCall::ReduceScatter {
                    send: at.input,
                    recv: at.output,
                    count,
                    dtype,
                })]);
            }
            let piece = row / n;
            let pack = (0..n).map(|r| {
                DeviceStep::Copy2d(Copy2d {
                    from: at.input + (r * piece) as u64,
                    from_pitch: row,
                    to: at.scratch + (r * outer * piece) as u64,
                    to_pitch: piece,
                    width: piece,
                    rows: outer,
                })
            });
            let scatter = NcclCall::ReduceScatter { send: at.scratch, recv: at.output, count, dtype };
            pack.chain(std::iter::once(DeviceStep::Nccl(scatter))).collect()
        }
        Collective::AllToAll { split, concat } => {
            // Pieces are packed rank-major into the scratch's first half (unless they are
            // already: nothing before `split` but ones), exchanged into its second half, and
            // placed along `concat` (unless that is the received order already).
            let bytes = numel * dtype.size();
            let (piece_bytes, (outer, row)) = (bytes / n, op.rows_along(split));
            let mut steps = Vec::new();
            let send = match outer {
                1 => at.input,
                _ => {
                    let piece = row / n;
                    steps.extend((0..n).map(|j| {
                        DeviceStep::Copy2d(Copy2d {
                            from: at.input + (j * piece) as u64,
                            from_pitch: row,
                            to: at.scratch + (j * piece_bytes) as u64,
                            to_pitch: piece,
                            width: piece,
                            rows: outer,
                        })
                    }));
                    at.scratch
                }
            };
            let mut piece_shape = op.shape.clone();
            piece_shape[split] /= n;
            let placed_outer: usize = piece_shape[..concat].iter().product();
            let piece_row = piece_shape[concat..].iter().product::<usize>() * dtype.size();
            let recv = if placed_outer == 1 { at.output } else { at.scratch + bytes as u64 };
            steps.push(DeviceStep::Nccl(NcclCall::AllToAll { send, recv, count: numel / n, dtype }));
            if placed_outer > 1 {
                steps.extend((0..n).map(|i| {
                    DeviceStep::Copy2d(Copy2d {
                        from: recv + (i * piece_bytes) as u64,
                        from_pitch: piece_row,
                        to: at.output + (i * piece_row) as u64,
                        to_pitch: n * piece_row,
                        width: piece_row,
                        rows: placed_outer,
                    })
                }));
            }
            steps
        }
        Collective::ShardSlice { dim } => {
            let (outer, row) = op.rows_along(dim);
            let piece = row / n;
            vec![DeviceStep::Copy2d(Copy2d {
                from: at.input + (coord * piece) as u64,
                from_pitch: row,
                to: at.output,
                to_pitch: piece,
                width: piece,
                rows: outer,
            })]
        }
    })
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::comm::{Communicator, LocalComm};

    /// Runs every rank's steps on host memory (addresses are offsets into each rank's memory:
    /// input at 0, output at `OUT`, scratch at `SCRATCH`), the NCCL calls summing in rank order.
    fn run_steps(steps: &[Vec<DeviceStep>], memories: &mut [Vec<u8>], dtype: DType) {
        let n = memories.len();
        for (s, first) in steps[0].iter().enumerate() {
            match first {
                DeviceStep::Copy2d(_) => {
                    for (rank, memory) in memories.iter_mut().enumerate() {
                        let DeviceStep::Copy2d(Copy2d { from, from_pitch, to, to_pitch, width, rows }) = steps[rank][s]
                        else {
                            panic!("ranks' steps differ")
                        };
                        for r in 0..rows {
                            let (f, t) = (from as usize + r * from_pitch, to as usize + r * to_pitch);
                            memory.copy_within(f..f + width, t);
                        }
                    }
                }
                DeviceStep::Nccl(_) => {
                    let sends: Vec<Vec<u8>> = (0..n)
                        .map(|rank| {
                            let DeviceStep::Nccl(call) = steps[rank][s] else { panic!("ranks' steps differ") };
                            let (send, count) = match call {
                                NcclCall::AllReduce { send, count, .. }
                                | NcclCall::AllGather { send, count, .. }
                                | NcclCall::RingShift { send, count, .. } => (send, count),
                                NcclCall::ReduceScatter { send, count, .. }
                                | NcclCall::AllToAll { send, count, .. } => (send, count * n),
                                NcclCall::Send { .. } | NcclCall::Recv { .. } => panic!("no collective"),
                            };
                            memories[rank][send as usize..][..count * dtype.size()].to_vec()
                        })
                        .collect();
                    let sum = |span: std::ops::Range<usize>| -> Vec<u8> {
                        let values = |bytes: &[u8]| -> Vec<f32> {
                            bytes.chunks(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
                        };
                        let mut total = values(&sends[0][span.clone()]);
                        for send in &sends[1..] {
                            for (t, x) in total.iter_mut().zip(values(&send[span.clone()])) {
                                *t += x;
                            }
                        }
                        total.iter().flat_map(|t| t.to_le_bytes()).collect()
                    };
                    for (rank, memory) in memories.iter_mut().enumerate() {
                        let DeviceStep::Nccl(call) = steps[rank][s] else { unreachable!() };
                        let (recv, bytes) = match call {
                            NcclCall::AllReduce { recv, .. } => (recv, sum(0..sends[0].len())),
                            NcclCall::AllGather { recv, .. } => (recv, sends.concat()),
                            NcclCall::RingShift { recv, previous, .. } => (recv, sends[previous].clone()),
                            NcclCall::ReduceScatter { recv, count, .. } => {
                                let block = count * dtype.size();
                                (recv, sum(rank * block..(rank + 1) * block))
                            }
                            NcclCall::AllToAll { recv, count, .. } => {
                                let block = count * dtype.size();
                                (recv, sends.iter().flat_map(|send| send[rank * block..][..block].to_vec()).collect())
                            }
                            NcclCall::Send { .. } | NcclCall::Recv { .. } => unreachable!("no collective"),
                        };
                        memory[recv as usize..][..bytes.len()].copy_from_slice(&bytes);
                    }
                }
            }
        }
    }

    const OUT: u64 = 1 << 16;
    const SCRATCH: u64 = 1 << 17;

    /// Every collective (all-to-all between every pair of dims), flat and strided, over 2 and 3
    /// ranks: the steps compute what the threads' communicator computes, bit for bit.
    #[test]
    fn device_steps_compute_the_host_collectives() {
        let shapes = [vec![6, 4], vec![2, 6, 3], vec![1, 12, 2]];
        let kinds = |dim, rank| {
            let all_to_all = (0..rank).filter(move |&concat| concat != dim);
            [
                Collective::AllReduce,
                Collective::AllGather { dim },
                Collective::ReduceScatter { dim },
                Collective::ShardSlice { dim },
                Collective::RingShift { dim },
            ]
            .into_iter()
            .chain(all_to_all.map(move |concat| Collective::AllToAll { split: dim, concat }))
        };
        let mut strided = 0;
        for n in [2, 3] {
            for shape in &shapes {
                for dim in 0..shape.len() {
                    for kind in kinds(dim, shape.len()) {
                        let op = CollectiveOp { kind, axis: 0, dtype: DType::F32, shape: shape.clone() };
                        let Some(out_shape) = kind.output_shape(shape, n) else { continue };
                        let numel: usize = shape.iter().product();
                        let out_bytes = out_shape.iter().product::<usize>() * 4;
                        let inputs: Vec<Vec<u8>> = (0..n)
                            .map(|rank| {
                                (0..numel).flat_map(|i| ((rank * 1000 + i) as f32 * 0.37).to_le_bytes()).collect()
                            })
                            .collect();
                        let comm: Arc<LocalComm> = LocalComm::new(&[n]);
                        let expected: Vec<Vec<u8>> = std::thread::scope(|scope| {
                            let handles: Vec<_> = (0..n)
                                .map(|rank| {
                                    let (comm, op, input) = (comm.clone(), &op, &inputs[rank]);
                                    scope.spawn(move || {
                                        let mut out = vec![0u8; out_bytes];
                                        comm.collective(rank, op, 0, input, &mut out).unwrap();
                                        out
                                    })
                                })
                                .collect();
                            handles.into_iter().map(|h| h.join().unwrap()).collect()
                        });
                        let at = Operands { input: 0, output: OUT, scratch: SCRATCH };
                        let steps: Vec<Vec<DeviceStep>> =
                            (0..n).map(|coord| device_steps(&op, n, coord, at).unwrap()).collect();
                        strided +=
                            usize::from(steps[0].iter().any(|s| matches!(s, DeviceStep::Copy2d(c) if c.rows > 1)));
                        assert!(op.device_scratch_bytes(n) <= (1 << 16), "{op:?}");
                        let mut memories: Vec<Vec<u8>> = inputs
                            .iter()
                            .map(|input| {
                                let mut memory = vec![0u8; 1 << 18];
                                memory[..input.len()].copy_from_slice(input);
                                memory
                            })
                            .collect();
                        run_steps(&steps, &mut memories, DType::F32);
                        for (rank, memory) in memories.iter().enumerate() {
                            let got = &memory[OUT as usize..][..out_bytes];
                            assert!(got == expected[rank].as_slice(), "{kind:?} of {shape:?} over {n}, rank {rank}");
                        }
                    }
                }
            }
        }
        assert!(strided >= 12, "strided blocks exercised: {strided}");
    }
}
