//! Parameters in files (`--offload-param nvme`, DeepSpeed's `offload_param` with
//! `"device": "nvme"`): the plan's [`NvmeParams`] settings, and the [`ParamSwap`] schedule by
//! which a rank fetches ZeRO-3's parameter shards from its file ahead of their uses and
//! releases them after.
//!
//! Codegen places the shards that `--max-in-cpu` does not keep in host memory at the end of
//! the host pool ([`crate::HOST_POOL`]), each on its own 4 KiB pages
//! ([`crate::MemoryPlan::nvme_params_bytes`] of them); the file holds those pages in the same
//! order, so a shard's file offset is its offset in that tail. The runtime keeps the tail's
//! pages empty except while a shard is in memory.
//!
//! The schedule is a pure function of the program and `--buffer-count`, so that the compile
//! summary's bytes are the ones a step moves. Every instruction that touches a shard is a
//! *use* of it: a gather reads it (an asynchronous gather holds it until its wait), the
//! optimizer step updates it, one tensor at a time. Walking the uses in program order, at most
//! `buffer_count` shards are in memory: before each use the reads of the next uses are issued
//! as far as free buffers allow (whole uses, in order), so that they overlap the instructions
//! before; after a use its written shards are written back and the shards no fetched-ahead use
//! needs are released. A use that cannot get its shards into memory is refused at compile time.
//! After the run, the program's updates that copy a step's new parameters write them to the
//! file.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::offload::BLOCK;
use crate::{Instruction, Program, Region, HOST_POOL};

/// DeepSpeed's `offload_param` defaults.
pub const DEFAULT_BUFFER_COUNT: usize = 5;
pub const DEFAULT_BUFFER_SIZE: usize = 100_000_000;
pub const DEFAULT_MAX_IN_CPU: usize = 1_000_000_000;

/// Where and how a plan keeps parameter shards in files.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NvmeParams {
    /// The directory of the parameter files (one per rank).
    pub path: PathBuf,
    /// Shards in memory at once (`--buffer-count`).
    pub buffer_count: usize,
    /// The most elements of one shard (`--buffer-size`).
    pub buffer_size: usize,
    /// Parameter elements each rank keeps in host memory, the first in parameter order
    /// (`--max-in-cpu`).
    pub max_in_cpu: usize,
}

/// A parameter shard in a rank's file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FileParam {
    /// Where the program addresses it (in the host pool's tail).
    pub region: Region,
    /// Where it is in the file.
    pub file_offset: usize,
    /// Bytes it moves by: its region's, padded to [`BLOCK`].
    pub file_len: usize,
}

/// What to do with shards at one point of a run, in this order: write back, release, issue
/// reads, wait for reads. Each list holds indices into [`ParamSwap::params`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Swaps {
    pub write_back: Vec<usize>,
    pub release: Vec<usize>,
    pub fetch: Vec<usize>,
    pub wait: Vec<usize>,
}

impl Swaps {
    pub fn is_empty(&self) -> bool {
        self.write_back.is_empty() && self.release.is_empty() && self.fetch.is_empty() && self.wait.is_empty()
    }
}

/// The swaps around one instruction.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct InstructionSwaps {
    pub before: Swaps,
    /// An optimizer step's tensors that update shards in the file, in order, each with the
    /// swaps before and after its update; the step updates its other tensors first.
    pub tensors: Vec<(usize, Swaps, Swaps)>,
    pub after: Swaps,
}

/// How a program's shards in a file move through one run.
#[derive(Clone, Debug)]
pub struct ParamSwap {
    pub params: Vec<FileParam>,
    /// By instruction index; instructions that touch no shard have none.
    pub swaps: std::collections::BTreeMap<usize, InstructionSwaps>,
    /// The program's updates that write shards after the run: (update index, shard).
    pub updates: Vec<(usize, usize)>,
    /// Host-pool bytes before the tail: what stays in memory.
    pub resident_bytes: usize,
    pub file_bytes: usize,
    /// Bytes one run reads from and writes to the file.
    pub read_bytes: usize,
    pub written_bytes: usize,
    /// The most shards, and their bytes, in memory at once.
    pub peak_params: usize,
    pub peak_bytes: usize,
}

