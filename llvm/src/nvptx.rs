//! The NVPTX target: a plan's kernels as one PTX module, made at compile time and stored in the
//! plan for the CUDA runtime ([`program_ptx`] of its [`GpuEntries`]).
//!
//! Kernel `i` of the list is the entry `autotp_kernel_<i>(b0, b1, ...)`, one generic pointer
//! per buffer (movement kernel `i`: `autotp_movement_<i>`, the same way; gathers and
//! scatter-adds are [`crate::indexed`]'s entries, fused attention's passes
//! [`crate::attention`]'s); a multi-tensor optimizer step is the entry
//! [`OptimizerKernel::entry_name`](autotp_kernels::optim::OptimizerKernel::entry_name) ([`crate::optim`]). Every entry is launched with [`BLOCK`] threads per block and any number of blocks. The outer
//! dimension runs on blocks (block `b` takes rows `b, b + gridDim.x, ...`), the inner one on the
//! block's threads (thread `t` takes `t, t + BLOCK, ...`); a kernel of map stages alone with
//! few rows splits each row into [`blocks_per_row`] runs, one per block. A `Reduce` stage folds each thread's
//! share, then the block: a butterfly of warp shuffles inside each warp, the warps' results
//! through shared memory, folded by every thread in warp order, so every thread holds the same
//! accumulator and the result does not depend on timing. A row stage's stores are made by
//! thread 0. A stage that reads an output an earlier stage stored waits at a block barrier
//! first. A `Map` stage's threads take [`MAP_LANES`] consecutive elements at a time, so that
//! its contiguous accesses are 16-byte loads and stores of f32 (`ld.global.v4.f32`), where every
//! buffer is aligned for them (checked when the kernel starts; else one element at a time), and
//! the row's last elements short of a vector one at a time; every element is computed as
//! alone, so the results do not change. Expressions and the transcendentals are those of the
//! x86 target ([`crate::emit`], [`crate::math`]), at width 1 in reductions and row stages. The
//! same code runs in the tests on simulated blocks ([`crate::warp_simulator`]).

use autotp_kernels::kir::{self, Stage};
use inkwell::context::Context;
use inkwell::module::{Linkage, Module};
use inkwell::targets::{CodeModel, FileType, InitializationConfig, RelocMode, Target, TargetTriple};
use inkwell::values::{BasicMetadataValueEnum, FunctionValue, IntValue};
use inkwell::{AddressSpace, IntPredicate, OptimizationLevel};

use crate::emit::{counted_loop, Buffer, Buffers, Emitter, Position, V};
use crate::lanes::Lanes;
use crate::optim::define_nvptx as define_optimizer_step;
use crate::LlvmError;
use autotp_kernels::optim::OptimizerKernel;

/// Threads per block every kernel is launched with.
pub const BLOCK: u32 = 256;

/// Elements a thread's vector accesses in a `Map` stage cover: 16 bytes of f32.
pub const MAP_LANES: u32 = 4;

/// The GPU architectures plans carry PTX for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Arch {
    /// A100.
    Sm80,
    /// H100, H200.
    Sm90,
}

impl Arch {
    pub const ALL: [Arch; 2] = [Arch::Sm80, Arch::Sm90];

    /// The GPU of the architecture whose multiprocessors are most, and how many: a kernel
    /// launching fewer blocks leaves some of them idle.
    pub fn largest_gpu(self) -> (&'static str, usize) {
        match self {
            Arch::Sm80 => ("A100", 108),
            Arch::Sm90 => ("H100", 132),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Arch::Sm80 => "sm_80",
            Arch::Sm90 => "sm_90",
        }
    }
}

/// PTX ISA 8.0 (CUDA 12.0): new enough for sm_90, old enough for every driver since.
const PTX_FEATURES: &str = "+ptx80";

/// Work items per row (blocks a row may take): 1, except for a kernel of map stages alone
/// whose rows are too few to fill a GPU (an elementwise kernel over a batch of 8, or one row
/// of 38M gradients): its rows are split into runs of at least [`MIN_RUN`] elements, so that
/// there are about [`FILL`] work items. A launch gives such a kernel `outer * blocks_per_row`
/// blocks (see the runtime's CUDA device).
pub fn blocks_per_row(kernel: &kir::Kernel) -> usize {
    let map_only = kernel.stages.iter().all(|stage| matches!(stage, Stage::Map { .. }));
    if !map_only || kernel.outer >= FILL {
        return 1;
    }
    FILL.div_ceil(kernel.outer).min(kernel.inner.div_ceil(MIN_RUN)).max(1)
}

/// Blocks per launch at most; a kernel's blocks stride over rows beyond it.
pub const MAX_BLOCKS: usize = 1 << 16;

/// The blocks one launch of `rows` rows of a kernel taking `parts` blocks a row runs on.
pub fn launch_blocks(rows: usize, parts: usize) -> usize {
    (rows * parts).min(MAX_BLOCKS)
}

/// Work items that keep an H100's 132 multiprocessors busy several times over.
pub const FILL: usize = 4096;

/// The fewest inner elements a split row's work item takes: 4 per thread.
pub const MIN_RUN: usize = 4 * BLOCK as usize;

