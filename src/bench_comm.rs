//! `autotp bench-comm`: checks and times the collectives of the communication backend a run
//! would use, as DeepSpeed's `ds_bench` and nccl-tests do. Under a launcher (`mpirun -n 2
//! autotp bench-comm`) it measures the MPI backend, beside plain `MPI_Allreduce` on the same
//! buffers (what the backend adds); alone, `--ranks N` threads of this process over the
//! in-process backend.
//!
//! For each collective and size it checks every rank's result (exact small integers), then
//! prints the slowest rank's mean time per call over `--iters` calls after warm-up, the
//! algorithm bandwidth (buffer bytes / time) and the bus bandwidth (nccl-tests' convention:
//! all-reduce x 2(n-1)/n, all-gather, reduce-scatter and all-to-all x (n-1)/n). Then the overlap of an
//! all-reduce run on a communication thread (as the executor runs asynchronous collectives)
//! with matrix products on the calling thread: 100% when the pair takes as long as the longer
//! alone, 0% when it takes the sum; under MPI also the same all-reduce started non-blocking and
//! driven by the compute thread (`MPI_Test` between matmuls), no communication thread. Under
//! MPI it first checks the bootstrap a GPU communicator needs: 128 random bytes of rank 0 reach
//! every rank.
//!
//! With `--device cuda` it measures NCCL instead, as nccl-tests does: each rank on its GPU (the
//! local rank's, or rank `r`'s for threads) joins one communicator as a run's ranks do
//! (`autotp_runtime::gpu::bootstrap`), and each collective is checked and timed on device
//! buffers. One rank is allowed there (a one-GPU machine: NCCL's calls on a communicator of
//! one); `AUTOTP_GPU=emulated` runs it on emulated GPUs.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use autotp_kernels::{DType, Kernel, MatMulDims};
use autotp_program::{Collective, CollectiveOp};
use autotp_runtime::comm::{Communicator, LocalComm, MpiComm, Topology};
use clap::Args;

#[derive(Args)]
pub struct BenchCommArgs {
    /// Buffer sizes in MiB (each rank's input), comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "4,64")]
    sizes: Vec<usize>,
    /// Timed calls per collective and size (after 3 untimed).
    #[arg(long, default_value_t = 20)]
    iters: usize,
    /// Ranks as threads of this process (without a launcher).
    #[arg(long, default_value_t = 2)]
    ranks: usize,
    /// cpu: the ranks' communicator on host buffers; cuda: NCCL on GPU buffers.
    #[arg(long, default_value = "cpu", value_parser = ["cpu", "cuda"])]
    device: String,
}

/// The ranks this process drives and what they share.
struct Ranks {
    comm: Arc<dyn Communicator>,
    /// `Some` under MPI: this process's rank and the job.
    job: Option<Arc<MpiComm>>,
    world: usize,
}

impl Ranks {
    fn local(&self) -> Vec<usize> {
        match &self.job {
            Some(job) => vec![job.rank()],
            None => (0..self.world).collect(),
        }
    }

    fn reports(&self) -> bool {
        self.job.as_ref().is_none_or(|job| job.rank() == 0)
    }

    /// Runs `f(rank)` for every local rank (threads when several), which times some things,
    /// and returns the slowest rank's time of each over the whole job.
    fn slowest(&self, f: impl Fn(usize) -> Result<Vec<f64>> + Sync) -> Result<Vec<f64>> {
        let local: Vec<Vec<f64>> = std::thread::scope(|scope| {
            let f = &f;
            let handles: Vec<_> = self.local().into_iter().map(|rank| scope.spawn(move || f(rank))).collect();
            handles.into_iter().map(|h| h.join().expect("a rank thread panicked")).collect::<Result<Vec<_>>>()
        })?;
        let mut slowest = local[0].clone();
        for times in &local[1..] {
            slowest.iter_mut().zip(times).for_each(|(s, t)| *s = s.max(*t));
        }
        let Some(job) = &self.job else { return Ok(slowest) };
        let mine: Vec<u8> = slowest.iter().flat_map(|t| t.to_le_bytes()).collect();
        let all = job.all_gather(&mine)?;
        for rank in all.chunks(mine.len()) {
            for (s, t) in slowest.iter_mut().zip(rank.chunks(8)) {
                *s = s.max(f64::from_le_bytes(t.try_into().expect("8 bytes")));
            }
        }
        Ok(slowest)
    }

