//! The x86-64 target: each kernel becomes
//! `void kernel(u8** buffers, i64 begin, i64 end)`, which runs rows `begin..end` of the loop
//! nest. Every `Reduce` and `Map` stage is a loop over the inner dimension in steps of the
//! active level's vector width ([`IsaLevel`]: 16 f32 lanes with AVX-512, 8 with AVX2, else 4)
//! and a scalar loop over the remaining tail; a row stage runs once. A kernel whose rows are contiguous and whose inner
//! walk is strided (a reduction over leading dims, `x[i, o]`) runs lanes along rows instead:
//! a block of rows per vector, the inner dimension one position at a time, so its loads are
//! vectors, not gathers. The rows of one call run in order and each row's
//! result depends only on its own elements, so how the runtime splits rows among threads never
//! changes a result.

use autotp_kernels::isa::IsaLevel;
use autotp_kernels::kir::{self, Stage};
use inkwell::context::Context;
use inkwell::module::Module;
use inkwell::targets::{CodeModel, FileType, InitializationConfig, RelocMode, Target, TargetMachine};
use inkwell::values::{FunctionValue, IntValue};
use inkwell::{AddressSpace, OptimizationLevel};

use crate::emit::{counted_loop, Buffer, Buffers, Emitter, Position, V};
use crate::{Function, LlvmError};

/// A generated kernel's entry point: `(buffers, begin, end)`, buffers in the kernel's order.
pub type KernelFn = unsafe extern "C" fn(*const *mut u8, i64, i64);

/// A kernel loaded into this process.
#[derive(Clone, Copy, Debug)]
pub struct CpuKernel {
    pub function: KernelFn,
}

impl CpuKernel {
    /// Runs rows `rows` of the kernel on these buffers.
    ///
    /// # Safety
    /// The kernel must have passed [`kir::Kernel::check`] (every compiled kernel has), `buffers`
    /// must point at buffers at least as long as the kernel's, aligned for their element types,
    /// and the outputs must not overlap each other or the inputs while it runs, nor be touched
    /// by anything else.
    pub unsafe fn run(&self, buffers: &[*mut u8], rows: std::ops::Range<usize>) {
        unsafe { (self.function)(buffers.as_ptr(), rows.start as i64, rows.end as i64) }
    }
}

/// Compiles `kernels` for this machine (or finds them already compiled) and returns their entry
/// points, in order.
pub fn compile_cpu(kernels: &[kir::Kernel]) -> Result<Vec<CpuKernel>, LlvmError> {
    compile_cpu_functions(&kernels.iter().map(Function::Kernel).collect::<Vec<_>>())
}

/// [`compile_cpu`] for kernels and optimizer steps, compiled together (one object file).
/// An optimizer step's entry runs chunks `begin..end` of `[chunks, constants]`
/// ([`crate::optim`]).
pub fn compile_cpu_functions(functions: &[Function]) -> Result<Vec<CpuKernel>, LlvmError> {
    crate::jit::compile(functions)
}

/// The host as a target: its machine, its vector width and a description for cache keys.
pub(crate) struct HostTarget {
    pub machine: TargetMachine,
    pub width: u32,
    pub description: String,
}

// SAFETY: a TargetMachine may be used from any thread, one at a time (the JIT's lock).
unsafe impl Send for HostTarget {}