/// The entry point of kernel `index` in a module made by [`ptx`].
pub fn entry_name(index: usize) -> String {
    format!("autotp_kernel_{index}")
}

/// The entry point of movement kernel `index` ([`GpuEntries::movement`]).
pub fn movement_entry_name(index: usize) -> String {
    format!("autotp_movement_{index}")
}

/// Everything a program runs on a GPU, for one PTX module.
#[derive(Clone, Copy, Default)]
pub struct GpuEntries<'a> {
    /// The generated kernels: entry [`entry_name`]`(i)`.
    pub kernels: &'a [kir::Kernel],
    /// The multi-tensor optimizer steps: entry `OptimizerKernel::entry_name`.
    pub optimizer_steps: &'a [OptimizerKernel],
    /// The builtin kernels' data movement: entry [`movement_entry_name`]`(i)`.
    pub movement: &'a [kir::Kernel],
    /// The gathers and scatter-adds: entry [`crate::indexed::entry_name`]`(i)`.
    pub indexed: &'a [crate::indexed::IndexedKernel],
    /// Fused attention's passes: entry [`crate::attention::entry_name`]`(i)`.
    pub attention: &'a [autotp_kernels::attention::AttentionFunction],
    /// The top-ks and scatter-elements: entry [`crate::axis::entry_name`]`(i)`.
    pub axis: &'a [autotp_kernels::axis::AxisKernel],
    /// The grouped expert GEMMs: entry [`crate::grouped::entry_name`]`(i)`.
    pub grouped: &'a [autotp_kernels::grouped::GroupedKernel],
}

/// The PTX of `kernels` and `optimizer_steps` for `arch`, kernel `i` as [`entry_name`]`(i)`.
pub fn ptx(kernels: &[kir::Kernel], optimizer_steps: &[OptimizerKernel], arch: Arch) -> Result<String, LlvmError> {
    program_ptx(&GpuEntries { kernels, optimizer_steps, ..GpuEntries::default() }, arch)
}

/// The PTX of every entry of `entries` for `arch`, in one module.
pub fn program_ptx(entries: &GpuEntries, arch: Arch) -> Result<String, LlvmError> {
    module_ptx(arch, |e| {
        let named_kernels = (entries.kernels.iter().enumerate().map(|(i, k)| (entry_name(i), k)))
            .chain(entries.movement.iter().enumerate().map(|(i, k)| (movement_entry_name(i), k)));
        for (name, kernel) in named_kernels {
            kernel.check()?;
            let function = define(e, &name, kernel)?;
            mark_kernel(e.ctx, e.module, function)?;
        }
        for step in entries.optimizer_steps {
            let function = define_optimizer_step(e, step, |name| special_register(e, name), BLOCK as u64)?;
            mark_kernel(e.ctx, e.module, function)?;
        }
        for (i, kernel) in entries.indexed.iter().enumerate() {
            let function = crate::indexed::define(e, &crate::indexed::entry_name(i), kernel)?;
            mark_kernel(e.ctx, e.module, function)?;
        }
        for (i, attention) in entries.attention.iter().enumerate() {
            let function = crate::attention::define_nvptx(e, &crate::attention::entry_name(i), attention)?;
            mark_kernel(e.ctx, e.module, function)?;
        }
        for (i, kernel) in entries.axis.iter().enumerate() {
            let function = crate::axis::define(e, &crate::axis::entry_name(i), kernel, crate::items::Target::Nvptx)?;
            mark_kernel(e.ctx, e.module, function)?;
        }
        for (i, kernel) in entries.grouped.iter().enumerate() {
            let function =
                crate::grouped::define(e, &crate::grouped::entry_name(i), kernel, crate::items::Target::Nvptx)?;
            mark_kernel(e.ctx, e.module, function)?;
        }
        Ok(())
    })
}

/// A PTX module for `arch` of the entries `define` adds (each marked with [`mark_kernel`]),
/// verified and optimised at O3.
pub(crate) fn module_ptx(
    arch: Arch,
    define: impl FnOnce(&Emitter<'_, '_>) -> Result<(), LlvmError>,
) -> Result<String, LlvmError> {
    // LLVM's target registry is not thread-safe to initialise; modules may be made on threads.
    static INITIALISED: std::sync::Once = std::sync::Once::new();
    INITIALISED.call_once(|| Target::initialize_nvptx(&InitializationConfig::default()));
    let triple = TargetTriple::create("nvptx64-nvidia-cuda");
    let target = Target::from_triple(&triple).map_err(|e| LlvmError::llvm("NVPTX target lookup", e))?;
    let machine = target
        .create_target_machine(
            &triple,
            arch.name(),
            PTX_FEATURES,
            OptimizationLevel::Aggressive,
            RelocMode::Default,
            CodeModel::Default,
        )
        .ok_or_else(|| LlvmError::llvm("NVPTX target machine", arch.name()))?;
    let ctx = Context::create();
    let module = ctx.create_module("autotp_kernels");
    module.set_triple(&triple);
    module.set_data_layout(&machine.get_target_data().get_data_layout());
    let builder = ctx.create_builder();
    define(&Emitter { ctx: &ctx, module: &module, b: &builder })?;
    module.verify().map_err(|m| LlvmError::llvm("NVPTX verification", m))?;
    module
        .run_passes("default<O3>", &machine, crate::pass_options())
        .map_err(|m| LlvmError::llvm("NVPTX optimisation", m))?;
    let buffer =
        machine.write_to_memory_buffer(&module, FileType::Assembly).map_err(|m| LlvmError::llvm("PTX emission", m))?;
    String::from_utf8(buffer.as_slice().to_vec()).map_err(|e| LlvmError::llvm("PTX emission", e))
}