    /// [`Ranks::slowest`] of one time.
    fn slowest_one(&self, f: impl Fn(usize) -> Result<f64> + Sync) -> Result<f64> {
        Ok(self.slowest(|rank| Ok(vec![f(rank)?]))?[0])
    }
}

pub fn run(args: &BenchCommArgs) -> Result<()> {
    ensure!(args.iters > 0 && !args.sizes.is_empty(), "--iters and --sizes must not be empty");
    let place = autotp_runtime::launch::discover()?;
    let ranks = if place.world_size > 1 {
        let topology = Topology::new(1, &[place.world_size]);
        let job = MpiComm::init(topology, place.launcher.name(), place.world_size, Duration::from_secs(120))
            .context("cannot start the job's communication")?;
        job.install_panic_hook();
        // Nothing has used the global pool yet: the matmuls get this process's share of cores.
        rayon::ThreadPoolBuilder::new().num_threads(job.kernel_threads()).build_global()?;
        Ranks { comm: job.clone(), job: Some(job), world: place.world_size }
    } else {
        let least = if args.device == "cuda" { 1 } else { 2 };
        ensure!(args.ranks >= least, "--ranks {}: at least {least}", args.ranks);
        Ranks { comm: LocalComm::new(&[args.ranks]), job: None, world: args.ranks }
    };
    let result = match args.device.as_str() {
        "cuda" => bench_nccl(&ranks, args),
        _ => bench(&ranks, args),
    };
    match (&ranks.job, result) {
        (Some(job), Err(e)) => job.abort_job(&crate::render(&e)),
        (Some(job), Ok(())) => Ok(job.finalize()?),
        (None, result) => result,
    }
}

fn bench(ranks: &Ranks, args: &BenchCommArgs) -> Result<()> {
    let n = ranks.world;
    if let Some(job) = &ranks.job {
        check_bootstrap(ranks, job)?;
    }
    let backend = if ranks.job.is_some() { "mpi" } else { "threads" };
    if ranks.reports() {
        println!(
            "{:<16} {:>8} {:>9} {:>10} {:>12} {:>12}",
            "collective", "MiB", "backend", "ms", "algbw GB/s", "busbw GB/s"
        );
    }
    let per_round = args.iters.div_ceil(ROUNDS) as u64;
    let mut seq = 0u64;
    for &mib in &args.sizes {
        let elements = (mib << 20) / 4;
        ensure!(elements % n == 0, "{mib} MiB does not split over {n} ranks");
        let ops: Vec<CollectiveOp> = KINDS.iter().map(|&kind| op_of(kind, elements, n)).collect();
        let first = seq;
        let medians = ranks.slowest(|rank| {
            let mut buffers: Vec<Buffers> = ops.iter().map(|op| Buffers::new(rank, n, op)).collect();
            let mut raw = ranks.job.as_ref().map(|_| (vec![1f32; elements], vec![0f32; elements]));
            let mut samples = vec![Vec::new(); ops.len() + 1];
            let mut next = first;
            // Round 0 warms up; the rounds alternate the backend's calls with plain MPI's, so a
            // busy moment of the machine hits both.
            for round in 0..=ROUNDS {
                for (k, op) in ops.iter().enumerate() {
                    let seconds = buffers[k].run(&*ranks.comm, rank, op, next..next + per_round)?;
                    next += per_round;
                    if round > 0 {
                        samples[k].push(seconds / per_round as f64);
                    }
                }
                if let (Some(job), Some((input, output))) = (&ranks.job, &mut raw) {
                    let start = Instant::now();
                    for _ in 0..per_round {
                        job.raw_all_reduce(bytes(input), bytes_mut(output))?;
                    }
                    if round > 0 {
                        samples[ops.len()].push(start.elapsed().as_secs_f64() / per_round as f64);
                    }
                }
            }
            for (op, buffers) in ops.iter().zip(&buffers) {
                buffers.check(rank, n, op)?;
            }
            Ok(samples.iter().map(|s| median(s)).collect())
        })?;
        seq = first + (ROUNDS as u64 + 1) * per_round * ops.len() as u64;
        for (op, seconds) in ops.iter().zip(&medians) {
            report(ranks, op.kind.name(), mib, backend, *seconds, bus_factor(op.kind, n));
        }
        if ranks.job.is_some() {
            let raw = medians[ops.len()];
            report(ranks, "MPI_Allreduce", mib, "raw", raw, bus_factor(Collective::AllReduce, n));
            if ranks.reports() {
                println!("{:<16} {mib:>8} {:>9} {:>+9.1}%", "all_reduce/raw", "", 100.0 * (medians[0] / raw - 1.0));
            }
        }
    }
    overlap(ranks, args, backend, seq)
}

