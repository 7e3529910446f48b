//! A program on a GPU: the host's side of it, written once over the [`Gpu`] interface.
//!
//! [`GpuExecutor`] holds the program's arena as one device allocation, uploads constants,
//! parameters and each step's inputs, runs the program's [`StreamSchedule`] through
//! [`GpuDevice`] (a [`Device`]), applies the step's updates on the device and downloads the
//! outputs. What runs where:
//! - a generated kernel is the plan's kernel entry ([`Entry::Kernel`]) over its buffers' device
//!   addresses, one row per block;
//! - an optimizer step is the multi-tensor entry ([`Entry::OptimizerStep`]) over a table of
//!   chunks built once at load in device memory (the same chunks as the CPU's); its constants
//!   are made on the host from the step's learning rate and step number, read back from the
//!   device (a small copy, the one synchronisation inside a step);
//! - builtin kernels (GEMMs among them, until cuBLAS) run on the host: their inputs are
//!   downloaded when the compute stream reaches them, their outputs uploaded in stream order.
//!
//! [`Gpu`] is what a device provides: memory, copies, launches, streams and events. The CUDA
//! driver will be one; [`emulated::Emulator`] is another, which runs on the host with the same
//! kernels compiled for x86 and streams that run nothing until the host needs a result (then
//! only what that result depends on): a missing event or synchronisation in this module reads
//! stale bytes there, so the host logic is tested without a GPU.

pub mod emulated;

use crate::streams::{Device, Stream, StreamSchedule};
use crate::{HostTensor, Instruction, Program, Region, RuntimeError};

/// A kernel entry of the program's module.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Entry {
    /// `Program::kernels[i]`: arguments are its buffers' addresses; one row per block.
    Kernel(usize),
    /// The `i`th of `Program::optimizer_kernels()`: arguments are the chunk table's address,
    /// the number of chunks and the constants' address; one chunk per block.
    OptimizerStep(usize),
}

/// What a GPU provides to [`GpuDevice`]. Addresses are device addresses; every operation on a
/// stream runs after those issued on it before, and after the events it was told to wait for.
pub trait Gpu {
    type Event;

    /// A zeroed allocation of `bytes`; it lives as long as the `Gpu`.
    fn alloc(&mut self, bytes: usize) -> Result<u64, RuntimeError>;

    /// Copies `bytes` to `address` in `stream`'s order (the host bytes may be reused at once).
    fn upload(&mut self, stream: Stream, address: u64, bytes: &[u8]) -> Result<(), RuntimeError>;

    /// Copies `into.len()` bytes at `address` once `stream` has reached this point, and returns
    /// when they are in `into`.
    fn download(&mut self, stream: Stream, address: u64, into: &mut [u8]) -> Result<(), RuntimeError>;

    /// Copies `len` bytes from `from` to `to` (not overlapping) in `stream`'s order.
    fn copy(&mut self, stream: Stream, from: u64, to: u64, len: usize) -> Result<(), RuntimeError>;

    /// Launches `entry` on `rows` rows (blocks) with these arguments.
    fn launch(&mut self, stream: Stream, entry: Entry, rows: usize, args: &[u64]) -> Result<(), RuntimeError>;

    fn record(&mut self, stream: Stream) -> Result<Self::Event, RuntimeError>;
    fn wait(&mut self, stream: Stream, event: &Self::Event) -> Result<(), RuntimeError>;
    fn synchronize(&mut self) -> Result<(), RuntimeError>;
}

/// Device bytes for an optimizer step's constants (AdamW's are a few scalars).
const CONSTANTS_BYTES: usize = 256;

/// An optimizer step's chunk table in device memory.
struct ChunkTable {
    address: u64,
    chunks: usize,
    /// Device memory for the step's constants (one rule's, as many bytes as it has).
    constants: u64,
}

/// A program's instructions on a [`Gpu`] (see the module doc).
pub struct GpuDevice<G: Gpu> {
    gpu: G,
    /// The arena's device address.
    base: u64,
    /// Per optimizer-step instruction (by index), its table.
    tables: Vec<Option<ChunkTable>>,
}

