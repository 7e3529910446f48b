//! An offloaded optimizer's step on a GPU, as ZeRO-Offload runs it: the optimizer states (and a
//! 16-bit model's f32 masters) stay in host memory (the program's host pool), the GPU computes
//! the gradients, and the host updates them with the same generated x86 kernel the CPU device
//! runs, so the result is the CPU's bit for bit.
//!
//! The offloaded tensors of a step are cut into groups of at most [`GROUP_ELEMENTS`] elements.
//! For each group, the pieces of its arena-resident inputs (the gradients, and an f32 model's
//! parameters) are downloaded into host staging, the kernel updates the pieces there and in the
//! pool, and the arena-resident results (the new parameters, or a 16-bit model's copies of the
//! new masters, cast as the CPU casts them) are uploaded in the stream's order. A thread
//! downloads group `g + 1` while the host updates group `g`, so the copies overlap the update.
//! The staging is [`STAGING_BUFFERS`] buffers made once and pinned ([`Gpu::pin_host`]), taken
//! in turn: uploads from a pinned buffer read it when the stream reaches them, and the next
//! download into the same buffer is issued after them on the same stream, so it cannot
//! overwrite them first.
//! The step's scalars (and its guard, under fp16/bf16's skipping of non-finite steps) are read
//! back first; a false guard skips the step, as on the CPU. Parameter shards in the pool
//! (`--offload-param cpu`) are updated there, and a 16-bit model's copies cast there; the
//! device uploads them before each gather ([`offloaded_param_reader`] refuses a program that
//! reads them otherwise).

use std::ops::Range;
use std::sync::Mutex;

use autotp_kernels::optim::TensorUpdate;
use autotp_kernels::{AlignedBuf, DType};
use autotp_llvm::CpuKernel;
use autotp_program::{OptimizerTensor, Region};

use super::Gpu;
use crate::streams::Stream;
use crate::RuntimeError;

/// Elements of a group: large enough that a copy's fixed cost is small, small enough that the
/// first download and last upload, which nothing overlaps, are short.
pub(crate) const GROUP_ELEMENTS: usize = 1 << 22;

/// Staging buffers of a step: one being updated and uploaded, one downloaded and waiting, one
/// being downloaded.
const STAGING_BUFFERS: usize = 3;

/// One piece of an arena region that a group stages on the host.
#[derive(Clone, Copy, Debug)]
struct Staged {
    /// The piece in the arena.
    region: Region,
    /// Its offset in the group's staging.
    at: usize,
}

/// A tensor's elements in a group, and where its arena-resident inputs and outputs are staged
/// (by position in the tensor's lists; `None` for those in the host pool).
#[derive(Clone, Debug)]
struct Piece {
    tensor: usize,
    elements: Range<usize>,
    inputs: Vec<Option<Staged>>,
    /// Outputs not updated in place, staged apart.
    outputs: Vec<Option<Staged>>,
    /// The 16-bit copy's piece, cast from the new master: into staging and uploaded, or (an
    /// offloaded parameter's, `--offload-param`) into the host pool.
    copy: Option<(CopyTo, DType)>,
}

/// Where a piece of a 16-bit copy goes.
#[derive(Clone, Copy, Debug)]
enum CopyTo {
    Staged(Staged),
    /// `len` bytes of the host pool at `start`.
    InPool {
        start: usize,
        len: usize,
    },
}

#[derive(Clone, Debug)]
struct Group {
    pieces: Vec<Piece>,
    /// Bytes of its staging.
    bytes: usize,
}

/// The host side of one optimizer step's offloaded tensors (see the module doc).
pub(crate) struct OffloadedStep {
    groups: Vec<Group>,
    /// The generated x86 kernel of the step's update rule.
    kernel: CpuKernel,
    /// The pinned staging buffers, each as large as the largest group's staging; locked for a
    /// whole step, so that nothing frees them while a copy may still read them.
    staging: Mutex<Vec<AlignedBuf>>,
}