/// `--device cuda`: every collective on NCCL, checked and timed on device buffers (see the
/// module doc).
fn bench_nccl(ranks: &Ranks, args: &BenchCommArgs) -> Result<()> {
    use autotp_runtime::gpu::collectives::NcclCall;
    use autotp_runtime::gpu::{CommPath, GemmMath, GpuKind};
    use autotp_runtime::streams::Stream;
    let n = ranks.world;
    let emulated = std::env::var("AUTOTP_GPU").as_deref() == Ok("emulated");
    if !emulated {
        autotp_runtime::cuda::probe()?;
    }
    let ordinal = |rank: usize| match &ranks.job {
        Some(_) => autotp_runtime::launch::discover().map(|place| place.local_rank),
        None => Ok(rank),
    };
    if ranks.reports() {
        println!(
            "{:<16} {:>8} {:>9} {:>10} {:>12} {:>12}",
            "collective", "MiB", "backend", "ms", "algbw GB/s", "busbw GB/s"
        );
    }
    let mut ops = Vec::new();
    for &mib in &args.sizes {
        let elements = (mib << 20) / 4;
        ensure!(elements % n == 0, "{mib} MiB does not split over {n} ranks");
        ops.extend(KINDS.iter().map(|&kind| op_of(kind, elements, n)));
    }
    // Each rank: its GPU, one communicator, then every size and collective (seconds per call).
    let seconds = ranks.slowest(|rank| {
        let kind = match emulated {
            true => GpuKind::Emulated { math: GemmMath::F32 },
            false => GpuKind::Cuda { ordinal: ordinal(rank)?, math: GemmMath::F32 },
        };
        let mut gpu = kind.open(&autotp_program::Program::bare(vec![], vec![], 0))?;
        let mesh = [autotp_program::mesh::MeshAxis { name: "world".into(), size: n }];
        let paths = autotp_runtime::gpu::bootstrap(gpu.as_mut(), &mesh, &[], rank, &*ranks.comm, &mut [0])?;
        let comm = match &paths.axes[0] {
            CommPath::Nccl { comm } => *comm,
            CommPath::Host { why } => bail!("NCCL cannot join these ranks: {why}"),
        };
        let mut times = Vec::new();
        for op in &ops {
            let mut buffers = Buffers::new(rank, n, op);
            let input = gpu.alloc(buffers.input.len() * 4)?;
            let output = gpu.alloc(buffers.output.len() * 4)?;
            gpu.upload(Stream::Collectives, input, bytes(&buffers.input))?;
            let (send, recv, dtype) = (input, output, DType::F32);
            let call = match op.kind {
                Collective::AllReduce => NcclCall::AllReduce { send, recv, count: buffers.input.len(), dtype },
                Collective::AllGather { .. } => NcclCall::AllGather { send, recv, count: buffers.input.len(), dtype },
                // Pieces along dim 0 of [n, m], placed along dim 1 of [1, n * m]: contiguous.
                Collective::AllToAll { .. } => NcclCall::AllToAll { send, recv, count: buffers.input.len() / n, dtype },
                Collective::RingShift { .. } => {
                    let (next, previous) = ((rank + 1) % n, (rank + n - 1) % n);
                    NcclCall::RingShift { send, recv, count: buffers.input.len(), dtype, next, previous }
                }
                _ => NcclCall::ReduceScatter { send, recv, count: buffers.output.len(), dtype },
            };
            let mut run = |calls: usize| -> Result<f64> {
                let start = Instant::now();
                for _ in 0..calls {
                    gpu.nccl(Stream::Collectives, comm, &call)?;
                }
                gpu.synchronize()?;
                Ok(start.elapsed().as_secs_f64() / calls as f64)
            };
            run(3)?;
            times.push(run(args.iters)?);
            gpu.download(Stream::Collectives, output, bytes_mut(&mut buffers.output))?;
            buffers.check(rank, n, op)?;
        }
        Ok(times)
    })?;
    for (op, time) in ops.iter().zip(seconds) {
        let mib = (op.shape.iter().product::<usize>() * 4) >> 20;
        report(ranks, op.kind.name(), mib, "nccl", time, bus_factor(op.kind, n));
    }
    Ok(())
}