/// `!nvvm.annotations`: makes `function` a kernel entry point.
pub(crate) fn mark_kernel<'ctx>(
    ctx: &'ctx Context,
    module: &Module<'ctx>,
    function: FunctionValue<'ctx>,
) -> Result<(), LlvmError> {
    let values: [BasicMetadataValueEnum; 3] = [
        function.as_global_value().as_pointer_value().into(),
        ctx.metadata_string("kernel").into(),
        ctx.i32_type().const_int(1, false).into(),
    ];
    module
        .add_global_metadata("nvvm.annotations", &ctx.metadata_node(&values))
        .map_err(|e| LlvmError::llvm("NVPTX annotation", e))
}

/// A special register (`tid.x`, `ctaid.x`, `nctaid.x`) as i64.
pub(crate) fn special_register<'ctx>(e: &Emitter<'_, 'ctx>, name: &str) -> Result<IntValue<'ctx>, LlvmError> {
    let value = call(e, &format!("llvm.nvvm.read.ptx.sreg.{name}"), &[])?
        .ok_or_else(|| LlvmError::llvm("NVPTX intrinsic", name))?
        .into_int_value();
    Ok(e.b.build_int_z_extend(value, e.ctx.i64_type(), "")?)
}

fn define<'ctx>(e: &Emitter<'_, 'ctx>, symbol: &str, kernel: &kir::Kernel) -> Result<FunctionValue<'ctx>, LlvmError> {
    let ctx = e.ctx;
    let ptr = ctx.ptr_type(AddressSpace::default());
    let params: Vec<_> = kernel.buffers.iter().map(|_| ptr.into()).collect();
    let function = e.module.add_function(symbol, ctx.void_type().fn_type(&params, false), None);
    let entry = ctx.append_basic_block(function, "entry");
    e.b.position_at_end(entry);
    let pointers = (0..kernel.buffers.len() as u32)
        .map(|b| function.get_nth_param(b).expect("declared").into_pointer_value())
        .collect();
    let place = Place {
        thread: special_register(e, "tid.x")?,
        block: special_register(e, "ctaid.x")?,
        blocks: special_register(e, "nctaid.x")?,
        shared: shared_memory(e)?,
        lanes: Lanes::Nvptx,
    };
    define_body(e, function, kernel, pointers, &place)?;
    Ok(function)
}

/// Appends `kernel` as the host function `symbol` that one thread of a simulated GPU block runs
/// ([`crate::warp_simulator`]): `void f(u8** buffers, i64 block, i64 thread)`, the kernel's
/// buffers followed by the [`SimulatedBlock`](crate::warp_simulator::SimulatedBlock) (shared
/// memory of [`SHARED_BYTES`]), the same code as on a GPU.
pub(crate) fn define_simulated<'ctx>(
    e: &Emitter<'_, 'ctx>,
    symbol: &str,
    kernel: &kir::Kernel,
) -> Result<FunctionValue<'ctx>, LlvmError> {
    let entry = crate::cpu::CpuEntry::declare(e, symbol)?;
    let count = kernel.buffers.len();
    let pointers = (0..count).map(|n| entry.pointer(e, n)).collect::<Result<Vec<_>, LlvmError>>()?;
    let simulated = Lanes::simulated(e, &entry, count)?;
    let place = Place {
        thread: entry.end,
        block: entry.begin,
        blocks: simulated.blocks,
        shared: simulated.shared,
        lanes: simulated.lanes,
    };
    define_body(e, entry.function, kernel, pointers, &place)?;
    Ok(entry.function)
}

/// Bytes of shared memory a kernel's block uses: one f32 per warp for its folds.
pub const SHARED_BYTES: usize = (BLOCK / 32) as usize * 4;

/// A thread's place in the grid: its index in the block, its block, the grid's blocks, the
/// block's shared memory and how it reaches the others ([`Lanes`]).
struct Place<'ctx> {
    thread: IntValue<'ctx>,
    block: IntValue<'ctx>,
    blocks: IntValue<'ctx>,
    shared: inkwell::values::PointerValue<'ctx>,
    lanes: Lanes<'ctx>,
}

