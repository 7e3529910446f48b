//! The multi-tensor optimizer step as generated code: one kernel per update rule that walks a
//! table of chunks, each a [`TensorUpdate`](autotp_kernels::optim::TensorUpdate) (a piece of one parameter with its gradient and
//! states), as Apex's `multi_tensor_apply` does. Every parameter of a step is updated by one
//! launch (CUDA) or one pass of the thread pool (x86).
//!
//! The per-element arithmetic is [`autotp_kernels::optim`]'s, operation for operation and in
//! the same order. So are the step's constants: each entry reads the step's scalars (the
//! learning rate, and AdamW's step count) where the program keeps them and computes the bias
//! corrections in f64 as the Rust kernels do, with [`autotp_kernels::optim::power`]'s
//! multiplications, so the host never reads a scalar back to prepare a GPU's step. No
//! operation is contracted or approximated (`sqrt` and division are IEEE on both targets), so
//! the generated step is bit-identical to the Rust kernels; the test checks it on x86.
//!
//! - x86: `void k(u8** args, i64 begin, i64 end)` with `args = [chunks, scalars..., guard]`
//!   runs chunks `begin..end` in order, vectors of the host's width and a scalar tail.
//! - NVPTX: `void k(TensorUpdate* chunks, i64 num_chunks, F* scalars..., u8* guard)`, block
//!   `b` takes chunks `b, b + gridDim.x, ...`, thread `t` elements `t, t + BLOCK, ...` of each.
//!
//! `guard` is null, or the address of the bool that says whether the step's gradients are all
//! finite: where it is 0 the kernel returns before it writes anything, so a GPU skips a
//! non-finite step without the host reading the guard back (and inside a CUDA graph).
//!
//! An output not updated in place receives the new values directly (elements are read from the
//! inputs and written to the outputs), so no copy precedes the step.

use autotp_kernels::optim::Optimizer;
use autotp_kernels::optim::OptimizerKernel;
use autotp_kernels::DType;
use inkwell::types::{BasicMetadataTypeEnum, BasicTypeEnum};
use inkwell::values::{FunctionValue, IntValue, PointerValue};
use inkwell::{AddressSpace, IntPredicate};

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

/// The step's constants, computed in f64 from its scalars as `autotp_kernels::optim` computes
/// them and rounded to the element type once: AdamW `[decay, 1 - b1, b2, 1 - b2, step_size,
/// sqrt(1 - b2^t), eps]`, SGD `[lr, weight_decay, momentum]`. `scalars` point at the step's
/// scalars ([`Optimizer::num_scalars`], of the element type).
fn step_constants<'ctx>(
    e: &Emitter<'_, 'ctx>,
    function: FunctionValue<'ctx>,
    kernel: &OptimizerKernel,
    scalars: &[PointerValue<'ctx>],
) -> Result<Vec<V<'ctx>>, LlvmError> {
    let ty = kernel.element_type(e);
    let f64t = e.ctx.f64_type();
    let wide = |x: f64| -> Result<V<'ctx>, LlvmError> { e.splat(f64t.const_float(x).into(), 1) };
    // A constant rounded on the host as the Rust kernels round it.
    let fixed = |x: f64| -> Result<V<'ctx>, LlvmError> {
        let value = match kernel.dtype {
            DType::F64 => f64t.const_float(x),
            _ => e.ctx.f32_type().const_float(x as f32 as f64),
        };
        e.splat(value.into(), 1)
    };
    let narrow = |x: V<'ctx>| -> Result<V<'ctx>, LlvmError> {
        Ok(match kernel.dtype {
            DType::F64 => x,
            _ => e.b.build_float_trunc(x, e.ctx.f32_type().vec_type(1), "")?,
        })
    };
    let scalar = |k: usize| -> Result<V<'ctx>, LlvmError> {
        let pointer = scalars.get(k).ok_or_else(|| LlvmError::llvm("optimizer kernel", "a scalar is missing"))?;
        let value = e.splat(e.b.build_load(ty, *pointer, "")?, 1)?;
        Ok(match kernel.dtype {
            DType::F64 => value,
            _ => e.b.build_float_ext(value, f64t.vec_type(1), "")?,
        })
    };
    let lr = scalar(0)?;
    match &kernel.optimizer {
        Optimizer::AdamW(c) => {
            let steps = whole_steps(e, scalar(1)?)?;
            let one = wide(1.0)?;
            let decay = e.fsub(one, e.fmul(lr, wide(c.weight_decay)?)?)?;
            let step_size = e.fdiv(lr, e.fsub(one, power(e, function, c.beta1, steps)?)?)?;
            let bias2 = e.fsub(one, power(e, function, c.beta2, steps)?)?;
            let bias2_sqrt = e.intrinsic("llvm.sqrt", &[bias2])?;
            Ok(vec![
                narrow(decay)?,
                fixed(1.0 - c.beta1)?,
                fixed(c.beta2)?,
                fixed(1.0 - c.beta2)?,
                narrow(step_size)?,
                narrow(bias2_sqrt)?,
                fixed(c.eps)?,
            ])
        }
        Optimizer::Sgd(c) => Ok(vec![narrow(lr)?, fixed(c.weight_decay)?, fixed(c.momentum)?]),
    }
}