impl<G: Gpu> GpuDevice<G> {
    fn address(&self, region: &Region) -> u64 {
        self.base + region.offset as u64
    }

    fn download_region(&mut self, stream: Stream, region: &Region) -> Result<Vec<u8>, RuntimeError> {
        let mut bytes = vec![0; region.len];
        self.gpu.download(stream, self.base + region.offset as u64, &mut bytes)?;
        Ok(bytes)
    }
}

impl<G: Gpu> Device for GpuDevice<G> {
    type Event = G::Event;

    fn launch(&mut self, program: &Program, index: usize, stream: Stream) -> Result<(), RuntimeError> {
        match &program.instructions[index] {
            Instruction::Generated { kernel, inputs, outputs, .. } => {
                let args: Vec<u64> = inputs.iter().chain(outputs).map(|r| self.address(r)).collect();
                self.gpu.launch(stream, Entry::Kernel(*kernel), program.kernels[*kernel].outer, &args)
            }
            Instruction::Kernel { kernel, inputs, outputs, label } => {
                let ins = inputs.iter().map(|r| self.download_region(stream, r)).collect::<Result<Vec<_>, _>>()?;
                let mut outs: Vec<Vec<u8>> = outputs.iter().map(|r| vec![0; r.len]).collect();
                let in_slices: Vec<&[u8]> = ins.iter().map(Vec::as_slice).collect();
                let mut out_slices: Vec<&mut [u8]> = outs.iter_mut().map(Vec::as_mut_slice).collect();
                kernel
                    .run(&in_slices, &mut out_slices)
                    .map_err(|source| RuntimeError::Kernel { label: label.clone(), source })?;
                for (region, bytes) in outputs.iter().zip(&outs) {
                    self.gpu.upload(stream, self.address(region), bytes)?;
                }
                Ok(())
            }
            Instruction::OptimizerStep { optimizer, dtype, scalars, label, .. } => {
                let values = scalars.iter().map(|r| self.download_region(stream, r)).collect::<Result<Vec<_>, _>>()?;
                let values: Vec<&[u8]> = values.iter().map(Vec::as_slice).collect();
                let constants = autotp_kernels::optim::constants(optimizer, *dtype, &values)
                    .map_err(|source| RuntimeError::Kernel { label: label.clone(), source })?;
                if constants.len() > CONSTANTS_BYTES {
                    return Err(RuntimeError::InvalidProgram(format!(
                        "{label}: the step's constants exceed {CONSTANTS_BYTES} bytes"
                    )));
                }
                let table = self.tables[index].as_ref().expect("a table per optimizer step, made at load");
                let (address, chunks, constants_at) = (table.address, table.chunks, table.constants);
                self.gpu.upload(stream, constants_at, &constants)?;
                let rule = program
                    .optimizer_kernels()
                    .iter()
                    .position(|k| k.optimizer == *optimizer && k.dtype == *dtype)
                    .expect("the step's rule is among the program's");
                self.gpu.launch(stream, Entry::OptimizerStep(rule), chunks, &[address, chunks as u64, constants_at])
            }
            Instruction::Wait { .. } => Ok(()),
            Instruction::Collective { label, .. }
            | Instruction::CollectiveStart { label, .. }
            | Instruction::Send { label, .. }
            | Instruction::Recv { label, .. } => Err(RuntimeError::InvalidProgram(format!(
                "{label}: GPU ranks do not communicate yet (NCCL is not built); run on --device cpu"
            ))),
        }
    }

    fn record(&mut self, stream: Stream) -> Result<G::Event, RuntimeError> {
        self.gpu.record(stream)
    }

    fn wait(&mut self, stream: Stream, event: &G::Event) -> Result<(), RuntimeError> {
        self.gpu.wait(stream, event)
    }

    fn synchronize(&mut self) -> Result<(), RuntimeError> {
        self.gpu.synchronize()
    }

    fn abort(&mut self, _error: &RuntimeError) {
        let _ = self.gpu.synchronize();
    }
}

/// A one-device program loaded on a [`Gpu`].
pub struct GpuExecutor<G: Gpu> {
    program: Program,
    schedule: StreamSchedule,
    device: GpuDevice<G>,
}