/// A use of shards: by instruction `at` (an optimizer step's tensor `tensor`), held until
/// instruction `until` has run.
struct Use {
    at: usize,
    tensor: Option<usize>,
    until: usize,
    params: Vec<usize>,
    writes: Vec<usize>,
}

impl ParamSwap {
    /// The schedule of `program`'s shards in a file (None when it keeps none there), with at
    /// most `buffer_count` shards of at most `buffer_size` elements in memory; an error says
    /// which shard or instruction does not fit, or what else touches the shards.
    pub fn of(program: &Program, buffer_count: usize, buffer_size: usize) -> Result<Option<ParamSwap>, String> {
        let tail = program.memory.nvme_params_bytes;
        if tail == 0 {
            return Ok(None);
        }
        let resident_bytes = program.memory.host_pool_bytes - tail;
        let in_file = |r: &Region| r.in_host_pool() && r.offset - HOST_POOL >= resident_bytes;
        let mut params: Vec<FileParam> = Vec::new();
        for slot in program.params.iter().filter(|s| in_file(&s.region)) {
            let elements = slot.region.len / slot.dtype.size();
            if elements > buffer_size {
                return Err(format!(
                    "parameter '{}' has {elements} elements on each rank, more than --buffer-size {buffer_size}",
                    slot.name
                ));
            }
            let file_offset = slot.region.offset - HOST_POOL - resident_bytes;
            let file_len = slot.region.len.next_multiple_of(BLOCK);
            params.push(FileParam { region: slot.region, file_offset, file_len });
        }
        params.sort_by_key(|p| p.region.offset);
        let param_of = |r: &Region| -> Result<Option<usize>, String> {
            if !in_file(r) {
                return Ok(None);
            }
            let i = params.partition_point(|p| p.region.end() <= r.offset);
            match params.get(i) {
                Some(p) if p.region.offset <= r.offset && r.end() <= p.region.end() => Ok(Some(i)),
                _ => Err(format!(
                    "bytes {}..{} of the host pool are no parameter's",
                    r.offset - HOST_POOL,
                    r.end() - HOST_POOL
                )),
            }
        };
        // Updates that write a whole shard (a step's new parameter) write it to the file.
        let mut updates = Vec::new();
        for (k, update) in program.updates.iter().enumerate() {
            match (in_file(&update.from), param_of(&update.to)?) {
                (false, None) => {}
                (false, Some(p)) if params[p].region == update.to => updates.push((k, p)),
                _ => {
                    return Err(format!(
                        "an update copies {} bytes of part of a parameter in the file",
                        update.from.len
                    ))
                }
            }
        }
        let mut uses = Vec::new();
        for (index, instruction) in program.instructions.iter().enumerate() {
            let mut touched = |reads: &[Region], writes: &[Region], tensor, until| -> Result<(), String> {
                let mut use_ = Use { at: index, tensor, until, params: Vec::new(), writes: Vec::new() };
                for (region, written) in reads.iter().map(|r| (r, false)).chain(writes.iter().map(|r| (r, true))) {
                    if let Some(p) = param_of(region)? {
                        if !use_.params.contains(&p) {
                            use_.params.push(p);
                        }
                        if written && !use_.writes.contains(&p) {
                            use_.writes.push(p);
                        }
                    }
                }
                if use_.params.len() > buffer_count {
                    return Err(format!(
                        "{} uses {} parameters in the file at once, more than --buffer-count {buffer_count}",
                        instruction.label(),
                        use_.params.len()
                    ));
                }
                if !use_.params.is_empty() {
                    uses.push(use_);
                }
                Ok(())
            };
            match instruction {
                Instruction::OptimizerStep { tensors, .. } => {
                    for (t, tensor) in tensors.iter().enumerate() {
                        let writes: Vec<Region> =
                            tensor.outputs.iter().chain(tensor.copy.as_ref().map(|(r, _)| r)).copied().collect();
                        touched(&tensor.inputs, &writes, Some(t), index)?;
                    }
                }
                Instruction::CollectiveStart { .. } => {
                    let wait = (program.instructions.iter().enumerate().skip(index))
                        .find(|(_, i)| matches!(i, Instruction::Wait { start, .. } if *start == index))
                        .map(|(w, _)| w)
                        .ok_or_else(|| format!("{}: no wait for this collective", instruction.label()))?;
                    let (reads, writes) = instruction.regions();
                    touched(&reads, &writes, None, wait)?;
                }
                _ => {
                    let (reads, writes) = instruction.regions();
                    touched(&reads, &writes, None, index)?;
                }
            }
        }
        let mut swap = ParamSwap {
            params,
            swaps: Default::default(),
            updates,
            resident_bytes,
            file_bytes: tail,
            read_bytes: 0,
            written_bytes: 0,
            peak_params: 0,
            peak_bytes: 0,
        };
        swap.schedule(program, &uses, buffer_count)?;
        Ok(Some(swap))
    }