impl HostTarget {
    /// The target for the active level ([`IsaLevel::configured`]): at the host's level, the
    /// host CPU with all its features (LLVM's tuning for it); at a lower one, the level's
    /// generic CPU (`x86-64-v3`), so the code is what an AVX2-only machine would run.
    pub fn detect() -> Result<HostTarget, LlvmError> {
        let level = IsaLevel::configured().map_err(|e| LlvmError::llvm("target selection", e))?;
        Target::initialize_native(&InitializationConfig::default())
            .map_err(|e| LlvmError::llvm("initialisation", e))?;
        let triple = TargetMachine::get_default_triple();
        let (cpu, features) = if level == IsaLevel::host() {
            (TargetMachine::get_host_cpu_name().to_string(), TargetMachine::get_host_cpu_features().to_string())
        } else {
            (level.name().to_string(), String::new())
        };
        let target = Target::from_triple(&triple).map_err(|e| LlvmError::llvm("target lookup", e))?;
        let machine = target
            .create_target_machine(
                &triple,
                &cpu,
                &features,
                OptimizationLevel::Aggressive,
                RelocMode::PIC,
                CodeModel::Default,
            )
            .ok_or_else(|| LlvmError::llvm("target machine", format!("no target machine for {triple}")))?;
        let width = level.f32_lanes();
        let description = format!("{} {cpu} {features} w{width}", triple.as_str().to_string_lossy());
        Ok(HostTarget { machine, width, description })
    }
}

/// The f32 lanes of the vectors the JIT's kernels use (the active level's).
pub fn vector_width() -> Result<u32, LlvmError> {
    Ok(IsaLevel::configured().map_err(|e| LlvmError::llvm("target selection", e))?.f32_lanes())
}

/// Builds one module holding `functions` (each under its symbol), optimised for the host.
fn build_module<'ctx>(
    ctx: &'ctx Context,
    functions: &[(String, Function)],
    target: &HostTarget,
) -> Result<Module<'ctx>, LlvmError> {
    let module = ctx.create_module("autotp_kernels");
    module.set_triple(&target.machine.get_triple());
    module.set_data_layout(&target.machine.get_target_data().get_data_layout());
    let builder = ctx.create_builder();
    let e = Emitter { ctx, module: &module, b: &builder };
    for (symbol, function) in functions {
        match function {
            Function::Kernel(kernel) => {
                kernel.check()?;
                define(&e, symbol, kernel, target.width)?;
            }
            Function::OptimizerStep(step) => {
                crate::optim::define_cpu(&e, symbol, step, target.width)?;
            }
            Function::Attention(attention) => {
                crate::attention::define_cpu(&e, symbol, attention, target.width)?;
            }
            Function::Axis(kernel) => {
                crate::axis::define(&e, symbol, kernel, crate::items::Target::Cpu)?;
            }
            Function::Grouped(kernel) => {
                crate::grouped::define(&e, symbol, kernel, crate::items::Target::Cpu)?;
            }
            Function::SimulatedKernel(kernel) => {
                kernel.check()?;
                crate::nvptx::define_simulated(&e, symbol, kernel)?;
            }
            Function::SimulatedAttention(attention) => {
                crate::attention::define_simulated(&e, symbol, attention)?;
            }
        }
    }
    module.verify().map_err(|m| LlvmError::llvm("verification", m))?;
    module
        .run_passes("default<O3>", &target.machine, crate::pass_options())
        .map_err(|m| LlvmError::llvm("optimisation", m))?;
    Ok(module)
}

/// The object code of `kernels` for the host.
pub(crate) fn object_code(functions: &[(String, Function)], target: &HostTarget) -> Result<Vec<u8>, LlvmError> {
    let ctx = Context::create();
    let module = build_module(&ctx, functions, target)?;
    let buffer = target
        .machine
        .write_to_memory_buffer(&module, FileType::Object)
        .map_err(|m| LlvmError::llvm("code generation", m))?;
    Ok(buffer.as_slice().to_vec())
}

/// The optimised LLVM IR of one kernel for this host (for `--dump-kernels`).
pub fn llvm_ir(kernel: &kir::Kernel) -> Result<String, LlvmError> {
    let target = HostTarget::detect()?;
    let ctx = Context::create();
    let module = build_module(&ctx, &[(kernel.name.clone(), Function::Kernel(kernel))], &target)?;
    Ok(module.print_to_string().to_string())
}