/// The kernel's code in `function` (positioned at its entry), over `pointers` (its buffers).
fn define_body<'ctx>(
    e: &Emitter<'_, 'ctx>,
    function: FunctionValue<'ctx>,
    kernel: &kir::Kernel,
    pointers: Vec<inkwell::values::PointerValue<'ctx>>,
    place: &Place<'ctx>,
) -> Result<(), LlvmError> {
    let ctx = e.ctx;
    let buffers = Buffers(
        (kernel.buffers.iter().zip(pointers))
            .map(|(buffer, pointer)| Buffer { pointer, dtype: buffer.dtype })
            .collect(),
    );
    let (thread, block, blocks) = (place.thread, place.block, place.blocks);
    let i64t = ctx.i64_type();
    let (inner, stride) = (i64t.const_int(kernel.inner as u64, false), i64t.const_int(BLOCK as u64, false));
    let aligned = vectors_aligned(e, &buffers)?;
    let parts = blocks_per_row(kernel);
    if parts > 1 {
        // Map stages alone, over few rows: work item `w` is part `w % parts` of row `w / parts`,
        // a run of `chunk` inner elements (a multiple of BLOCK vectors, so that each run starts
        // aligned).
        let chunk = kernel.inner.div_ceil(parts).next_multiple_of((BLOCK * MAP_LANES) as usize) as u64;
        let (parts_v, chunk_v) = (i64t.const_int(parts as u64, false), i64t.const_int(chunk, false));
        let items = i64t.const_int((kernel.outer * parts) as u64, false);
        counted_loop(e, function, block, items, blocks, &[], |item, _| {
            let outer = e.b.build_int_unsigned_div(item, parts_v, "")?;
            let part = e.b.build_int_unsigned_rem(item, parts_v, "")?;
            let begin = e.b.build_int_mul(part, chunk_v, "")?;
            let end = e.b.build_int_add(begin, chunk_v, "")?;
            let short = e.b.build_int_compare(IntPredicate::ULT, end, inner, "")?;
            let end = e.b.build_select(short, end, inner, "")?.into_int_value();
            for stage in &kernel.stages {
                let Stage::Map { exprs, stores } = stage else { unreachable!("split kernels map alone") };
                wait_for_stored_outputs(e, kernel, stage, place)?;
                let map = MapRun { buffers: &buffers, exprs, stores, outer, accs: &[] };
                map.emit(e, function, (begin, end), thread, aligned)?;
            }
            Ok(vec![])
        })?;
        e.b.build_return(None)?;
        return Ok(());
    }
    counted_loop(e, function, block, i64t.const_int(kernel.outer as u64, false), blocks, &[], |outer, _| {
        let mut accs: Vec<V<'ctx>> = Vec::new();
        for stage in &kernel.stages {
            wait_for_stored_outputs(e, kernel, stage, place)?;
            match stage {
                Stage::Reduce { fold, exprs, value } => {
                    let start = e.fold_start(*fold, 1);
                    let partial = counted_loop(e, function, thread, inner, stride, &[start], |i, carried| {
                        let at = Position::row(1, outer, Some(i), &accs);
                        let values = e.exprs(&buffers, exprs, &at)?;
                        Ok(vec![e.fold(*fold, carried[0], values[*value as usize])?])
                    })?;
                    accs.push(block_fold(e, function, place, *fold, partial[0])?);
                }
                Stage::Map { exprs, stores } => {
                    let map = MapRun { buffers: &buffers, exprs, stores, outer, accs: &accs };
                    map.emit(e, function, (i64t.const_zero(), inner), thread, aligned)?;
                }
                Stage::Row { exprs, stores } => {
                    let at = Position::row(1, outer, None, &accs);
                    let values = e.exprs(&buffers, exprs, &at)?;
                    let first = e.b.build_int_compare(IntPredicate::EQ, thread, i64t.const_zero(), "")?;
                    if_then(e, function, first, || e.stores(&buffers, stores, &values, &at))?;
                }
            }
        }
        Ok(vec![])
    })?;
    e.b.build_return(None)?;
    Ok(())
}

/// A block barrier before `stage` where it reads outputs that an earlier stage's threads stored.
fn wait_for_stored_outputs<'ctx>(
    e: &Emitter<'_, 'ctx>,
    kernel: &kir::Kernel,
    stage: &Stage,
    place: &Place<'ctx>,
) -> Result<(), LlvmError> {
    if stage.reads_outputs(kernel.num_inputs) {
        place.lanes.barrier(e, place.thread)?;
    }
    Ok(())
}

/// Whether every buffer starts at a multiple of [`MAP_LANES`] elements' bytes (the arena's
/// regions do; a buffer inside one need not).
fn vectors_aligned<'ctx>(e: &Emitter<'_, 'ctx>, buffers: &Buffers<'ctx>) -> Result<IntValue<'ctx>, LlvmError> {
    let i64t = e.ctx.i64_type();
    let mut misaligned = i64t.const_zero();
    for buffer in &buffers.0 {
        let address = e.b.build_ptr_to_int(buffer.pointer, i64t, "")?;
        let mask = i64t.const_int((MAP_LANES as usize * buffer.dtype.size()) as u64 - 1, false);
        misaligned = e.b.build_or(misaligned, e.b.build_and(address, mask, "")?, "")?;
    }
    Ok(e.b.build_int_compare(IntPredicate::EQ, misaligned, i64t.const_zero(), "")?)
}