impl<G: Gpu> GpuExecutor<G> {
    /// Validates `program` (one device), allocates its arena on `gpu`, uploads its constants
    /// and builds its optimizer steps' chunk tables. `gpu` holds the program's kernels.
    pub fn new(program: Program, mut gpu: G) -> Result<GpuExecutor<G>, RuntimeError> {
        if program.mesh.iter().any(|a| a.size > 1) {
            return Err(RuntimeError::InvalidProgram(
                "a program on a mesh runs on GPUs once NCCL is built; run on --device cpu".into(),
            ));
        }
        program.validate()?;
        let schedule = StreamSchedule::of(&program)?;
        let base = gpu.alloc(program.memory.arena_bytes)?;
        for c in &program.constants {
            gpu.upload(Stream::Compute, base + c.region.offset as u64, &c.bytes)?;
        }
        let mut tables = Vec::with_capacity(program.instructions.len());
        for instruction in &program.instructions {
            tables.push(match instruction {
                Instruction::OptimizerStep { optimizer, dtype, tensors, .. } => {
                    let chunks = crate::executor::optimizer_chunks(*dtype, tensors, base as usize);
                    // SAFETY: `TensorUpdate` is `repr(C)` plain data (integers and addresses).
                    let bytes = unsafe {
                        std::slice::from_raw_parts(
                            chunks.as_ptr() as *const u8,
                            std::mem::size_of_val(chunks.as_slice()),
                        )
                    };
                    let address = gpu.alloc(bytes.len())?;
                    gpu.upload(Stream::Compute, address, bytes)?;
                    let _ = optimizer;
                    let constants = gpu.alloc(CONSTANTS_BYTES)?;
                    Some(ChunkTable { address, chunks: chunks.len(), constants })
                }
                _ => None,
            });
        }
        gpu.synchronize()?;
        Ok(GpuExecutor { program, schedule, device: GpuDevice { gpu, base, tables } })
    }

    pub fn program(&self) -> &Program {
        &self.program
    }

    fn slot(&self, name: &str) -> Result<Region, RuntimeError> {
        let slot = self.program.params.iter().chain(&self.program.states).find(|s| s.name == name);
        slot.map(|s| s.region).ok_or_else(|| RuntimeError::UnknownParam(name.to_string()))
    }

    /// Uploads a parameter's or state's bytes.
    pub fn load_slot(&mut self, name: &str, bytes: &[u8]) -> Result<(), RuntimeError> {
        let region = self.slot(name)?;
        if bytes.len() != region.len {
            return Err(RuntimeError::WrongSize { what: format!("'{name}'"), expected: region.len, got: bytes.len() });
        }
        let address = self.device.address(&region);
        self.device.gpu.upload(Stream::Compute, address, bytes)
    }

    /// Downloads a parameter's or state's current bytes.
    pub fn read_slot(&mut self, name: &str) -> Result<Vec<u8>, RuntimeError> {
        let region = self.slot(name)?;
        self.device.download_region(Stream::Compute, &region)
    }

    /// Runs the program on `inputs` (in the program's input order) and returns its outputs.
    pub fn run(&mut self, inputs: &[HostTensor]) -> Result<Vec<HostTensor>, RuntimeError> {
        crate::executor::check_inputs(&self.program, inputs)?;
        for (slot, t) in self.program.inputs.iter().zip(inputs) {
            let address = self.device.address(&slot.region);
            self.device.gpu.upload(Stream::Compute, address, &t.data)?;
        }
        crate::streams::drive(&mut self.device, &self.program, &self.schedule)?;
        for u in &self.program.updates {
            let (from, to) = (self.device.address(&u.from), self.device.address(&u.to));
            if from != to {
                self.device.gpu.copy(Stream::Compute, from, to, u.from.len)?;
            }
        }
        let mut outputs = Vec::with_capacity(self.program.outputs.len());
        for slot in &self.program.outputs {
            let data = self.device.download_region(Stream::Compute, &slot.region)?;
            outputs.push(HostTensor { dtype: slot.dtype, shape: slot.shape.clone(), data });
        }
        Ok(outputs)
    }
}