impl OffloadedStep {
    /// The groups of at most `group_elements` elements (the runtime's are [`GROUP_ELEMENTS`]) of
    /// `tensors`' offloaded ones (those with a region in the host pool), with their staging
    /// pinned on `gpu`.
    pub(crate) fn new(
        gpu: &mut dyn Gpu,
        dtype: DType,
        tensors: &[OptimizerTensor],
        kernel: CpuKernel,
        group_elements: usize,
    ) -> Result<OffloadedStep, RuntimeError> {
        let size = dtype.size();
        let mut groups = vec![Group { pieces: Vec::new(), bytes: 0 }];
        let mut filled = 0;
        for (t, tensor) in tensors.iter().enumerate().filter(|(_, t)| offloaded(t)) {
            let n = tensor.inputs[0].len / size;
            let mut start = 0;
            while start < n {
                if filled == group_elements {
                    groups.push(Group { pieces: Vec::new(), bytes: 0 });
                    filled = 0;
                }
                let end = (start + group_elements - filled).min(n);
                let group = groups.last_mut().expect("one at least");
                let mut stage = |region: &Region, element_size: usize| -> Option<Staged> {
                    (!region.in_host_pool()).then(|| {
                        let piece =
                            Region { offset: region.offset + start * element_size, len: (end - start) * element_size };
                        let at = group.bytes.next_multiple_of(64);
                        group.bytes = at + piece.len;
                        Staged { region: piece, at }
                    })
                };
                let inputs: Vec<Option<Staged>> = tensor.inputs.iter().map(|r| stage(r, size)).collect();
                let outputs = (tensor.outputs.iter().enumerate())
                    .map(|(j, r)| match *r == tensor.inputs[input_of(j)] {
                        true => None,
                        false => stage(r, size),
                    })
                    .collect();
                let copy = tensor.copy.map(|(region, to)| match stage(&region, to.size()) {
                    Some(staged) => (CopyTo::Staged(staged), to),
                    None => {
                        let at = region.offset - autotp_program::HOST_POOL + start * to.size();
                        (CopyTo::InPool { start: at, len: (end - start) * to.size() }, to)
                    }
                });
                group.pieces.push(Piece { tensor: t, elements: start..end, inputs, outputs, copy });
                filled += end - start;
                start = end;
            }
        }
        groups.retain(|g| !g.pieces.is_empty());
        let largest = groups.iter().map(|g| g.bytes).max().unwrap_or(0);
        let mut staging: Vec<AlignedBuf> = (0..STAGING_BUFFERS).map(|_| AlignedBuf::zeroed(largest)).collect();
        for buffer in &mut staging {
            gpu.pin_host(buffer.as_mut_slice().as_mut_ptr() as usize, buffer.len())?;
        }
        Ok(OffloadedStep { groups, kernel, staging: Mutex::new(staging) })
    }

    /// Runs the step's offloaded part on `stream` (see the module doc): `base` is the arena's
    /// device address, `scalars` the step's scalars read back, aligned for `dtype`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn run(
        &self,
        gpu: &Mutex<Box<dyn Gpu>>,
        stream: Stream,
        base: u64,
        host_pool: &mut [u8],
        dtype: DType,
        tensors: &[OptimizerTensor],
        scalars: &[AlignedBuf],
        label: &str,
    ) -> Result<(), RuntimeError> {
        let lock = || gpu.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let mut buffers = self.staging.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        // Each buffer's start and length: the download thread and this one use a buffer in
        // turn, handing its index over a channel.
        let buffers: Vec<(usize, usize)> =
            buffers.iter_mut().map(|b| (b.as_mut_slice().as_mut_ptr() as usize, b.len())).collect();
        let staging_of = |buffer: usize| -> &mut [u8] {
            let (start, len) = buffers[buffer];
            // SAFETY: one of the step's buffers, held by the lock above for the whole step, and
            // used by one thread at a time (the index is handed over).
            unsafe { std::slice::from_raw_parts_mut(start as *mut u8, len) }
        };
        let download = |group: &Group, buffer: usize| -> Result<usize, RuntimeError> {
            let staging = staging_of(buffer);
            let mut gpu = lock();
            for staged in group.pieces.iter().flat_map(|p| p.inputs.iter().flatten()) {
                let into = &mut staging[staged.at..staged.at + staged.region.len];
                gpu.download(stream, base + staged.region.offset as u64, into)?;
            }
            Ok(buffer)
        };
        let scalar_pointers: Vec<*mut u8> = scalars.iter().map(|s| s.as_slice().as_ptr() as *mut u8).collect();
        let pool = host_pool.as_mut_ptr() as usize;
        std::thread::scope(|scope| -> Result<(), RuntimeError> {
            let (ready, staged) = std::sync::mpsc::sync_channel::<Result<usize, RuntimeError>>(1);
            let (free, freed) = std::sync::mpsc::sync_channel::<usize>(STAGING_BUFFERS);
            for buffer in 0..STAGING_BUFFERS {
                free.send(buffer).map_err(|_| RuntimeError::Device("the offloaded step's buffers".into()))?;
            }
            let downloads = scope.spawn(move || {
                for group in &self.groups {
                    let Ok(buffer) = freed.recv() else { return };
                    let downloaded = download(group, buffer);
                    let failed = downloaded.is_err();
                    if ready.send(downloaded).is_err() || failed {
                        return;
                    }
                }
            });
            for group in &self.groups {
                let buffer = staged
                    .recv()
                    .map_err(|_| RuntimeError::Device("the offloaded step's download thread stopped".into()))??;
                let staging = staging_of(buffer);
                let stage_base = staging.as_mut_ptr() as usize;
                let updates: Vec<TensorUpdate> =
                    group.pieces.iter().map(|p| p.update(dtype, &tensors[p.tensor], pool, stage_base)).collect();
                let mut chunks = Vec::new();
                for update in &updates {
                    crate::optimizer_step::push_chunks(dtype, update, 0..update.len, &mut chunks);
                }
                // SAFETY: every pointer is a piece of the host pool or of this group's staging
                // of the piece's length (made above); outputs are their inputs or apart.
                unsafe { crate::cpu::run_chunks(self.kernel, &scalar_pointers, &chunks) };
                let mut gpu = lock();
                for (piece, update) in group.pieces.iter().zip(&updates) {
                    for (j, output) in piece.outputs.iter().enumerate() {
                        // An arena output updated in place went back into its input's staging.
                        if let Some(staged) = output.or(piece.inputs[input_of(j)]) {
                            let bytes = &staging[staged.at..staged.at + staged.region.len];
                            gpu.upload(stream, base + staged.region.offset as u64, bytes)?;
                        }
                    }
                    if let Some((copy, to)) = piece.copy {
                        // SAFETY: the new master's piece, in the pool or this group's staging.
                        let master = unsafe { std::slice::from_raw_parts(update.param_out, update.len * dtype.size()) };
                        match copy {
                            CopyTo::Staged(staged) => {
                                let mut cast = vec![0u8; staged.region.len];
                                crate::cpu::cast_master(dtype, to, master, &mut cast, label)?;
                                gpu.upload(stream, base + staged.region.offset as u64, &cast)?;
                            }
                            CopyTo::InPool { start, len } => {
                                // SAFETY: a piece of the host pool apart from the master (the
                                // program's regions are validated disjoint).
                                let into = unsafe { std::slice::from_raw_parts_mut((pool + start) as *mut u8, len) };
                                crate::cpu::cast_master(dtype, to, master, into, label)?;
                            }
                        }
                    }
                }
                drop(gpu);
                // The download thread may be done and gone: then nothing needs the buffer.
                let _ = free.send(buffer);
            }
            drop(staged);
            downloads.join().expect("the download thread does not panic");
            Ok(())
        })
    }
}