/// `t` (f64) as a whole count, saturating as Rust's `as u64` does (NaN and negatives 0).
fn whole_steps<'ctx>(e: &Emitter<'_, 'ctx>, t: V<'ctx>) -> Result<V<'ctx>, LlvmError> {
    let name = "llvm.fptoui.sat";
    let intrinsic = inkwell::intrinsics::Intrinsic::find(name).ok_or_else(|| LlvmError::llvm("intrinsic", name))?;
    let types = [e.ctx.i64_type().vec_type(1).into(), t.get_type().into()];
    let function =
        intrinsic.get_declaration(e.module, &types).ok_or_else(|| LlvmError::llvm("intrinsic declaration", name))?;
    let call = e.b.build_call(function, &[t.into()], "")?;
    Ok(call.try_as_basic_value().basic().ok_or_else(|| LlvmError::llvm("intrinsic call", name))?.into_vector_value())
}

/// `base^steps` as [`autotp_kernels::optim::power`] computes it: over the bits of `steps` from
/// the lowest up to its highest set bit, the result times the current square where the bit is
/// set, then the square squared.
fn power<'ctx>(
    e: &Emitter<'_, 'ctx>,
    function: FunctionValue<'ctx>,
    base: f64,
    steps: V<'ctx>,
) -> Result<V<'ctx>, LlvmError> {
    let i64t = e.ctx.i64_type();
    let start =
        [e.splat(e.ctx.f64_type().const_float(1.0).into(), 1)?, e.splat(e.ctx.f64_type().const_float(base).into(), 1)?];
    // Up to the highest set bit (64 minus the leading zeros): a step count's ~log2(t) bits.
    let ctlz = inkwell::intrinsics::Intrinsic::find("llvm.ctlz")
        .and_then(|f| f.get_declaration(e.module, &[i64t.into()]))
        .ok_or_else(|| LlvmError::llvm("intrinsic declaration", "llvm.ctlz"))?;
    let n = e.lane(steps, 0)?;
    let zero_is_defined = e.ctx.bool_type().const_zero();
    let leading_zeros = e.b.build_call(ctlz, &[n.into(), zero_is_defined.into()], "")?;
    let leading_zeros = (leading_zeros.try_as_basic_value().basic())
        .ok_or_else(|| LlvmError::llvm("intrinsic call", "llvm.ctlz"))?
        .into_int_value();
    let bits = e.b.build_int_sub(i64t.const_int(64, false), leading_zeros, "")?;
    let done = counted_loop(e, function, i64t.const_zero(), bits, i64t.const_int(1, false), &start, |bit, carried| {
        let [result, square] = carried else { unreachable!("two carried values") };
        let shifted = e.b.build_right_shift(steps, e.splat(bit.into(), 1)?, false, "")?;
        let set = e.icmp(IntPredicate::NE, e.b.build_and(shifted, e.i64(1, 1), "")?, e.i64(1, 0))?;
        Ok(vec![e.select(set, e.fmul(*result, *square)?, *result)?, e.fmul(*square, *square)?])
    })?;
    Ok(done[0])
}