    /// Fills `swaps` by walking `uses` in program order (see the module docs).
    fn schedule(&mut self, program: &Program, uses: &[Use], buffer_count: usize) -> Result<(), String> {
        let lens: Vec<usize> = self.params.iter().map(|p| p.file_len).collect();
        let mut walk = Walk {
            uses,
            lens: &lens,
            buffer_count,
            resident: vec![false; lens.len()],
            held: vec![0; lens.len()],
            ahead: 0,
            begun: 0,
            peak: (0, 0),
        };
        // Uses begun and not yet over (they end after instruction `until`).
        let mut active: Vec<usize> = Vec::new();
        for (index, instruction) in program.instructions.iter().enumerate() {
            let mut at = InstructionSwaps::default();
            while walk.begun < uses.len() && uses[walk.begun].at == index {
                let k = walk.begun;
                let mut before = Swaps::default();
                walk.prefetch(&mut before);
                if walk.ahead <= k {
                    return Err(format!(
                        "{} needs {} parameters from the file while {} others are in flight, more than \
                         --buffer-count {buffer_count} (raise it, or lower --prefetch-bucket-size to gather fewer \
                         at once)",
                        instruction.label(),
                        uses[k].params.len(),
                        walk.in_memory().count()
                    ));
                }
                before.wait = uses[k].params.clone();
                for &p in &uses[k].params {
                    walk.held[p] += 1;
                }
                walk.begun += 1;
                match uses[k].tensor {
                    Some(t) => {
                        let mut after = Swaps::default();
                        walk.end(k, &mut after);
                        walk.prefetch(&mut after);
                        at.tensors.push((t, before, after));
                    }
                    None => {
                        at.before = before;
                        active.push(k);
                    }
                }
            }
            for k in active.iter().copied().filter(|&k| uses[k].until == index) {
                walk.end(k, &mut at.after);
            }
            active.retain(|&k| uses[k].until != index);
            walk.prefetch(&mut at.after);
            for swaps in
                std::iter::once(&at.before).chain(at.tensors.iter().flat_map(|(_, b, a)| [b, a])).chain([&at.after])
            {
                self.read_bytes += swaps.fetch.iter().map(|&p| lens[p]).sum::<usize>();
                self.written_bytes += swaps.write_back.iter().map(|&p| lens[p]).sum::<usize>();
            }
            if !(at.before.is_empty() && at.tensors.is_empty() && at.after.is_empty()) {
                self.swaps.insert(index, at);
            }
        }
        debug_assert!(walk.in_memory().next().is_none(), "every shard is released by the end of the run");
        self.written_bytes += self.updates.iter().map(|&(_, p)| lens[p]).sum::<usize>();
        (self.peak_params, self.peak_bytes) = walk.peak;
        Ok(())
    }
}

/// The state of [`ParamSwap::schedule`]'s walk over the uses.
struct Walk<'a> {
    uses: &'a [Use],
    lens: &'a [usize],
    buffer_count: usize,
    /// Each shard: in memory or on the way.
    resident: Vec<bool>,
    /// Each shard: the uses begun and not over that hold it.
    held: Vec<usize>,
    /// Uses before `ahead` have their shards in memory or on the way; uses before `begun`
    /// have begun.
    ahead: usize,
    begun: usize,
    /// The most shards, and their bytes, in memory at once.
    peak: (usize, usize),
}

