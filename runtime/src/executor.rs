//! The CPU executor: one arena per program (per rank), parameters and constants loaded once,
//! then instructions run in order: builtin kernels (multi-threaded with rayon inside) and
//! collectives through the rank's communicator.

use std::sync::Arc;

use autotp_kernels::AlignedBuf;

use crate::comm::LocalComm;
use crate::{Instruction, Program, Region, RuntimeError};

/// A host tensor handed to or returned by the executor.
#[derive(Clone, Debug, PartialEq)]
pub struct HostTensor {
    pub dtype: autotp_kernels::DType,
    pub shape: Vec<usize>,
    pub data: Vec<u8>,
}

/// A loaded program with its arena.
pub struct Executor {
    program: Program,
    arena: AlignedBuf,
    /// This rank and its communicator, for programs on a mesh.
    rank: Option<(usize, Arc<LocalComm>)>,
}

impl Executor {
    /// Validates a one-device program and allocates its arena; constants are written now.
    pub fn new(program: Program) -> Result<Executor, RuntimeError> {
        if program.mesh.iter().any(|a| a.size > 1) {
            return Err(RuntimeError::InvalidProgram("a program on a mesh needs a rank and a communicator".into()));
        }
        Executor::build(program, None)
    }

    /// Loads a program on a mesh as rank `rank` of `comm`.
    pub fn for_rank(program: Program, rank: usize, comm: Arc<LocalComm>) -> Result<Executor, RuntimeError> {
        let sizes: Vec<usize> = program.mesh.iter().map(|a| a.size).collect();
        if sizes.iter().product::<usize>() != comm.world_size() || rank >= comm.world_size() {
            return Err(RuntimeError::InvalidProgram(format!(
                "rank {rank} of a {}-rank communicator cannot run a program on mesh {sizes:?}",
                comm.world_size()
            )));
        }
        Executor::build(program, Some((rank, comm)))
    }

    fn build(program: Program, rank: Option<(usize, Arc<LocalComm>)>) -> Result<Executor, RuntimeError> {
        program.validate()?;
        let mut arena = AlignedBuf::zeroed(program.memory.arena_bytes);
        for c in &program.constants {
            arena.as_mut_slice()[c.region.offset..c.region.end()].copy_from_slice(&c.bytes);
        }
        Ok(Executor { program, arena, rank })
    }

    pub fn program(&self) -> &Program {
        &self.program
    }

    /// Bytes of the arena this executor allocated.
    pub fn arena_bytes(&self) -> usize {
        self.arena.len()
    }

    /// The current bytes of a parameter or state.
    pub fn read_slot(&self, name: &str) -> Option<&[u8]> {
        let slot = self.program.params.iter().chain(&self.program.states).find(|s| s.name == name)?;
        Some(&self.arena.as_slice()[slot.region.offset..slot.region.end()])
    }

    /// Loads the bytes of a parameter (from a weights file or an initializer) or of an optimizer
    /// state (from a checkpoint).
    pub fn load_slot(&mut self, name: &str, bytes: &[u8]) -> Result<(), RuntimeError> {
        let slot = self
            .program
            .params
            .iter()
            .chain(&self.program.states)
            .find(|s| s.name == name)
            .ok_or_else(|| RuntimeError::UnknownParam(name.to_string()))?;
        if bytes.len() != slot.region.len {
            return Err(RuntimeError::WrongSize {
                what: format!("'{name}'"),
                expected: slot.region.len,
                got: bytes.len(),
            });
        }
        self.arena.as_mut_slice()[slot.region.offset..slot.region.end()].copy_from_slice(bytes);
        Ok(())
    }

    /// Runs the program on `inputs` (in the program's input order) and returns its outputs.
    pub fn run(&mut self, inputs: &[HostTensor]) -> Result<Vec<HostTensor>, RuntimeError> {
        if inputs.len() != self.program.inputs.len() {
            return Err(RuntimeError::InputCount { expected: self.program.inputs.len(), got: inputs.len() });
        }
        for (slot, t) in self.program.inputs.iter().zip(inputs) {
            if t.dtype != slot.dtype || t.shape != slot.shape {
                return Err(RuntimeError::InputType {
                    name: slot.name.clone(),
                    expected: format!("{}{:?}", slot.dtype, slot.shape),
                    got: format!("{}{:?}", t.dtype, t.shape),
                });
            }
            self.arena.as_mut_slice()[slot.region.offset..slot.region.end()].copy_from_slice(&t.data);
        }
        let base = self.arena.as_mut_slice().as_mut_ptr();
        for instruction in &self.program.instructions {
            // SAFETY: `Program::validate` checked every region is inside the arena and that an
            // instruction's outputs overlap neither its inputs nor each other, so these slices
            // are disjoint where one is mutable. Inputs may alias each other (shared reads).
            let region = |r: &Region| unsafe { std::slice::from_raw_parts(base.add(r.offset), r.len) };
            let region_mut = |r: &Region| unsafe { std::slice::from_raw_parts_mut(base.add(r.offset), r.len) };
            match instruction {
                Instruction::Kernel { kernel, inputs, outputs, label } => {
                    let ins: Vec<&[u8]> = inputs.iter().map(region).collect();
                    let mut outs: Vec<&mut [u8]> = outputs.iter().map(region_mut).collect();
                    kernel
                        .run(&ins, &mut outs)
                        .map_err(|source| RuntimeError::Kernel { label: label.clone(), source })?;
                }
                Instruction::Collective { op, input, output, label } => {
                    let (rank, comm) = self.rank.as_ref().ok_or_else(|| {
                        RuntimeError::InvalidProgram(format!("{label}: a collective needs a communicator"))
                    })?;
                    comm.collective(*rank, op, region(input), region_mut(output))?;
                }
            }
        }
        let arena = self.arena.as_mut_slice();
        for u in &self.program.updates {
            arena.copy_within(u.from.offset..u.from.end(), u.to.offset);
        }
        let arena = self.arena.as_slice();
        Ok(self
            .program
            .outputs
            .iter()
            .map(|s| HostTensor {
                dtype: s.dtype,
                shape: s.shape.clone(),
                data: arena[s.region.offset..s.region.end()].to_vec(),
            })
            .collect())
    }
}
