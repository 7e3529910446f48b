//! The multi-tensor optimizer step as generated code: one kernel per update rule that walks a
//! table of chunks, each a [`TensorUpdate`] (a piece of one parameter with its gradient and
//! states), as Apex's `multi_tensor_apply` does. Every parameter of a step is updated by one
//! launch (CUDA) or one pass of the thread pool (x86).
//!
//! The per-element arithmetic is [`autotp_kernels::optim`]'s, operation for operation and in
//! the same order, with the step's constants ([`autotp_kernels::optim::constants`]: learning
//! rate and bias corrections rounded from f64 on the host) read from a small array. No
//! operation is contracted or approximated (`sqrt` and division are IEEE on both targets), so
//! the generated step is bit-identical to the Rust kernels; the test checks it on x86.
//!
//! - x86: `void k(u8** args, i64 begin, i64 end)` with `args = [chunks, constants]` runs chunks
//!   `begin..end` in order, vectors of the host's width and a scalar tail.
//! - NVPTX: `void k(TensorUpdate* chunks, i64 num_chunks, F* constants)`, block `b` takes
//!   chunks `b, b + gridDim.x, ...`, thread `t` elements `t, t + BLOCK, ...` of each.
//!
//! An output not updated in place receives the new values directly (elements are read from the
//! inputs and written to the outputs), so no copy precedes the step.

use autotp_kernels::optim::OptimizerKernel;
use autotp_kernels::optim::{num_constants, Optimizer};
use autotp_kernels::DType;
use inkwell::types::{BasicMetadataTypeEnum, BasicTypeEnum};
use inkwell::values::{FunctionValue, IntValue, PointerValue};
use inkwell::AddressSpace;

use crate::emit::{counted_loop, Emitter, V};
use crate::LlvmError;

/// The words of a [`TensorUpdate`](autotp_kernels::optim::TensorUpdate) in the chunk table.
const CHUNK_WORDS: u64 = 8;
const LEN: u64 = 0;
const INPUTS: [u64; 4] = [1, 2, 3, 4];
const OUTPUTS: [u64; 3] = [5, 6, 7];

/// What the emitters need of a step kernel beyond its description.
trait Emitted {
    fn check(&self) -> Result<(), LlvmError>;
    fn element_type<'ctx>(&self, e: &Emitter<'_, 'ctx>) -> BasicTypeEnum<'ctx>;
}

impl Emitted for OptimizerKernel {
    fn check(&self) -> Result<(), LlvmError> {
        match self.dtype {
            DType::F32 | DType::F64 => Ok(()),
            other => Err(LlvmError::llvm(
                "optimizer kernel",
                format!("{} on {other} parameters (keep f32 master weights)", self.optimizer.name()),
            )),
        }
    }

    fn element_type<'ctx>(&self, e: &Emitter<'_, 'ctx>) -> BasicTypeEnum<'ctx> {
        match self.dtype {
            DType::F64 => e.ctx.f64_type().into(),
            _ => e.ctx.f32_type().into(),
        }
    }
}

/// The pointers of one chunk and its length, loaded from the table.
struct Chunk<'ctx> {
    len: IntValue<'ctx>,
    /// Parameter, gradient, states (unused ones are null and never read).
    inputs: [PointerValue<'ctx>; 4],
    outputs: [PointerValue<'ctx>; 3],
}

fn load_chunk<'ctx>(
    e: &Emitter<'_, 'ctx>,
    table: PointerValue<'ctx>,
    index: IntValue<'ctx>,
) -> Result<Chunk<'ctx>, LlvmError> {
    let (i64t, ptr) = (e.ctx.i64_type(), e.ctx.ptr_type(AddressSpace::default()));
    let first = e.b.build_int_mul(index, i64t.const_int(CHUNK_WORDS, false), "")?;
    let word = |k: u64| -> Result<PointerValue<'ctx>, LlvmError> {
        let at = e.b.build_int_add(first, i64t.const_int(k, false), "")?;
        // SAFETY (of the generated code): the caller's table holds `index + 1` chunks at least.
        Ok(unsafe { e.b.build_in_bounds_gep(i64t, table, &[at], "")? })
    };
    let pointer = |k: u64| -> Result<PointerValue<'ctx>, LlvmError> {
        Ok(e.b.build_load(ptr, word(k)?, "")?.into_pointer_value())
    };
    Ok(Chunk {
        len: e.b.build_load(i64t, word(LEN)?, "")?.into_int_value(),
        inputs: [pointer(INPUTS[0])?, pointer(INPUTS[1])?, pointer(INPUTS[2])?, pointer(INPUTS[3])?],
        outputs: [pointer(OUTPUTS[0])?, pointer(OUTPUTS[1])?, pointer(OUTPUTS[2])?],
    })
}