/// A `Map` stage over one run of a row.
struct MapRun<'a, 'ctx> {
    buffers: &'a Buffers<'ctx>,
    exprs: &'a [kir::Expr],
    stores: &'a [kir::Store],
    outer: IntValue<'ctx>,
    accs: &'a [V<'ctx>],
}

impl<'ctx> MapRun<'_, 'ctx> {
    /// The stage over inner elements `begin..end` (`begin` a multiple of [`MAP_LANES`]) by the
    /// block's threads: where `aligned`, vectors of [`MAP_LANES`] from `begin` (thread `t` takes
    /// the `t`-th, then every [`BLOCK`]-th), then the elements short of a vector one by one;
    /// else every element one by one.
    fn emit(
        &self,
        e: &Emitter<'_, 'ctx>,
        function: FunctionValue<'ctx>,
        (begin, end): (IntValue<'ctx>, IntValue<'ctx>),
        thread: IntValue<'ctx>,
        aligned: IntValue<'ctx>,
    ) -> Result<(), LlvmError> {
        let i64t = e.ctx.i64_type();
        let lanes = i64t.const_int(MAP_LANES as u64, false);
        let short = e.b.build_int_unsigned_rem(e.b.build_int_sub(end, begin, "")?, lanes, "")?;
        let vectors_end = e.b.build_int_sub(end, short, "")?;
        let vectors_end = e.b.build_select(aligned, vectors_end, begin, "")?.into_int_value();
        let first = e.b.build_int_add(begin, e.b.build_int_mul(thread, lanes, "")?, "")?;
        let step = i64t.const_int((BLOCK * MAP_LANES) as u64, false);
        counted_loop(e, function, first, vectors_end, step, &[], |i, _| {
            let at = Position::aligned_row(MAP_LANES, self.outer, i, self.accs);
            e.store_stage(self.buffers, self.exprs, self.stores, &at)?;
            Ok(vec![])
        })?;
        let first = e.b.build_int_add(vectors_end, thread, "")?;
        counted_loop(e, function, first, end, i64t.const_int(BLOCK as u64, false), &[], |i, _| {
            e.store_stage(self.buffers, self.exprs, self.stores, &Position::row(1, self.outer, Some(i), self.accs))?;
            Ok(vec![])
        })?;
        Ok(())
    }
}

/// The block's shared scratch: one f32 per warp.
fn shared_memory<'ctx>(e: &Emitter<'_, 'ctx>) -> Result<inkwell::values::PointerValue<'ctx>, LlvmError> {
    let name = "autotp_warp_results";
    let global = match e.module.get_global(name) {
        Some(global) => global,
        None => {
            let ty = e.ctx.f32_type().array_type(BLOCK / 32);
            let global = e.module.add_global(ty, Some(AddressSpace::from(3u16)), name);
            global.set_linkage(Linkage::Internal);
            global.set_initializer(&ty.get_undef());
            global
        }
    };
    Ok(global.as_pointer_value())
}

/// Runs `then` only where `condition` holds.
pub(crate) fn if_then<'ctx>(
    e: &Emitter<'_, 'ctx>,
    function: FunctionValue<'ctx>,
    condition: IntValue<'ctx>,
    then: impl FnOnce() -> Result<(), LlvmError>,
) -> Result<(), LlvmError> {
    let taken = e.ctx.append_basic_block(function, "then");
    let after = e.ctx.append_basic_block(function, "after");
    e.b.build_conditional_branch(condition, taken, after)?;
    e.b.position_at_end(taken);
    then()?;
    e.b.build_unconditional_branch(after)?;
    e.b.position_at_end(after);
    Ok(())
}

/// A call of the (not overloaded) intrinsic `name`; its result, if it has one.
pub(crate) fn call<'ctx>(
    e: &Emitter<'_, 'ctx>,
    name: &str,
    args: &[BasicMetadataValueEnum<'ctx>],
) -> Result<Option<inkwell::values::BasicValueEnum<'ctx>>, LlvmError> {
    let intrinsic =
        inkwell::intrinsics::Intrinsic::find(name).ok_or_else(|| LlvmError::llvm("NVPTX intrinsic", name))?;
    let function = intrinsic.get_declaration(e.module, &[]).ok_or_else(|| LlvmError::llvm("NVPTX intrinsic", name))?;
    Ok(e.b.build_call(function, args, "")?.try_as_basic_value().basic())
}