/// Appends the function `symbol` computing `kernel`.
/// The entry every x86 function of the JIT has, `void symbol(u64* args, i64 begin, i64 end)`:
/// the argument words (buffers' addresses, or integers), and the range of rows, units or items
/// to run. [`CpuEntry::declare`] adds it and positions the builder in its first block.
pub(crate) struct CpuEntry<'ctx> {
    pub function: FunctionValue<'ctx>,
    args: inkwell::values::PointerValue<'ctx>,
    pub begin: inkwell::values::IntValue<'ctx>,
    pub end: inkwell::values::IntValue<'ctx>,
}

impl<'ctx> CpuEntry<'ctx> {
    pub(crate) fn declare(e: &Emitter<'_, 'ctx>, symbol: &str) -> Result<CpuEntry<'ctx>, LlvmError> {
        let (ptr, i64t) = (e.ctx.ptr_type(AddressSpace::default()), e.ctx.i64_type());
        let fn_type = e.ctx.void_type().fn_type(&[ptr.into(), i64t.into(), i64t.into()], false);
        let function = e.module.add_function(symbol, fn_type, None);
        e.b.position_at_end(e.ctx.append_basic_block(function, "entry"));
        Ok(CpuEntry {
            function,
            args: function.get_nth_param(0).expect("declared").into_pointer_value(),
            begin: function.get_nth_param(1).expect("declared").into_int_value(),
            end: function.get_nth_param(2).expect("declared").into_int_value(),
        })
    }

    /// Argument word `k`, as a value of `ty`.
    pub(crate) fn word(
        &self,
        e: &Emitter<'_, 'ctx>,
        k: usize,
        ty: inkwell::types::BasicTypeEnum<'ctx>,
    ) -> Result<inkwell::values::BasicValueEnum<'ctx>, LlvmError> {
        let i64t = e.ctx.i64_type();
        // SAFETY (of the generated code): the caller passes every word its function reads.
        let at = unsafe { e.b.build_in_bounds_gep(i64t, self.args, &[i64t.const_int(k as u64, false)], "")? };
        Ok(e.b.build_load(ty, at, "")?)
    }

    /// Argument word `k`, an address.
    pub(crate) fn pointer(
        &self,
        e: &Emitter<'_, 'ctx>,
        k: usize,
    ) -> Result<inkwell::values::PointerValue<'ctx>, LlvmError> {
        Ok(self.word(e, k, e.ctx.ptr_type(AddressSpace::default()).into())?.into_pointer_value())
    }
}

fn define<'ctx>(
    e: &Emitter<'_, 'ctx>,
    symbol: &str,
    kernel: &kir::Kernel,
    width: u32,
) -> Result<FunctionValue<'ctx>, LlvmError> {
    let i64t = e.ctx.i64_type();
    let entry = CpuEntry::declare(e, symbol)?;
    let (function, begin, end) = (entry.function, entry.begin, entry.end);
    let mut buffers = Vec::new();
    for (b, buffer) in kernel.buffers.iter().enumerate() {
        buffers.push(Buffer { pointer: entry.pointer(e, b)?, dtype: buffer.dtype });
    }
    let buffers = Buffers(buffers);
    let one = i64t.const_int(1, false);
    if width > 1 && lanes_on_outer(kernel) {
        // Whole blocks of `width` rows with a lane per row, then the remaining rows alone.
        let rows = e.b.build_int_sub(end, begin, "")?;
        let rest = e.b.build_int_unsigned_rem(rows, i64t.const_int(width as u64, false), "")?;
        let blocks_end = e.b.build_int_sub(end, rest, "")?;
        let step = i64t.const_int(width as u64, false);
        counted_loop(e, function, begin, blocks_end, step, &[], |outer, _| {
            rows_as_lanes(e, function, kernel, &buffers, outer, width)?;
            Ok(vec![])
        })?;
        // One lane for the remaining rows: each row folds its elements in the same order
        // whether it falls in a block or not, so a result never depends on the row split.
        counted_loop(e, function, blocks_end, end, one, &[], |outer, _| {
            rows_as_lanes(e, function, kernel, &buffers, outer, 1)?;
            Ok(vec![])
        })?;
    } else {
        counted_loop(e, function, begin, end, one, &[], |outer, _| {
            row_with_lanes_inside(e, function, kernel, &buffers, outer, width)?;
            Ok(vec![])
        })?;
    }
    e.b.build_return(None)?;
    Ok(function)
}