impl Walk<'_> {
    fn in_memory(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.resident.len()).filter(|&p| self.resident[p])
    }

    /// Issues the reads of the next uses, whole uses in order, while buffers are free.
    fn prefetch(&mut self, swaps: &mut Swaps) {
        while let Some(next) = self.uses.get(self.ahead) {
            let missing: Vec<usize> = next.params.iter().copied().filter(|&p| !self.resident[p]).collect();
            if self.in_memory().count() + missing.len() > self.buffer_count {
                break;
            }
            for p in missing {
                self.resident[p] = true;
                swaps.fetch.push(p);
            }
            self.ahead += 1;
        }
        let count = self.in_memory().count();
        let bytes = self.in_memory().map(|p| self.lens[p]).sum();
        self.peak = (self.peak.0.max(count), self.peak.1.max(bytes));
    }

    /// Ends use `k`: writes back what it wrote and releases the shards no use holds or was
    /// fetched ahead for.
    fn end(&mut self, k: usize, swaps: &mut Swaps) {
        swaps.write_back.extend(&self.uses[k].writes);
        for &p in &self.uses[k].params {
            self.held[p] -= 1;
            let wanted = self.uses[self.begun..self.ahead].iter().any(|u| u.params.contains(&p));
            if self.held[p] == 0 && !wanted {
                self.resident[p] = false;
                swaps.release.push(p);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{CollectiveOp, OptimizerTensor, Slot};
    use autotp_kernels::{DType, Kernel, Optimizer, SgdConfig};

    /// Three shards of 8 f32 each, one page apiece, all of the host pool in the file.
    fn program(instructions: Vec<Instruction>) -> Program {
        let mut program = Program::bare(instructions, vec![], 4096);
        program.params = (0..3)
            .map(|i| Slot {
                name: format!("w{i}"),
                dtype: DType::F32,
                shape: vec![8],
                region: shard(i),
                global_shape: vec![16],
                placements: vec![],
            })
            .collect();
        program.memory.host_pool_bytes = 3 * BLOCK;
        program.memory.nvme_params_bytes = 3 * BLOCK;
        program
    }

    fn shard(i: usize) -> Region {
        Region { offset: HOST_POOL + i * BLOCK, len: 32 }
    }

    fn read(i: usize) -> Instruction {
        let output = Region { offset: 64 * i, len: 32 };
        Instruction::Kernel {
            kernel: Kernel::Copy,
            inputs: vec![shard(i)],
            outputs: vec![output],
            label: format!("gather {i}"),
            gpu: None,
        }
    }

    /// An SGD step over the three shards, their gradients in the arena.
    fn step() -> Instruction {
        let tensor = |i: usize| OptimizerTensor {
            inputs: vec![shard(i), Region { offset: 1024 + 64 * i, len: 32 }],
            outputs: vec![shard(i)],
            copy: None,
        };
        Instruction::OptimizerStep {
            optimizer: Optimizer::Sgd(SgdConfig { momentum: 0.0, nesterov: false, weight_decay: 0.0 }),
            dtype: DType::F32,
            scalars: vec![Region { offset: 2048, len: 4 }],
            tensors: (0..3).map(tensor).collect(),
            guard: None,
            label: "sgd".into(),
        }
    }

    fn swaps(fetch: &[usize], wait: &[usize], write_back: &[usize], release: &[usize]) -> Swaps {
        Swaps { fetch: fetch.to_vec(), wait: wait.to_vec(), write_back: write_back.to_vec(), release: release.to_vec() }
    }

    #[test]
    fn two_buffers_fetch_one_use_ahead_and_write_back_what_the_step_updates() {
        let program = program(vec![read(0), read(1), read(2), step()]);
        let swap = ParamSwap::of(&program, 2, 8).unwrap().unwrap();
        let at = |i: usize| swap.swaps[&i].clone();
        // The first use fetches its shard and the next; each use after frees a buffer for the one after.
        assert_eq!(at(0).before, swaps(&[0, 1], &[0], &[], &[]));
        assert_eq!(at(0).after, swaps(&[2], &[], &[], &[0]));
        assert_eq!(at(1).before, swaps(&[], &[1], &[], &[]));
        assert_eq!(at(1).after, swaps(&[0], &[], &[], &[1]));
        assert_eq!(at(2).after, swaps(&[1], &[], &[], &[2]));
        let tensors: Vec<(usize, Swaps, Swaps)> = at(3).tensors;
        assert_eq!(tensors[0], (0, swaps(&[], &[0], &[], &[]), swaps(&[2], &[], &[0], &[0])));
        assert_eq!(tensors[2], (2, swaps(&[], &[2], &[], &[]), swaps(&[], &[], &[2], &[2])));
        assert_eq!((swap.read_bytes, swap.written_bytes), (6 * BLOCK, 3 * BLOCK));
        assert_eq!((swap.peak_params, swap.peak_bytes, swap.file_bytes), (2, 2 * BLOCK, 3 * BLOCK));
        assert_eq!(swap.params[1].file_offset, BLOCK);
    }

    #[test]
    fn a_shard_used_again_soon_stays_in_memory() {
        let program = program(vec![read(0), read(0), read(1)]);
        let swap = ParamSwap::of(&program, 2, 8).unwrap().unwrap();
        assert_eq!(swap.swaps[&0].before, swaps(&[0, 1], &[0], &[], &[]));
        assert_eq!(swap.swaps[&0].after, swaps(&[], &[], &[], &[]));
        assert_eq!(swap.swaps[&1].after, swaps(&[], &[], &[], &[0]));
        assert_eq!(swap.read_bytes, 2 * BLOCK);
    }

    #[test]
    fn an_asynchronous_gather_holds_its_shard_until_its_wait() {
        let op =
            CollectiveOp { kind: crate::Collective::AllGather { dim: 0 }, axis: 0, dtype: DType::F32, shape: vec![8] };
        let start = Instruction::CollectiveStart {
            op,
            input: shard(0),
            output: Region { offset: 0, len: 32 },
            label: "start".into(),
        };
        let wait = Instruction::Wait { start: 0, label: "wait".into() };
        let program = program(vec![start, read(1), wait, read(2)]);
        let swap = ParamSwap::of(&program, 2, 8).unwrap().unwrap();
        // Shard 1 goes after its read, making room for shard 2; shard 0 stays until the wait.
        assert_eq!(swap.swaps[&1].after, swaps(&[2], &[], &[], &[1]));
        assert_eq!(swap.swaps[&2].after, swaps(&[], &[], &[], &[0]));
        let error = ParamSwap::of(&program, 1, 8).unwrap_err();
        let want =
            "gather 1 needs 1 parameters from the file while 1 others are in flight, more than --buffer-count 1 \
                    (raise it, or lower --prefetch-bucket-size to gather fewer at once)";
        assert_eq!(error, want);
    }

    #[test]
    fn what_does_not_fit_is_refused() {
        let program = program(vec![read(0)]);
        let error = ParamSwap::of(&program, 2, 7).unwrap_err();
        assert_eq!(error, "parameter 'w0' has 8 elements on each rank, more than --buffer-size 7");
        let both = Instruction::Kernel {
            kernel: Kernel::Binary {
                op: autotp_kernels::BinaryOp::Add,
                dtype: DType::F32,
                lhs: vec![8],
                rhs: vec![8],
                out: vec![8],
            },
            inputs: vec![shard(0), shard(1)],
            outputs: vec![Region { offset: 0, len: 32 }],
            label: "add".into(),
            gpu: None,
        };
        let error = ParamSwap::of(&program_with(both), 1, 8).unwrap_err();
        assert_eq!(error, "add uses 2 parameters in the file at once, more than --buffer-count 1");
    }

    fn program_with(instruction: Instruction) -> Program {
        program(vec![instruction])
    }
}