/// Folds every thread's `partial` into one value that every thread of the block receives.
fn block_fold<'ctx>(
    e: &Emitter<'_, 'ctx>,
    function: FunctionValue<'ctx>,
    place: &Place<'ctx>,
    fold: kir::Fold,
    partial: V<'ctx>,
) -> Result<V<'ctx>, LlvmError> {
    let (i64t, f32t) = (e.ctx.i64_type(), e.ctx.f32_type());
    let (shared, thread) = (place.shared, place.thread);
    let mut value = partial;
    for offset in [16u64, 8, 4, 2, 1] {
        let other = place.lanes.shuffle_xor(e, thread, e.lane(value, 0)?, offset)?;
        value = e.fold(fold, value, e.splat(other, 1)?)?;
    }
    let array = f32t.array_type(BLOCK / 32);
    let slot = |index: IntValue<'ctx>| -> Result<inkwell::values::PointerValue<'ctx>, LlvmError> {
        // SAFETY (of the generated code): index < BLOCK / 32.
        Ok(unsafe { e.b.build_in_bounds_gep(array, shared, &[i64t.const_zero(), index], "")? })
    };
    let lane = e.b.build_and(thread, i64t.const_int(31, false), "")?;
    let warp = e.b.build_right_shift(thread, i64t.const_int(5, false), false, "")?;
    let first_lane = e.b.build_int_compare(IntPredicate::EQ, lane, i64t.const_zero(), "")?;
    let x = e.lane(value, 0)?;
    if_then(e, function, first_lane, || {
        e.b.build_store(slot(warp)?, x)?;
        Ok(())
    })?;
    place.lanes.barrier(e, thread)?;
    let mut total = e.fold_start(fold, 1);
    for w in 0..(BLOCK / 32) as u64 {
        let x = e.b.build_load(f32t, slot(i64t.const_int(w, false))?, "")?;
        total = e.fold(fold, total, e.splat(x, 1)?)?;
    }
    // Every thread has read the warps' results before the next fold overwrites them.
    place.lanes.barrier(e, thread)?;
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_softmax_kernel_becomes_ptx_for_both_architectures() {
        use autotp_kernels::kir::{Buffer, Expr, Fold, Index, Store};
        use autotp_kernels::{BinaryOp, DType, UnaryOp};
        let row = Index::row_major(1000);
        let x = Expr::Load { buffer: 0, index: row.clone() };
        let kernel = kir::Kernel {
            name: "softmax".into(),
            buffers: vec![Buffer { dtype: DType::F32, len: 37_000 }, Buffer { dtype: DType::F32, len: 37_000 }],
            num_inputs: 1,
            outer: 37,
            inner: 1000,
            stages: vec![
                Stage::Reduce { fold: Fold::Max, exprs: vec![x.clone()], value: 0 },
                Stage::Reduce {
                    fold: Fold::Sum,
                    exprs: vec![
                        x.clone(),
                        Expr::Acc(0),
                        Expr::Binary(BinaryOp::Sub, 0, 1),
                        Expr::Unary(UnaryOp::Exp, 2),
                    ],
                    value: 3,
                },
                Stage::Map {
                    exprs: vec![
                        x,
                        Expr::Acc(0),
                        Expr::Binary(BinaryOp::Sub, 0, 1),
                        Expr::Unary(UnaryOp::Exp, 2),
                        Expr::Acc(1),
                        Expr::Binary(BinaryOp::Div, 3, 4),
                    ],
                    stores: vec![Store { buffer: 1, index: row, value: 5 }],
                },
            ],
        };
        for arch in Arch::ALL {
            let ptx = ptx(std::slice::from_ref(&kernel), &[], arch).unwrap();
            assert!(ptx.contains(&format!(".target {}", arch.name())), "{ptx}");
            assert!(ptx.contains(".entry autotp_kernel_0") && ptx.contains("shfl.sync.bfly"), "{ptx}");
            // Our own exp: no calls (libdevice, libm) anywhere.
            assert!(!ptx.contains("call"), "{ptx}");
        }
    }

    #[test]
    fn elementwise_kernels_over_few_rows_split_their_rows_across_blocks() {
        use autotp_kernels::kir::{Buffer, Expr, Fold, Index, Store};
        use autotp_kernels::DType;
        let kernel = |outer: usize, inner: usize, reduce: bool| {
            let row = Index::row_major(inner);
            let x = Expr::Load { buffer: 0, index: row.clone() };
            let mut stages = vec![Stage::Map {
                exprs: vec![x.clone(), Expr::Binary(autotp_kernels::BinaryOp::Mul, 0, 0)],
                stores: vec![Store { buffer: 1, index: row, value: 1 }],
            }];
            if reduce {
                stages.insert(0, Stage::Reduce { fold: Fold::Sum, exprs: vec![x], value: 0 });
            }
            let len = outer * inner;
            kir::Kernel {
                name: "square".into(),
                buffers: vec![Buffer { dtype: DType::F32, len }, Buffer { dtype: DType::F32, len }],
                num_inputs: 1,
                outer,
                inner,
                stages,
            }
        };
        // A batch of 8 rows of 3M elements: 512 runs per row (about FILL work items).
        assert_eq!(blocks_per_row(&kernel(8, 3 << 20, false)), FILL / 8);
        // One row of 38M gradients: FILL runs.
        assert_eq!(blocks_per_row(&kernel(1, 38_000_000, false)), FILL);
        // Short rows keep at least MIN_RUN elements per run.
        assert_eq!(blocks_per_row(&kernel(8, 3000, false)), 3);
        // Enough rows, or a reduction along the row: one block per row.
        assert_eq!(blocks_per_row(&kernel(FILL, 3000, false)), 1);
        assert_eq!(blocks_per_row(&kernel(8, 3 << 20, true)), 1);
        // 6 rows: 683 runs each, 4098 work items in the loop's bound.
        assert_eq!(blocks_per_row(&kernel(6, 3 << 20, false)), 683);
        let ptx = ptx(&[kernel(6, 3 << 20, false), kernel(FILL, 3000, false)], &[], Arch::Sm90).unwrap();
        let entry = |i: usize| {
            let start = ptx.find(&format!(".entry {}", entry_name(i))).unwrap();
            let rest = &ptx[start..];
            rest[..rest[1..].find(".entry").map_or(rest.len(), |e| e + 1)].to_string()
        };
        assert!(entry(0).contains("4098"), "a split row: {}", entry(0));
        assert!(!entry(1).contains("4098") && entry(1).contains("4096"), "whole rows: {}", entry(1));
    }

    /// A map stage's contiguous accesses become 16-byte vector loads and stores (8-byte ones of
    /// bf16), in whole rows and in split ones, besides the one-element form for buffers not so
    /// aligned and the rows' last elements; rows whose starts are not aligned, and a shifted
    /// read, stay element by element.
    #[test]
    fn map_stages_load_and_store_vectors_of_four() {
        use autotp_kernels::kir::{Expr, Index};
        use autotp_kernels::DType;
        let kernel = add_kernel;
        let kernels = [
            kernel(DType::F32, 8, 3 << 20),
            kernel(DType::F32, FILL, 1000),
            kernel(DType::BF16, FILL, 768),
            kernel(DType::F32, FILL, 1003),
        ];
        let ptx = ptx(&kernels, &[], Arch::Sm90).unwrap();
        let entry = |i: usize| {
            let start = ptx.find(&format!(".entry {}", entry_name(i))).unwrap();
            let rest = &ptx[start..];
            rest[..rest[1..].find(".entry").map_or(rest.len(), |e| e + 1)].to_string()
        };
        for i in 0..2 {
            let code = entry(i);
            assert!(code.contains("ld.global.v4.f32") && code.contains("st.global.v4.f32"), "{code}");
            assert!(code.contains("ld.global.f32") && code.contains("st.global.f32"), "one at a time too: {code}");
        }
        assert!(entry(2).contains("ld.global.v4.u16") && entry(2).contains("st.global.v4.u16"), "{}", entry(2));
        assert!(!entry(3).contains(".v4."), "rows of 1003 never start aligned: {}", entry(3));

        let mut shifted = kernel(DType::F32, FILL, 1024);
        let Stage::Map { exprs, .. } = &mut shifted.stages[0] else { unreachable!() };
        exprs[0] = Expr::Load { buffer: 0, index: Index { base: 1, ..Index::row_major(1024) } };
        shifted.buffers[0].len += 1;
        let code = ptx_of(&shifted);
        assert!(code.contains("ld.global.v4.f32"), "the aligned input: {code}");
        assert_eq!(code.matches("ld.global.v4.f32").count(), 1, "the shifted one element by element: {code}");
    }

    /// Generated kernels as a GPU runs their code, on simulated blocks ([`crate::warp_simulator`],
    /// three, striding over more work items), against the same kernels compiled for x86: an add
    /// over rows split across blocks, in f32 and bf16, with its buffers aligned (vectors of four)
    /// and not (one element at a time); and a softmax whose sum reads back the exponentials it
    /// stored (a barrier first), its maxima and sums folded across the block. Elementwise results
    /// are the same bits; the sums' order differs.
    #[test]
    fn kernels_on_simulated_blocks_compute_what_x86_does() {
        use autotp_kernels::kir::{Buffer, Expr, Fold, Index, Store};
        use autotp_kernels::{AlignedBuf, BinaryOp, DType, UnaryOp};
        let add = add_kernel;
        let (outer, inner) = (6, 1000);
        let row = Index::row_major(inner);
        let (x, stored) = (Expr::Load { buffer: 0, index: row.clone() }, Expr::Load { buffer: 1, index: row.clone() });
        let softmax = kir::Kernel {
            name: "softmax".into(),
            buffers: vec![
                Buffer { dtype: DType::F32, len: outer * inner },
                Buffer { dtype: DType::F32, len: outer * inner },
            ],
            num_inputs: 1,
            outer,
            inner,
            stages: vec![
                Stage::Reduce { fold: Fold::Max, exprs: vec![x.clone()], value: 0 },
                Stage::Map {
                    exprs: vec![x, Expr::Acc(0), Expr::Binary(BinaryOp::Sub, 0, 1), Expr::Unary(UnaryOp::Exp, 2)],
                    stores: vec![Store { buffer: 1, index: row.clone(), value: 3 }],
                },
                Stage::Reduce { fold: Fold::Sum, exprs: vec![stored.clone()], value: 0 },
                Stage::Map {
                    exprs: vec![stored, Expr::Acc(1), Expr::Binary(BinaryOp::Div, 0, 1)],
                    stores: vec![Store { buffer: 1, index: row, value: 2 }],
                },
            ],
        };
        let cases = [
            (add(DType::F32, 2, 5000), 0),
            (add(DType::BF16, 3, 3000), 0),
            (add(DType::F32, 2, 5000), 1),
            (softmax, 0),
        ];
        for (kernel, shift) in cases {
            let label = format!("{} {} x {} shifted {shift}", kernel.name, kernel.buffers[0].dtype, kernel.inner);
            let size = kernel.buffers[0].dtype.size();
            // Each buffer `shift` elements past an aligned start.
            let mut storage: Vec<AlignedBuf> =
                kernel.buffers.iter().map(|b| AlignedBuf::zeroed((b.len + 1) * size)).collect();
            for (b, buffer) in storage.iter_mut().enumerate().take(kernel.num_inputs) {
                for (i, byte) in buffer.as_mut_slice().iter_mut().enumerate() {
                    // Small finite values of either width: bf16's high byte stays below 0x40.
                    *byte = if i % 2 == 1 && size == 2 { ((i * 7 + b) % 60) as u8 } else { ((i * 13 + b) % 251) as u8 };
                }
                if size == 4 {
                    for (i, x) in buffer.as_mut_slice().chunks_mut(4).enumerate() {
                        x.copy_from_slice(&(((i * 37 + b) % 101) as f32 / 25.0 - 2.0).to_le_bytes());
                    }
                }
            }
            let run = |function: crate::Function, simulated: bool| -> Vec<Vec<u8>> {
                let entry = crate::compile_cpu_functions(&[function]).unwrap()[0];
                let mut buffers = storage.clone();
                let pointers: Vec<*mut u8> =
                    buffers.iter_mut().map(|b| b.as_mut_slice()[shift * size..].as_mut_ptr()).collect();
                let blocks = launch_blocks(kernel.outer, blocks_per_row(&kernel)).min(3);
                // SAFETY: each buffer holds the kernel's elements after the shift.
                unsafe {
                    match simulated {
                        true => crate::warp_simulator::launch(entry, &pointers, blocks, SHARED_BYTES, DType::F32),
                        false => entry.run(&pointers, 0..kernel.outer),
                    }
                }
                buffers[kernel.num_inputs..].iter().map(|b| b.as_slice().to_vec()).collect()
            };
            let (x86, gpu) =
                (run(crate::Function::Kernel(&kernel), false), run(crate::Function::SimulatedKernel(&kernel), true));
            if kernel.name == "add" {
                assert!(blocks_per_row(&kernel) > 1, "{label}: rows split across blocks");
                assert!(x86 == gpu, "{label}: the same bits");
                continue;
            }
            let floats = |bytes: &[u8]| -> Vec<f32> {
                bytes.chunks(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
            };
            for (n, (want, got)) in floats(&x86[0]).iter().zip(floats(&gpu[0])).enumerate() {
                assert!(
                    (want - got).abs() <= 1e-6 * want.abs().max(1e-3),
                    "{label}[{n}]: {got} on the GPU, {want} on x86"
                );
            }
        }
    }

    /// `out = a + b` over `outer` rows of `inner` elements of `dtype`.
    fn add_kernel(dtype: autotp_kernels::DType, outer: usize, inner: usize) -> kir::Kernel {
        use autotp_kernels::kir::{Buffer, Expr, Index, Store};
        let (row, len) = (Index::row_major(inner), outer * inner);
        kir::Kernel {
            name: "add".into(),
            buffers: vec![Buffer { dtype, len }, Buffer { dtype, len }, Buffer { dtype, len }],
            num_inputs: 2,
            outer,
            inner,
            stages: vec![Stage::Map {
                exprs: vec![
                    Expr::Load { buffer: 0, index: row.clone() },
                    Expr::Load { buffer: 1, index: row.clone() },
                    Expr::Binary(autotp_kernels::BinaryOp::Add, 0, 1),
                ],
                stores: vec![Store { buffer: 2, index: row, value: 2 }],
            }],
        }
    }

    fn ptx_of(kernel: &kir::Kernel) -> String {
        ptx(std::slice::from_ref(kernel), &[], Arch::Sm90).unwrap()
    }

    #[test]
    fn optimizer_steps_become_ptx_with_ieee_division_and_square_roots() {
        use autotp_kernels::optim::{AdamWConfig, Optimizer, SgdConfig};
        use autotp_kernels::DType;
        let adamw = Optimizer::AdamW(AdamWConfig { beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1 });
        let sgd = Optimizer::Sgd(SgdConfig { momentum: 0.9, weight_decay: 0.0, nesterov: true });
        let steps = [
            OptimizerKernel { optimizer: adamw, dtype: DType::F32 },
            OptimizerKernel { optimizer: sgd, dtype: DType::F64 },
        ];
        assert_eq!(steps[0].entry_name(), "autotp_multi_tensor_adamw_f32");
        assert_eq!(steps[1].entry_name(), "autotp_multi_tensor_sgd_f64_momentum_nesterov");
        for arch in Arch::ALL {
            let ptx = ptx(&[], &steps, arch).unwrap();
            for entry in steps.iter().map(|s| s.entry_name()) {
                assert!(ptx.contains(&format!(".entry {entry}(")), "{ptx}");
            }
            // Exactly rounded, never contracted: bit-identical to the CPU's step.
            assert!(ptx.contains("sqrt.rn.f32") && ptx.contains("div.rn.f32"), "{ptx}");
            assert!(!ptx.contains("fma.") && !ptx.contains("approx") && !ptx.contains("call"), "{ptx}");
        }
    }
}