/// Checks the bootstrap a communicator starts from: rank 0's 128 random bytes reach every rank
/// through the rendezvous.
fn check_bootstrap(ranks: &Ranks, job: &MpiComm) -> Result<()> {
    let n = ranks.world;
    let place = autotp_runtime::launch::discover()?;
    let mut id = [0u8; autotp_runtime::rendezvous::SHARED_BYTES];
    if job.rank() == 0 {
        // Random bytes: the low bits of the clock, mixed.
        let mut state = Instant::now().elapsed().as_nanos() as u64 ^ 0x9e37_79b9_7f4a_7c15 ^ std::process::id() as u64;
        for b in &mut id {
            state = state.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
            *b = (state >> 56) as u8;
        }
    }
    let root = (job.rank() == 0).then_some(&id);
    let shared = autotp_runtime::rendezvous::share_from_root(Some(job), &place, root, Duration::from_secs(60))?;
    let all = job.all_gather(&shared)?;
    ensure!(all.chunks(shared.len()).all(|c| c == shared), "the ranks got different bytes from rank 0");
    if ranks.reports() {
        println!("bootstrap: rank 0's 128 bytes reached all {n} ranks through MPI");
    }
    Ok(())
}

/// How much of an all-reduce of the largest size hides behind matmuls: on a communication
/// thread, and with MPI also driven by the compute thread (a non-blocking all-reduce tested
/// between matmuls). `seq` is the next collective's sequence number.
fn overlap(ranks: &Ranks, args: &BenchCommArgs, backend: &str, mut seq: u64) -> Result<()> {
    let n = ranks.world;
    // Overlap: an all-reduce of the largest size on a communication thread, beside matmuls.
    let mib = *args.sizes.iter().max().expect("checked non-empty");
    let op = CollectiveOp { kind: Collective::AllReduce, axis: 0, dtype: DType::F32, shape: vec![(mib << 20) / 4] };
    let comm_alone = ranks.slowest_one(|rank| time_collective(&*ranks.comm, rank, n, &op, seq..seq + 6))?;
    seq += 6;
    let product = matmul_seconds()?;
    let matmuls = ((comm_alone / product).round() as usize).max(1);
    let compute_alone = ranks.slowest_one(|_| {
        let start = Instant::now();
        for _ in 0..matmuls {
            run_matmul()?;
        }
        Ok(start.elapsed().as_secs_f64())
    })?;
    let both = ranks.slowest_one(|rank| {
        let mut buffers = Buffers::new(rank, n, &op);
        let start = Instant::now();
        let both = std::thread::scope(|scope| -> Result<()> {
            let communication = scope.spawn(|| buffers.run(&*ranks.comm, rank, &op, seq..seq + 1));
            for _ in 0..matmuls {
                run_matmul()?;
            }
            communication.join().expect("the communication thread")?;
            Ok(())
        });
        let seconds = start.elapsed().as_secs_f64();
        both?;
        buffers.check(rank, n, &op)?;
        Ok(seconds)
    })?;
    // The same, driven by the compute thread: a non-blocking all-reduce tested between matmuls.
    if let Some(job) = &ranks.job {
        let elements = op.shape[0];
        let driven = ranks.slowest_one(|_| {
            let input = vec![1f32; elements];
            let mut output = vec![0f32; elements];
            job.barrier()?;
            let start = Instant::now();
            let mut request = job.raw_start_all_reduce(bytes(&input), bytes_mut(&mut output))?;
            let mut done = false;
            for _ in 0..matmuls {
                run_matmul()?;
                done = done || job.raw_test(&mut request)?;
            }
            while !done {
                done = job.raw_test(&mut request)?;
            }
            Ok(start.elapsed().as_secs_f64())
        })?;
        if ranks.reports() {
            let hidden = (compute_alone + comm_alone - driven) / compute_alone.min(comm_alone);
            println!(
                "overlap (mpi, driven by the compute thread): both at once {:.1} ms: {:.0}% of the shorter hidden",
                driven * 1e3,
                100.0 * hidden.clamp(0.0, 1.0)
            );
        }
    }
    if ranks.reports() {
        let hidden = (compute_alone + comm_alone - both) / compute_alone.min(comm_alone);
        println!(
            "overlap ({backend}): all_reduce of {mib} MiB {:.1} ms alone, {matmuls} matmuls 512^3 {:.1} ms alone, both at \
             once {:.1} ms: {:.0}% of the shorter hidden",
            comm_alone * 1e3,
            compute_alone * 1e3,
            both * 1e3,
            100.0 * hidden.clamp(0.0, 1.0)
        );
    }
    Ok(())
}