/// Whether lanes should run along rows: every access is contiguous or constant along the outer
/// variable, and some load walks the inner one with a stride (a reduction over leading dims,
/// `x[i, o]`), which lanes along the inner dimension would have to gather element by element.
pub fn lanes_on_outer(kernel: &kir::Kernel) -> bool {
    let indices = || {
        kernel.stages.iter().flat_map(|stage| {
            let (exprs, stores): (&[kir::Expr], &[kir::Store]) = match stage {
                Stage::Reduce { exprs, .. } => (exprs, &[]),
                Stage::Map { exprs, stores } | Stage::Row { exprs, stores } => (exprs, stores),
            };
            let loads = exprs.iter().filter_map(|e| match e {
                kir::Expr::Load { index, .. } | kir::Expr::Pick { index, .. } | kir::Expr::Coord(index) => Some(index),
                _ => None,
            });
            loads.chain(stores.iter().map(|s| &s.index))
        })
    };
    let linear = |index: &kir::Index, var: kir::Var| {
        let terms: Vec<_> = index.terms.iter().filter(|t| t.var == var).collect();
        let plain = terms.iter().all(|t| t.div <= 1 && t.modulo.is_none() && t.offset == 0 && t.wrap.is_none());
        plain.then(|| terms.iter().map(|t| t.stride).sum::<usize>())
    };
    indices().all(|index| matches!(linear(index, kir::Var::Outer), Some(0 | 1)))
        && indices().any(|index| !matches!(linear(index, kir::Var::Inner), Some(0 | 1)))
}

/// Rows `outer..outer + width`, one per lane: every stage loops over the inner dimension one
/// position at a time, each accumulator a vector of the rows' accumulators.
fn rows_as_lanes<'ctx>(
    e: &Emitter<'_, 'ctx>,
    function: FunctionValue<'ctx>,
    kernel: &kir::Kernel,
    buffers: &Buffers<'ctx>,
    outer: IntValue<'ctx>,
    width: u32,
) -> Result<(), LlvmError> {
    let i64t = e.ctx.i64_type();
    let (zero, inner, one) = (i64t.const_zero(), i64t.const_int(kernel.inner as u64, false), i64t.const_int(1, false));
    let mut accs: Vec<V<'ctx>> = Vec::new();
    let at = |i: Option<IntValue<'ctx>>, accs: &[V<'ctx>]| Position {
        width,
        outer,
        inner: i,
        accs: accs.to_vec(),
        lanes_on_outer: true,
        aligned: false,
    };
    for stage in &kernel.stages {
        match stage {
            Stage::Reduce { fold, exprs, value } => {
                let start = e.fold_start(*fold, width);
                let folded = counted_loop(e, function, zero, inner, one, &[start], |i, carried| {
                    let values = e.exprs(buffers, exprs, &at(Some(i), &accs))?;
                    Ok(vec![e.fold(*fold, carried[0], values[*value as usize])?])
                })?;
                accs.push(folded[0]);
            }
            Stage::Map { exprs, stores } => {
                counted_loop(e, function, zero, inner, one, &[], |i, _| {
                    e.store_stage(buffers, exprs, stores, &at(Some(i), &accs))?;
                    Ok(vec![])
                })?;
            }
            Stage::Row { exprs, stores } => e.store_stage(buffers, exprs, stores, &at(None, &accs))?,
        }
    }
    Ok(())
}