/// Loads the step's constants as `width`-lane splats.
fn load_constants<'ctx>(
    e: &Emitter<'_, 'ctx>,
    kernel: &OptimizerKernel,
    constants: PointerValue<'ctx>,
    width: u32,
) -> Result<Vec<V<'ctx>>, LlvmError> {
    let ty = kernel.element_type(e);
    (0..num_constants(&kernel.optimizer))
        .map(|k| {
            // SAFETY (of the generated code): the caller passes `num_constants` constants.
            let at =
                unsafe { e.b.build_in_bounds_gep(ty, constants, &[e.ctx.i64_type().const_int(k as u64, false)], "")? };
            e.splat(e.b.build_load(ty, at, "")?, width)
        })
        .collect()
}

/// Updates elements `at..at + width` of `chunk`.
fn update_elements<'ctx>(
    e: &Emitter<'_, 'ctx>,
    kernel: &OptimizerKernel,
    chunk: &Chunk<'ctx>,
    constants: &[V<'ctx>],
    at: IntValue<'ctx>,
    width: u32,
) -> Result<(), LlvmError> {
    let ty = kernel.element_type(e);
    let vector = match ty {
        BasicTypeEnum::FloatType(t) => t.vec_type(width),
        _ => unreachable!("optimizer kernels are f32 or f64"),
    };
    let align = kernel.dtype.size() as u32;
    let address = |base: PointerValue<'ctx>| -> Result<PointerValue<'ctx>, LlvmError> {
        // SAFETY (of the generated code): `at + width <= len` for every pointer of the chunk.
        Ok(unsafe { e.b.build_in_bounds_gep(ty, base, &[at], "")? })
    };
    let load = |base: PointerValue<'ctx>| -> Result<V<'ctx>, LlvmError> {
        let value = e.b.build_load(vector, address(base)?, "")?;
        if let Some(instruction) = inkwell::values::BasicValue::as_instruction_value(&value) {
            let _ = instruction.set_alignment(align);
        }
        Ok(value.into_vector_value())
    };
    let store = |base: PointerValue<'ctx>, value: V<'ctx>| -> Result<(), LlvmError> {
        let _ = e.b.build_store(address(base)?, value)?.set_alignment(align);
        Ok(())
    };
    let [param, grad, first, second] = chunk.inputs;
    let [param_out, first_out, second_out] = chunk.outputs;
    let (p, g) = (load(param)?, load(grad)?);
    match &kernel.optimizer {
        Optimizer::AdamW(_) => {
            let [decay, one_minus_b1, b2, one_minus_b2, step_size, bias2_sqrt, eps] = constants else {
                return Err(LlvmError::llvm("optimizer kernel", "AdamW takes 7 constants"));
            };
            let (m, v) = (load(first)?, load(second)?);
            let decayed = e.fmul(p, *decay)?;
            let m = e.fadd(m, e.fmul(e.fsub(g, m)?, *one_minus_b1)?)?;
            let v = e.fadd(e.fmul(v, *b2)?, e.fmul(e.fmul(g, g)?, *one_minus_b2)?)?;
            let denom = e.fadd(e.fdiv(e.intrinsic("llvm.sqrt", &[v])?, *bias2_sqrt)?, *eps)?;
            let p = e.fsub(decayed, e.fmul(*step_size, e.fdiv(m, denom)?)?)?;
            store(first_out, m)?;
            store(second_out, v)?;
            store(param_out, p)?;
        }
        Optimizer::Sgd(c) => {
            let [lr, weight_decay, momentum] = constants else {
                return Err(LlvmError::llvm("optimizer kernel", "SGD takes 3 constants"));
            };
            let d = if c.weight_decay != 0.0 { e.fadd(g, e.fmul(*weight_decay, p)?)? } else { g };
            let step = if c.momentum != 0.0 {
                let buf = e.fadd(e.fmul(load(first)?, *momentum)?, d)?;
                store(first_out, buf)?;
                if c.nesterov {
                    e.fadd(d, e.fmul(*momentum, buf)?)?
                } else {
                    buf
                }
            } else {
                // The buffer stays as it was; an output apart from its input receives it.
                store(first_out, load(first)?)?;
                d
            };
            store(param_out, e.fsub(p, e.fmul(*lr, step)?)?)?;
        }
    }
    Ok(())
}