/// The step's constants ([`step_constants`]) as `width`-lane splats.
fn splat_constants<'ctx>(e: &Emitter<'_, 'ctx>, constants: &[V<'ctx>], width: u32) -> Result<Vec<V<'ctx>>, LlvmError> {
    constants.iter().map(|&c| e.broadcast(c, width)).collect()
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

/// Returns from `function` unless `guard` is null or the byte it points at is not 0; the
/// builder continues in the block where the step runs.
fn return_unless_guarded<'ctx>(
    e: &Emitter<'_, 'ctx>,
    function: FunctionValue<'ctx>,
    guard: PointerValue<'ctx>,
) -> Result<(), LlvmError> {
    let (check, skip, run) = (
        e.ctx.append_basic_block(function, "guard.check"),
        e.ctx.append_basic_block(function, "guard.skip"),
        e.ctx.append_basic_block(function, "guard.run"),
    );
    e.b.build_conditional_branch(e.b.build_is_null(guard, "")?, run, check)?;
    e.b.position_at_end(check);
    let byte = e.b.build_load(e.ctx.i8_type(), guard, "")?.into_int_value();
    let finite = e.b.build_int_compare(IntPredicate::NE, byte, e.ctx.i8_type().const_zero(), "")?;
    e.b.build_conditional_branch(finite, run, skip)?;
    e.b.position_at_end(skip);
    e.b.build_return(None)?;
    e.b.position_at_end(run);
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

/// The x86 form: `void k(u8** args, i64 begin, i64 end)`, `args = [chunks, scalars..., guard]`.
pub(crate) fn define_cpu<'ctx>(
    e: &Emitter<'_, 'ctx>,
    symbol: &str,
    kernel: &OptimizerKernel,
    width: u32,
) -> Result<FunctionValue<'ctx>, LlvmError> {
    kernel.check()?;
    let i64t = e.ctx.i64_type();
    let entry = crate::cpu::CpuEntry::declare(e, symbol)?;
    let (function, begin, end) = (entry.function, entry.begin, entry.end);
    let table = entry.pointer(e, 0)?;
    let num_scalars = kernel.optimizer.num_scalars();
    let scalars = (1..=num_scalars).map(|k| entry.pointer(e, k)).collect::<Result<Vec<_>, _>>()?;
    return_unless_guarded(e, function, entry.pointer(e, 1 + num_scalars)?)?;
    let narrow = step_constants(e, function, kernel, &scalars)?;
    let wide = splat_constants(e, &narrow, width)?;
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

/// The NVPTX form: `void k(TensorUpdate* chunks, i64 num_chunks, F* scalars..., u8* guard)`, with
/// `special_register("tid.x")` and so on reading the thread's coordinates.
pub(crate) fn define_nvptx<'ctx>(
    e: &Emitter<'_, 'ctx>,
    kernel: &OptimizerKernel,
    special_register: impl Fn(&str) -> Result<IntValue<'ctx>, LlvmError>,
    threads_per_block: u64,
) -> Result<FunctionValue<'ctx>, LlvmError> {
    let (i64t, ptr) = (e.ctx.i64_type(), e.ctx.ptr_type(AddressSpace::default()));
    let num_scalars = kernel.optimizer.num_scalars() as u32;
    let mut params: Vec<BasicMetadataTypeEnum> = vec![ptr.into(), i64t.into()];
    // The scalars, then the guard.
    params.extend(std::iter::repeat_n(BasicMetadataTypeEnum::from(ptr), num_scalars as usize + 1));
    let function = declare(e, kernel, &kernel.entry_name(), &params)?;
    let pointer = |k: u32| function.get_nth_param(k).expect("declared").into_pointer_value();
    let table = pointer(0);
    let num_chunks = function.get_nth_param(1).expect("declared").into_int_value();
    let scalars: Vec<PointerValue> = (2..2 + num_scalars).map(pointer).collect();
    return_unless_guarded(e, function, pointer(2 + num_scalars))?;
    let constants = step_constants(e, function, kernel, &scalars)?;
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