/// Rounds of timed calls (after one of warm-up); a table entry is the median round.
const ROUNDS: usize = 5;

fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    sorted.get(sorted.len() / 2).copied().unwrap_or(f64::NAN)
}

fn report(ranks: &Ranks, name: &str, mib: usize, backend: &str, seconds: f64, bus: f64) {
    if ranks.reports() {
        let algbw = (mib << 20) as f64 / seconds / 1e9;
        println!("{name:<16} {mib:>8} {backend:>9} {:>10.3} {algbw:>12.2} {:>12.2}", seconds * 1e3, algbw * bus);
    }
}

/// nccl-tests' bus bandwidth factor: the share of the buffer each rank's link carries.
fn bus_factor(kind: Collective, n: usize) -> f64 {
    let n = n as f64;
    match kind {
        Collective::AllReduce => 2.0 * (n - 1.0) / n,
        // Each rank's whole buffer to the next (none on one rank).
        Collective::RingShift { .. } => (n - 1.0).min(1.0),
        _ => (n - 1.0) / n,
    }
}

/// The collectives `bench-comm` checks and times.
const KINDS: [Collective; 5] = [
    Collective::AllReduce,
    Collective::AllGather { dim: 0 },
    Collective::ReduceScatter { dim: 0 },
    Collective::AllToAll { split: 0, concat: 1 },
    Collective::RingShift { dim: 0 },
];

/// `kind` over `elements` f32 per rank: a vector, or for an all-to-all `[n, elements / n]`
/// (row j to rank j; the rows received side by side).
fn op_of(kind: Collective, elements: usize, n: usize) -> CollectiveOp {
    let shape = match kind {
        Collective::AllToAll { .. } => vec![n, elements / n],
        _ => vec![elements],
    };
    CollectiveOp { kind, axis: 0, dtype: DType::F32, shape }
}

/// A rank's input and output of one collective. Rank r's element i is (r + 1) * (i mod 7):
/// small integers every sum keeps exact.
struct Buffers {
    input: Vec<f32>,
    output: Vec<f32>,
}

impl Buffers {
    fn new(rank: usize, n: usize, op: &CollectiveOp) -> Buffers {
        let elements: usize = op.shape.iter().product();
        let input = (0..elements).map(|i| ((rank + 1) * (i % 7)) as f32).collect();
        let out_elements = match op.kind {
            Collective::AllGather { .. } => elements * n,
            Collective::ReduceScatter { .. } => elements / n,
            _ => elements,
        };
        Buffers { input, output: vec![0f32; out_elements] }
    }