/// The input an output of an optimizer tensor updates: the parameter, then the states.
fn input_of(output: usize) -> usize {
    if output == 0 {
        0
    } else {
        output + 1
    }
}

/// Whether any of `tensor`'s regions is in the host pool.
pub(crate) fn offloaded(tensor: &OptimizerTensor) -> bool {
    tensor.inputs.iter().chain(&tensor.outputs).any(Region::in_host_pool)
}

impl Piece {
    /// The update of the piece's elements at the pool (`pool`) and its group's staging
    /// (`staging`): host addresses, never dereferenced here.
    fn update(&self, dtype: DType, tensor: &OptimizerTensor, pool: usize, staging: usize) -> TensorUpdate {
        let size = dtype.size();
        let at = |region: &Region, staged: Option<Staged>| -> *mut u8 {
            match staged {
                Some(staged) => (staging + staged.at) as *mut u8,
                None => (pool + region.offset - autotp_program::HOST_POOL + self.elements.start * size) as *mut u8,
            }
        };
        let input = |k: usize| at(&tensor.inputs[k], self.inputs[k]);
        let output = |j: usize| match self.outputs[j] {
            Some(staged) => (staging + staged.at) as *mut u8,
            None if tensor.outputs[j] == tensor.inputs[input_of(j)] => input(input_of(j)),
            None => at(&tensor.outputs[j], None),
        };
        let mut states = [std::ptr::null(); 2];
        let mut states_out = [std::ptr::null_mut(); 2];
        for k in 0..tensor.inputs.len().saturating_sub(2) {
            states[k] = input(k + 2) as *const u8;
            states_out[k] = output(k + 1);
        }
        TensorUpdate {
            len: self.elements.len(),
            param: input(0),
            grad: input(1),
            states,
            param_out: output(0),
            states_out,
        }
    }
}

/// The first instruction that reads or writes an offloaded parameter where a GPU rank cannot:
/// anything but a collective's input (uploaded first) or an optimizer step (the host's).
pub(crate) fn offloaded_param_reader(program: &autotp_program::Program) -> Option<String> {
    let offloaded: Vec<&Region> = program.params.iter().map(|s| &s.region).filter(|r| r.in_host_pool()).collect();
    program.instructions.iter().find_map(|instruction| {
        let touched = match instruction {
            autotp_program::Instruction::Collective { output, .. }
            | autotp_program::Instruction::CollectiveStart { output, .. } => vec![*output],
            autotp_program::Instruction::OptimizerStep { .. } => vec![],
            _ => {
                let (inputs, outputs) = instruction.regions();
                inputs.into_iter().chain(outputs).collect()
            }
        };
        touched.iter().any(|r| offloaded.iter().any(|p| p.overlaps(r))).then(|| instruction.label().to_string())
    })
}