/// Row `outer`, its inner dimension in vectors of `width` lanes and a scalar tail. A kernel
/// that passes over its rows more than once (softmax, norms, cross-entropy) prefetches the next
/// row's elements that its first pass reads during its second pass, which works from the cache.
fn row_with_lanes_inside<'ctx>(
    e: &Emitter<'_, 'ctx>,
    function: FunctionValue<'ctx>,
    kernel: &kir::Kernel,
    buffers: &Buffers<'ctx>,
    outer: IntValue<'ctx>,
    width: u32,
) -> Result<(), LlvmError> {
    let i64t = e.ctx.i64_type();
    let inner = kernel.inner as u64;
    let vector_end = inner - inner % width as u64;
    let mut accs: Vec<V<'ctx>> = Vec::new();
    let passes: Vec<usize> =
        (kernel.stages.iter().enumerate()).filter(|(_, s)| !matches!(s, Stage::Row { .. })).map(|(n, _)| n).collect();
    // The first pass's loads, prefetched a row ahead during the second pass.
    let ahead = match passes[..] {
        [first, second, ..] => {
            Some((second, kernel.stages[first].exprs(), e.b.build_int_add(outer, i64t.const_int(1, false), "")?))
        }
        _ => None,
    };
    for (n, stage) in kernel.stages.iter().enumerate() {
        let prefetch = |i: IntValue<'ctx>, w: u32| -> Result<(), LlvmError> {
            match ahead {
                Some((pass, exprs, next_row)) if pass == n && w > 1 => {
                    e.prefetch_loads(buffers, exprs, &Position::row(w, next_row, Some(i), &accs))
                }
                _ => Ok(()),
            }
        };
        // The vector loop over [0, vector_end), then the scalar tail.
        let parts = [(0, vector_end, width), (vector_end, inner, 1)];
        match stage {
            Stage::Reduce { fold, exprs, value } => {
                let mut acc = e.fold_start(*fold, 1);
                for (from, to, w) in parts {
                    if from == to {
                        continue;
                    }
                    let start = if w == 1 { acc } else { e.fold_start(*fold, w) };
                    let (from, to) = (i64t.const_int(from, false), i64t.const_int(to, false));
                    let step = i64t.const_int(w as u64, false);
                    let folded = counted_loop(e, function, from, to, step, &[start], |i, carried| {
                        prefetch(i, w)?;
                        let values = e.exprs(buffers, exprs, &Position::row(w, outer, Some(i), &accs))?;
                        Ok(vec![e.fold(*fold, carried[0], values[*value as usize])?])
                    })?;
                    acc = if w == 1 { folded[0] } else { e.fold_lanes(*fold, folded[0], acc)? };
                }
                accs.push(acc);
            }
            Stage::Map { exprs, stores } => {
                for (from, to, w) in parts {
                    if from == to {
                        continue;
                    }
                    let (from, to) = (i64t.const_int(from, false), i64t.const_int(to, false));
                    let step = i64t.const_int(w as u64, false);
                    counted_loop(e, function, from, to, step, &[], |i, _| {
                        prefetch(i, w)?;
                        e.store_stage(buffers, exprs, stores, &Position::row(w, outer, Some(i), &accs))?;
                        Ok(vec![])
                    })?;
                }
            }
            Stage::Row { exprs, stores } => {
                e.store_stage(buffers, exprs, stores, &Position::row(1, outer, None, &accs))?
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use autotp_kernels::kir::{Buffer, Expr, Fold, Index, Kernel, Stage, Store, Var};
    use autotp_kernels::DType;

    /// A kernel that passes over each row twice (a row's maximum, then `x - max`) prefetches the
    /// next row during its second pass; one that passes once leaves it to the hardware.
    #[test]
    fn a_second_pass_over_the_rows_prefetches_the_next_row() {
        let (rows, columns) = (4usize, 64usize);
        let x = Expr::Load { buffer: 0, index: Index::row_major(columns) };
        let store = Store { buffer: 1, index: Index::row_major(columns), value: 2 };
        let buffers =
            vec![Buffer { dtype: DType::F32, len: rows * columns }, Buffer { dtype: DType::F32, len: rows * columns }];
        let two_passes = Kernel {
            name: "shifted".into(),
            buffers: buffers.clone(),
            num_inputs: 1,
            outer: rows,
            inner: columns,
            stages: vec![
                Stage::Reduce { fold: Fold::Max, exprs: vec![x.clone()], value: 0 },
                Stage::Map {
                    exprs: vec![x.clone(), Expr::Acc(0), Expr::Binary(autotp_kernels::BinaryOp::Sub, 0, 1)],
                    stores: vec![store.clone()],
                },
            ],
        };
        let one_pass = Kernel {
            name: "copied".into(),
            stages: vec![Stage::Map { exprs: vec![x], stores: vec![Store { value: 0, ..store }] }],
            ..two_passes.clone()
        };
        assert!(super::llvm_ir(&two_passes).unwrap().contains("@llvm.prefetch"));
        assert!(!super::llvm_ir(&one_pass).unwrap().contains("@llvm.prefetch"));
        let compiled = crate::compile_cpu(std::slice::from_ref(&two_passes)).unwrap();
        let input: Vec<f32> = (0..rows * columns).map(|i| ((i * 37) % 11) as f32).collect();
        let mut output = vec![0f32; rows * columns];
        let pointers = [input.as_ptr() as *mut u8, output.as_mut_ptr().cast()];
        // SAFETY: the buffers match the kernel's; the last row's prefetch reads nothing.
        unsafe { compiled[0].run(&pointers, 0..rows) };
        for (row, (x, y)) in input.chunks(columns).zip(output.chunks(columns)).enumerate() {
            let max = x.iter().copied().fold(f32::MIN, f32::max);
            assert!(x.iter().zip(y).all(|(a, b)| a - max == *b), "row {row}");
        }
    }

    /// [`Expr::Pick`] at the host's width: in a map stage (every lane of a row picks the row's
    /// element) and in a row stage, an offset outside the row clamped to its ends.
    #[test]
    fn a_pick_reads_each_rows_chosen_element_clamped_into_the_row() {
        let (rows, columns) = (5usize, 19usize);
        let values: Vec<f32> = (0..rows * columns).map(|i| i as f32 * 0.5).collect();
        let chosen: [i64; 5] = [3, -4, 18, 40, 0];
        let pick = Expr::Pick { buffer: 0, index: Index::linear(Var::Outer, columns), offset: 0, bound: columns };
        let label = Expr::Load { buffer: 1, index: Index::linear(Var::Outer, 1) };
        let kernel = Kernel {
            name: "pick".into(),
            buffers: vec![
                Buffer { dtype: DType::F32, len: rows * columns },
                Buffer { dtype: DType::I64, len: rows },
                Buffer { dtype: DType::F32, len: rows * columns },
                Buffer { dtype: DType::F32, len: rows },
            ],
            num_inputs: 2,
            outer: rows,
            inner: columns,
            stages: vec![
                Stage::Map {
                    exprs: vec![label.clone(), pick.clone()],
                    stores: vec![Store { buffer: 2, index: Index::row_major(columns), value: 1 }],
                },
                Stage::Row {
                    exprs: vec![label, pick],
                    stores: vec![Store { buffer: 3, index: Index::linear(Var::Outer, 1), value: 1 }],
                },
            ],
        };
        kernel.check().unwrap();
        let compiled = crate::compile_cpu(std::slice::from_ref(&kernel)).unwrap();
        let (mut spread, mut picked) = (vec![0f32; rows * columns], vec![0f32; rows]);
        let buffers = [values.as_ptr(), chosen.as_ptr().cast(), spread.as_mut_ptr().cast(), picked.as_mut_ptr().cast()]
            .map(|p: *const f32| p as *mut u8);
        // SAFETY: the buffers match the kernel's.
        unsafe { compiled[0].run(&buffers, 0..rows) };
        for (row, &c) in chosen.iter().enumerate() {
            let want = values[row * columns + c.clamp(0, columns as i64 - 1) as usize];
            assert_eq!(picked[row], want, "row {row}, offset {c}");
            assert!(spread[row * columns..(row + 1) * columns].iter().all(|&x| x == want), "row {row}");
        }
    }
}