/// Checks `kernel`, adds `void symbol(params)` and positions the builder in its entry block.
fn declare<'ctx>(
    e: &Emitter<'_, 'ctx>,
    kernel: &OptimizerKernel,
    symbol: &str,
    params: &[BasicMetadataTypeEnum<'ctx>],
) -> Result<FunctionValue<'ctx>, LlvmError> {
    kernel.check()?;
    let function = e.module.add_function(symbol, e.ctx.void_type().fn_type(params, false), None);
    e.b.position_at_end(e.ctx.append_basic_block(function, "entry"));
    Ok(function)
}

/// The x86 form: `void k(u8** args, i64 begin, i64 end)`, `args = [chunks, constants]`.
pub(crate) fn define_cpu<'ctx>(
    e: &Emitter<'_, 'ctx>,
    symbol: &str,
    kernel: &OptimizerKernel,
    width: u32,
) -> Result<FunctionValue<'ctx>, LlvmError> {
    let (i64t, ptr) = (e.ctx.i64_type(), e.ctx.ptr_type(AddressSpace::default()));
    let function = declare(e, kernel, symbol, &[ptr.into(), i64t.into(), i64t.into()])?;
    let args = function.get_nth_param(0).expect("declared").into_pointer_value();
    let begin = function.get_nth_param(1).expect("declared").into_int_value();
    let end = function.get_nth_param(2).expect("declared").into_int_value();
    let arg = |k: u64| -> Result<PointerValue<'ctx>, LlvmError> {
        // SAFETY (of the generated code): the caller passes two pointers.
        let at = unsafe { e.b.build_in_bounds_gep(ptr, args, &[i64t.const_int(k, false)], "")? };
        Ok(e.b.build_load(ptr, at, "")?.into_pointer_value())
    };
    let (table, constants) = (arg(0)?, arg(1)?);
    let wide = load_constants(e, kernel, constants, width)?;
    let narrow = load_constants(e, kernel, constants, 1)?;
    let one = i64t.const_int(1, false);
    counted_loop(e, function, begin, end, one, &[], |index, _| {
        let chunk = load_chunk(e, table, index)?;
        let rest = e.b.build_int_unsigned_rem(chunk.len, i64t.const_int(width as u64, false), "")?;
        let vectors_end = e.b.build_int_sub(chunk.len, rest, "")?;
        counted_loop(
            e,
            function,
            i64t.const_zero(),
            vectors_end,
            i64t.const_int(width as u64, false),
            &[],
            |at, _| {
                update_elements(e, kernel, &chunk, &wide, at, width)?;
                Ok(vec![])
            },
        )?;
        counted_loop(e, function, vectors_end, chunk.len, one, &[], |at, _| {
            update_elements(e, kernel, &chunk, &narrow, at, 1)?;
            Ok(vec![])
        })?;
        Ok(vec![])
    })?;
    e.b.build_return(None)?;
    Ok(function)
}

/// The NVPTX form: `void k(TensorUpdate* chunks, i64 num_chunks, F* constants)`, with
/// `special_register("tid.x")` and so on reading the thread's coordinates.
pub(crate) fn define_nvptx<'ctx>(
    e: &Emitter<'_, 'ctx>,
    kernel: &OptimizerKernel,
    special_register: impl Fn(&str) -> Result<IntValue<'ctx>, LlvmError>,
    threads_per_block: u64,
) -> Result<FunctionValue<'ctx>, LlvmError> {
    let (i64t, ptr) = (e.ctx.i64_type(), e.ctx.ptr_type(AddressSpace::default()));
    let function = declare(e, kernel, &kernel.entry_name(), &[ptr.into(), i64t.into(), ptr.into()])?;
    let table = function.get_nth_param(0).expect("declared").into_pointer_value();
    let num_chunks = function.get_nth_param(1).expect("declared").into_int_value();
    let constants = load_constants(e, kernel, function.get_nth_param(2).expect("declared").into_pointer_value(), 1)?;
    let (thread, block, blocks) =
        (special_register("tid.x")?, special_register("ctaid.x")?, special_register("nctaid.x")?);
    counted_loop(e, function, block, num_chunks, blocks, &[], |index, _| {
        let chunk = load_chunk(e, table, index)?;
        counted_loop(e, function, thread, chunk.len, i64t.const_int(threads_per_block, false), &[], |at, _| {
            update_elements(e, kernel, &chunk, &constants, at, 1)?;
            Ok(vec![])
        })?;
        Ok(vec![])
    })?;
    e.b.build_return(None)?;
    Ok(function)
}