#[cfg(test)]
mod tests {
    use autotp_kernels::optim::{AdamWConfig, Optimizer, OptimizerKernel};
    use autotp_kernels::Kernel;
    use autotp_program::HOST_POOL;

    use super::*;
    use crate::gpu::emulated::Emulator;
    use crate::gpu::GemmMath;

    /// Three f32 tensors (parameters and gradients on the device, moments offloaded) in groups
    /// of 4 elements, so pieces straddle groups and the download thread runs ahead: the
    /// parameters and moments are the builtin AdamW kernel's, bit for bit.
    #[test]
    fn groups_of_an_offloaded_step_update_like_the_builtin_kernel() -> Result<(), RuntimeError> {
        let sizes = [5usize, 13, 7];
        let numel: usize = sizes.iter().sum();
        let config = AdamWConfig { beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1 };
        let values = |seed: usize, n: usize| -> Vec<f32> {
            (0..n).map(|i| (((i + seed * 31) * 7919) % 1000) as f32 * 1e-3 - 0.4).collect()
        };
        let bytes = |v: &[f32]| -> Vec<u8> { v.iter().flat_map(|x| x.to_le_bytes()).collect() };
        let region = |offset: usize, n: usize| Region { offset: offset * 4, len: n * 4 };
        // Arena: parameters then gradients; pool: first then second moments.
        let (mut tensors, mut start) = (Vec::new(), 0);
        for &n in &sizes {
            let param = region(start, n);
            let moments = [region(start, n), region(numel + start, n)]
                .map(|r| Region { offset: HOST_POOL + r.offset, len: r.len });
            tensors.push(OptimizerTensor {
                inputs: vec![param, region(numel + start, n), moments[0], moments[1]],
                outputs: vec![param, moments[0], moments[1]],
                copy: None,
            });
            start += n;
        }
        let (params, grads, pool) = (values(1, numel), values(2, numel), [values(3, numel), values(4, numel)].concat());
        let mut gpu: Box<dyn Gpu> =
            Box::new(Emulator::new(&autotp_program::Program::bare(vec![], vec![], 0), GemmMath::F32).unwrap());
        let base = gpu.alloc(2 * numel * 4).unwrap();
        gpu.upload(Stream::Compute, base, &bytes(&[params.clone(), grads.clone()].concat())).unwrap();
        let mut host_pool = bytes(&pool);
        let kind = OptimizerKernel { optimizer: Optimizer::AdamW(config.clone()), dtype: DType::F32 };
        let kernel =
            autotp_llvm::compile_cpu_functions(&[autotp_llvm::Function::OptimizerStep(&kind)]).unwrap().remove(0);
        let step = OffloadedStep::new(gpu.as_mut(), DType::F32, &tensors, kernel, 4)?;
        assert_eq!(step.groups.len(), numel.div_ceil(4));
        let scalars = [AlignedBuf::from_bytes(&2e-3f32.to_le_bytes()), AlignedBuf::from_bytes(&3f32.to_le_bytes())];
        let gpu = Mutex::new(gpu);
        step.run(&gpu, Stream::Compute, base, &mut host_pool, DType::F32, &tensors, &scalars, "step").unwrap();
        let mut arena = vec![0u8; numel * 4];
        gpu.lock().unwrap().download(Stream::Compute, base, &mut arena).unwrap();

        let adamw = Kernel::AdamW { dtype: DType::F32, config };
        let mut at = 0;
        for &n in &sizes {
            let span = at * 4..(at + n) * 4;
            let (p, g) = (&bytes(&params)[span.clone()], &bytes(&grads)[span.clone()]);
            let (m, v) = (&bytes(&pool)[span.clone()], &bytes(&pool)[numel * 4 + span.start..numel * 4 + span.end]);
            let mut outputs = [vec![0u8; n * 4], vec![0u8; n * 4], vec![0u8; n * 4]];
            let [p_out, m_out, v_out] = &mut outputs;
            adamw.run(&[p, g, m, v, scalars[0].as_slice(), scalars[1].as_slice()], &mut [p_out, m_out, v_out]).unwrap();
            assert_eq!(&arena[span.clone()], p_out.as_slice(), "parameters of the tensor at {at}");
            assert_eq!(&host_pool[span.clone()], m_out.as_slice(), "first moments of the tensor at {at}");
            assert_eq!(&host_pool[numel * 4 + span.start..numel * 4 + span.end], v_out.as_slice(), "second moments");
            at += n;
        }
        Ok(())
    }
}
