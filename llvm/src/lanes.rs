//! Where generated GPU code runs: a GPU's threads, or host threads simulating one block's
//! ([`crate::warp_simulator`]), so that tests execute the code a GPU would. The operations that
//! reach beyond a thread's registers (block barriers, warp shuffles, and the tensor-core passes'
//! `mma`, `ldmatrix`, `ex2`) are NVVM intrinsics or inline PTX on a GPU and calls through the
//! simulated block's words on the host; the special registers and shared memory come from the
//! entry's place ([`Lanes::simulated`]).

use inkwell::types::{BasicTypeEnum, FunctionType};
use inkwell::values::{BasicMetadataValueEnum, BasicValueEnum, CallSiteValue, IntValue, PointerValue};
use inkwell::AddressSpace;

use crate::cpu::CpuEntry;
use crate::emit::Emitter;
use crate::nvptx::call;
use crate::warp_simulator::word;
use crate::LlvmError;

/// How a thread reaches its block: a GPU's, or a simulated one's (its words, and room for an
/// `mma`'s operands, 6 words and 4 floats, made once at the entry).
#[derive(Clone, Copy)]
pub(crate) enum Lanes<'ctx> {
    Nvptx,
    Simulated { context: PointerValue<'ctx>, words: PointerValue<'ctx>, acc: PointerValue<'ctx> },
}

/// The simulated block's side of a host entry `f(buffers, block, thread)`: its lanes, its
/// shared memory and the grid's blocks.
pub(crate) struct SimulatedPlace<'ctx> {
    pub lanes: Lanes<'ctx>,
    pub shared: PointerValue<'ctx>,
    pub blocks: IntValue<'ctx>,
}

impl<'ctx> Lanes<'ctx> {
    /// For a host entry whose buffer word `count` is the
    /// [`SimulatedBlock`](crate::warp_simulator::SimulatedBlock), at the entry's start.
    pub(crate) fn simulated(
        e: &Emitter<'_, 'ctx>,
        entry: &CpuEntry<'ctx>,
        count: usize,
    ) -> Result<SimulatedPlace<'ctx>, LlvmError> {
        let context = entry.pointer(e, count)?;
        let (i32t, i64t, f32t) = (e.ctx.i32_type(), e.ctx.i64_type(), e.ctx.f32_type());
        let shared = context_word(e, context, word::SHARED, e.ctx.ptr_type(AddressSpace::default()).into())?;
        let blocks = context_word(e, context, word::BLOCKS, i64t.into())?;
        let lanes = Lanes::Simulated {
            context,
            words: e.b.build_array_alloca(i32t, i32t.const_int(6, false), "")?,
            acc: e.b.build_array_alloca(f32t, i32t.const_int(4, false), "")?,
        };
        Ok(SimulatedPlace { lanes, shared: shared.into_pointer_value(), blocks: blocks.into_int_value() })
    }

    /// A call of the simulated block's operation at word `w`, `(block, thread, args..)`.
    pub(crate) fn call(
        &self,
        e: &Emitter<'_, 'ctx>,
        thread: IntValue<'ctx>,
        w: usize,
        ty: FunctionType<'ctx>,
        args: &[BasicMetadataValueEnum<'ctx>],
    ) -> Result<CallSiteValue<'ctx>, LlvmError> {
        let Lanes::Simulated { context, .. } = *self else {
            return Err(LlvmError::llvm("GPU code", "a simulated block's operation on a GPU"));
        };
        let operation = context_word(e, context, w, e.ctx.ptr_type(AddressSpace::default()).into())?;
        let mut all: Vec<BasicMetadataValueEnum<'ctx>> = vec![context.into(), thread.into()];
        all.extend_from_slice(args);
        Ok(e.b.build_indirect_call(ty, operation.into_pointer_value(), &all, "")?)
    }

    /// A barrier of the block's threads (`bar.sync 0`).
    pub(crate) fn barrier(&self, e: &Emitter<'_, 'ctx>, thread: IntValue<'ctx>) -> Result<(), LlvmError> {
        if let Lanes::Simulated { .. } = self {
            let (ptr, i64t) = (e.ctx.ptr_type(AddressSpace::default()), e.ctx.i64_type());
            let ty = e.ctx.void_type().fn_type(&[ptr.into(), i64t.into()], false);
            self.call(e, thread, word::BARRIER, ty, &[])?;
            return Ok(());
        }
        call(e, "llvm.nvvm.barrier0", &[])?;
        Ok(())
    }

    /// The f32 `x` of lane `lane ^ offset` (`shfl.sync.bfly`, every lane of the warp taking part).
    pub(crate) fn shuffle_xor(
        &self,
        e: &Emitter<'_, 'ctx>,
        thread: IntValue<'ctx>,
        x: BasicValueEnum<'ctx>,
        offset: u64,
    ) -> Result<BasicValueEnum<'ctx>, LlvmError> {
        let (i32t, i64t, f32t) = (e.ctx.i32_type(), e.ctx.i64_type(), e.ctx.f32_type());
        if let Lanes::Simulated { .. } = self {
            let ptr = e.ctx.ptr_type(AddressSpace::default());
            let ty = f32t.fn_type(&[ptr.into(), i64t.into(), f32t.into(), i64t.into()], false);
            let call = self.call(e, thread, word::SHUFFLE, ty, &[x.into(), i64t.const_int(offset, false).into()])?;
            return Ok(call.try_as_basic_value().basic().expect("returns a float"));
        }
        let args: [BasicMetadataValueEnum; 4] = [
            i32t.const_all_ones().into(),
            x.into(),
            i32t.const_int(offset, false).into(),
            i32t.const_int(31, false).into(),
        ];
        call(e, "llvm.nvvm.shfl.sync.bfly.f32", &args)?.ok_or_else(|| LlvmError::llvm("NVPTX shuffle", "no value"))
    }
}

/// Word `w` of the simulated block at `context`, as a value of `ty`.
fn context_word<'ctx>(
    e: &Emitter<'_, 'ctx>,
    context: PointerValue<'ctx>,
    w: usize,
    ty: BasicTypeEnum<'ctx>,
) -> Result<BasicValueEnum<'ctx>, LlvmError> {
    let i64t = e.ctx.i64_type();
    // SAFETY (of the generated code): the simulator passes a SimulatedBlock, whose leading words
    // these are.
    let at = unsafe { e.b.build_in_bounds_gep(i64t, context, &[i64t.const_int(w as u64, false)], "")? };
    Ok(e.b.build_load(ty, at, "")?)
}