    /// Runs `op` as `rank` for each sequence number of `calls`; returns the seconds they took.
    fn run(
        &mut self,
        comm: &dyn Communicator,
        rank: usize,
        op: &CollectiveOp,
        calls: std::ops::Range<u64>,
    ) -> Result<f64> {
        let start = Instant::now();
        for seq in calls {
            comm.collective(rank, op, seq, bytes(&self.input), bytes_mut(&mut self.output))?;
        }
        Ok(start.elapsed().as_secs_f64())
    }

    /// Checks the output of `op` for `rank` of `n`.
    fn check(&self, rank: usize, n: usize, op: &CollectiveOp) -> Result<()> {
        let (elements, out_elements) = (self.input.len(), self.output.len());
        let ranks_sum = (n * (n + 1) / 2) as f32;
        let expected = |i: usize| -> f32 {
            match op.kind {
                Collective::AllReduce => ranks_sum * (i % 7) as f32,
                Collective::AllGather { .. } => ((i / elements + 1) * (i % elements % 7)) as f32,
                Collective::ReduceScatter { .. } => ranks_sum * ((rank * out_elements + i) % 7) as f32,
                // Rank `from`'s row `rank` of its [n, m] block, m = elements / n.
                Collective::AllToAll { .. } => {
                    let (from, m) = (i / (elements / n), elements / n);
                    ((from + 1) * ((rank * m + i % m) % 7)) as f32
                }
                // The previous rank's block.
                Collective::RingShift { .. } => (((rank + n - 1) % n + 1) * (i % 7)) as f32,
                Collective::ShardSlice { .. } => unreachable!("not benchmarked"),
            }
        };
        if let Some(i) = (0..out_elements).find(|&i| self.output[i] != expected(i)) {
            bail!("rank {rank}: {} element {i} is {}, expected {}", op.kind.name(), self.output[i], expected(i));
        }
        Ok(())
    }
}

/// Runs `op` as `rank` for the sequence numbers `calls`, the first three untimed, checks the
/// result, and returns the mean seconds per timed call.
fn time_collective(
    comm: &dyn Communicator,
    rank: usize,
    n: usize,
    op: &CollectiveOp,
    calls: std::ops::Range<u64>,
) -> Result<f64> {
    let mut buffers = Buffers::new(rank, n, op);
    let timed = calls.start + 3..calls.end;
    buffers.run(comm, rank, op, calls.start..timed.start)?;
    let seconds = buffers.run(comm, rank, op, timed.clone())? / (timed.end - timed.start) as f64;
    buffers.check(rank, n, op)?;
    Ok(seconds)
}

const MATMUL: usize = 512;

fn run_matmul() -> Result<()> {
    thread_local! {
        static OPERANDS: (Vec<f32>, Vec<f32>) = (vec![0.5; MATMUL * MATMUL], vec![0.25; MATMUL * MATMUL]);
    }
    let dims = MatMulDims {
        batch: vec![],
        lhs_batch: vec![],
        rhs_batch: vec![],
        m: MATMUL,
        k: MATMUL,
        n: MATMUL,
        transpose_lhs: false,
        transpose_rhs: false,
        lhs_layout: None,
        rhs_layout: None,
    };
    let mut out = vec![0f32; MATMUL * MATMUL];
    OPERANDS.with(|(a, b)| {
        Kernel::MatMul { dtype: DType::F32, dims }.run(&[bytes(a), bytes(b)], &mut [bytes_mut(&mut out)])
    })?;
    Ok(())
}

/// Seconds of one matmul on this thread (the best of five).
fn matmul_seconds() -> Result<f64> {
    let mut best = f64::MAX;
    for _ in 0..5 {
        let start = Instant::now();
        run_matmul()?;
        best = best.min(start.elapsed().as_secs_f64());
    }
    Ok(best)
}

fn bytes(values: &[f32]) -> &[u8] {
    // SAFETY: f32 has no padding and every byte pattern is a valid u8.
    unsafe { std::slice::from_raw_parts(values.as_ptr().cast(), std::mem::size_of_val(values)) }
}

fn bytes_mut(values: &mut [f32]) -> &mut [u8] {
    // SAFETY: as `bytes`; every byte pattern is also a valid f32.
    unsafe { std::slice::from_raw_parts_mut(values.as_mut_ptr().cast(), std::mem::size_of_val(values)) }
}
