//! What a warp does beyond its own registers, on a GPU (inline PTX and NVVM intrinsics) or in a
//! simulated block ([`crate::warp_simulator`]: calls through its words): tensor-core `mma`s,
//! `ldmatrix`, `cp.async`, shuffles, barriers, the packing of `mma` operands and the scores'
//! exponentials.

use autotp_kernels::DType;
use inkwell::values::{BasicMetadataValueEnum, IntValue, PointerValue};
use inkwell::AddressSpace;

use super::Tiles;
use crate::emit::{Emitter, V};
use crate::lanes::Lanes;
use crate::nvptx::call;
use crate::LlvmError;

impl<'ctx> Tiles<'_, '_, 'ctx> {
    /// Two f32 (lanes 0 and 1 of `x`) rounded to the dtype (to nearest even, as
    /// [`Emitter::narrow`] rounds), as the i32 an `mma` operand takes (lane 0 in the low half):
    /// on a GPU one `cvt.rn.bf16x2.f32` (or `f16x2`).
    pub(super) fn pack(&self, x: V<'ctx>) -> Result<IntValue<'ctx>, LlvmError> {
        let (e, f32t, i32t) = (self.e, self.e.ctx.f32_type(), self.e.ctx.i32_type());
        if let Lanes::Simulated { .. } = self.lanes {
            let narrow = e.narrow(self.f.dtype, self.shuffle(x, x, &[0, 1])?)?;
            return Ok(e.b.build_bit_cast(narrow, i32t, "")?.into_int_value());
        }
        let ty = i32t.fn_type(&[f32t.into(), f32t.into()], false);
        let text = format!("cvt.rn.{}x2.f32 $0, $1, $2;", self.f.dtype);
        let asm = e.ctx.create_inline_asm(ty, text, "=r,f,f".into(), false, false, None, false);
        let call = e.b.build_indirect_call(ty, asm, &[e.lane(x, 1)?.into(), e.lane(x, 0)?.into()], "")?;
        Ok(call.try_as_basic_value().basic().expect("returns a word").into_int_value())
    }

    /// A call of the simulated block's operation at word `w` with `(block, thread, args..)`.
    pub(super) fn simulated(
        &self,
        w: usize,
        ty: inkwell::types::FunctionType<'ctx>,
        args: &[BasicMetadataValueEnum<'ctx>],
    ) -> Result<inkwell::values::CallSiteValue<'ctx>, LlvmError> {
        self.lanes.call(self.e, self.thread, w, ty, args)
    }

    /// `e^x` lane by lane as the hardware's `2^(x log2 e)` (`ex2.approx.ftz.f32`, one
    /// instruction on the special function unit, within 2 ulps; subnormal results flush to 0):
    /// the exponentials of the scores, which the tensor cores take rounded to 16 bits anyway.
    pub(super) fn exp(&self, x: V<'ctx>) -> Result<V<'ctx>, LlvmError> {
        let (e, f32t, i32t) = (self.e, self.e.ctx.f32_type(), self.e.ctx.i32_type());
        let scaled = e.fmul(x, e.f32(Emitter::width(x), std::f32::consts::LOG2_E))?;
        let mut result = e.f32_type(Emitter::width(x)).get_undef();
        for l in 0..Emitter::width(x) {
            let lane = e.lane(scaled, l)?;
            let power = match self.lanes {
                Lanes::Simulated { .. } => {
                    let ptr = e.ctx.ptr_type(AddressSpace::default());
                    let ty = f32t.fn_type(&[ptr.into(), e.ctx.i64_type().into(), f32t.into()], false);
                    let call = self.simulated(crate::warp_simulator::word::EXP2, ty, &[lane.into()])?;
                    call.try_as_basic_value().basic().expect("returns a float")
                }
                Lanes::Nvptx => call(e, "llvm.nvvm.ex2.approx.ftz.f", &[lane.into()])?
                    .ok_or_else(|| LlvmError::llvm("NVPTX exp2", "no value"))?,
            };
            result = e.b.build_insert_element(result, power, i32t.const_int(l as u64, false), "")?;
        }
        Ok(result)
    }

    /// A barrier of the block's threads (`bar.sync 0`).
    pub(super) fn barrier(&self) -> Result<(), LlvmError> {
        self.lanes.barrier(self.e, self.thread)
    }

    /// The f32 `x` of lane `lane ^ offset` (`shfl.sync.bfly`, every lane of the warp taking part).
    pub(super) fn shuffle_xor(
        &self,
        x: inkwell::values::BasicValueEnum<'ctx>,
        offset: u64,
    ) -> Result<inkwell::values::BasicValueEnum<'ctx>, LlvmError> {
        self.lanes.shuffle_xor(self.e, self.thread, x, offset)
    }

    /// `x` folded with the values of the other threads of its quad (lanes differing in their two
    /// lowest bits), every lane of `x` alone: the same result in all four.
    pub(super) fn quad_fold(
        &self,
        x: V<'ctx>,
        fold: impl Fn(V<'ctx>, V<'ctx>) -> Result<V<'ctx>, LlvmError>,
    ) -> Result<V<'ctx>, LlvmError> {
        let (e, i32t) = (self.e, self.e.ctx.i32_type());
        let mut x = x;
        for offset in [1u64, 2] {
            let mut other = e.f32_type(Emitter::width(x)).get_undef();
            for l in 0..Emitter::width(x) {
                let shuffled = self.shuffle_xor(e.lane(x, l)?, offset)?;
                other = e.b.build_insert_element(other, shuffled, i32t.const_int(l as u64, false), "")?;
            }
            x = fold(x, other)?;
        }
        Ok(x)
    }

    /// `c + a b` on tensor cores: `a` a 16 x 16 fragment (4 registers of two elements), `b` a
    /// 16 x 8 one (2 registers), `c` the 16 x 8 f32 accumulator's 4 elements.
    pub(super) fn mma(
        &self,
        a: &[IntValue<'ctx>; 4],
        b: [IntValue<'ctx>; 2],
        c: V<'ctx>,
    ) -> Result<V<'ctx>, LlvmError> {
        let (e, f32t, i32t) = (self.e, self.e.ctx.f32_type(), self.e.ctx.i32_type());
        if let Lanes::Simulated { words, acc, .. } = self.lanes {
            for (w, &word) in a.iter().chain(&b).enumerate() {
                e.b.build_store(self.element(i32t, words, self.int(w))?, word)?;
            }
            for l in 0..4 {
                e.b.build_store(self.element(f32t, acc, self.int(l))?, e.lane(c, l as u32)?)?;
            }
            let (ptr, i64t) = (e.ctx.ptr_type(AddressSpace::default()), e.ctx.i64_type());
            let ty = e.ctx.void_type().fn_type(&[ptr.into(), i64t.into(), ptr.into(), ptr.into()], false);
            self.simulated(crate::warp_simulator::word::MMA, ty, &[words.into(), acc.into()])?;
            let mut d = e.f32_type(4).get_undef();
            for l in 0..4 {
                let x = e.b.build_load(f32t, self.element(f32t, acc, self.int(l))?, "")?;
                d = e.b.build_insert_element(d, x, i32t.const_int(l as u64, false), "")?;
            }
            return Ok(d);
        }
        let operand = match self.f.dtype {
            DType::F16 => "f16",
            _ => "bf16",
        };
        let result = e.ctx.struct_type(&[f32t.into(); 4], false);
        let mut params: Vec<inkwell::types::BasicMetadataTypeEnum> = vec![i32t.into(); 6];
        params.extend([inkwell::types::BasicMetadataTypeEnum::from(f32t); 4]);
        let ty = result.fn_type(&params, false);
        let text = format!(
            "mma.sync.aligned.m16n8k16.row.col.f32.{operand}.{operand}.f32 {{$0,$1,$2,$3}}, {{$4,$5,$6,$7}}, \
             {{$8,$9}}, {{$10,$11,$12,$13}};"
        );
        let constraints = "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f".to_string();
        let asm = e.ctx.create_inline_asm(ty, text, constraints, false, false, None, false);
        let mut args: Vec<BasicMetadataValueEnum> = a.iter().chain(&b).map(|&x| x.into()).collect();
        for l in 0..4 {
            args.push(e.lane(c, l)?.into());
        }
        let call = e.b.build_indirect_call(ty, asm, &args, "")?;
        let value = call.try_as_basic_value().basic().expect("returns four floats").into_struct_value();
        let mut d = e.f32_type(4).get_undef();
        for l in 0..4 {
            let x = e.b.build_extract_value(value, l, "")?;
            d = e.b.build_insert_element(d, x, i32t.const_int(l as u64, false), "")?;
        }
        Ok(d)
    }

    /// `ldmatrix.x4` from shared memory: four 8 x 8 matrices of 16-bit elements, the row this
    /// thread names at `address` (row `lane % 8` of matrix `lane / 8`); word `m` holds matrix
    /// `m`'s elements `(g, 2t)` and `(g, 2t + 1)`, or with `transposed` (`.trans`) `(2t, g)` and
    /// `(2t + 1, g)`: B fragments of rows in shared memory, or of their transpose.
    pub(super) fn load_matrices(
        &self,
        address: PointerValue<'ctx>,
        transposed: bool,
    ) -> Result<[IntValue<'ctx>; 4], LlvmError> {
        let (e, i32t, i64t) = (self.e, self.e.ctx.i32_type(), self.e.ctx.i64_type());
        if let Lanes::Simulated { words, .. } = self.lanes {
            let ptr = e.ctx.ptr_type(AddressSpace::default());
            let ty = e.ctx.void_type().fn_type(&[ptr.into(), i64t.into(), ptr.into(), i64t.into(), ptr.into()], false);
            let args = [address.into(), self.int(usize::from(transposed)).into(), words.into()];
            self.simulated(crate::warp_simulator::word::LOAD_MATRICES, ty, &args)?;
            let word = |w: usize| -> Result<IntValue<'ctx>, LlvmError> {
                Ok(e.b.build_load(i32t, self.element(i32t, words, self.int(w))?, "")?.into_int_value())
            };
            return Ok([word(0)?, word(1)?, word(2)?, word(3)?]);
        }
        let result = e.ctx.struct_type(&[i32t.into(); 4], false);
        let ty = result.fn_type(&[i64t.into()], false);
        let trans = if transposed { ".trans" } else { "" };
        let text = format!("ldmatrix.sync.aligned.m8n8.x4{trans}.shared.b16 {{$0,$1,$2,$3}}, [$4];");
        let asm = e.ctx.create_inline_asm(ty, text, "=r,=r,=r,=r,l,~{memory}".into(), true, false, None, false);
        let at = e.b.build_ptr_to_int(address, i64t, "")?;
        let call = e.b.build_indirect_call(ty, asm, &[at.into()], "")?;
        let value = call.try_as_basic_value().basic().expect("returns four words").into_struct_value();
        let word = |l: u32| -> Result<IntValue<'ctx>, LlvmError> {
            Ok(e.b.build_extract_value(value, l, "")?.into_int_value())
        };
        Ok([word(0)?, word(1)?, word(2)?, word(3)?])
    }

    /// `text`, a `cp.async` bookkeeping instruction (on a GPU; the simulated block copies at
    /// once, so it has nothing to wait for).
    pub(super) fn async_copies(&self, text: &str) -> Result<(), LlvmError> {
        if let Lanes::Simulated { .. } = self.lanes {
            return Ok(());
        }
        let ty = self.e.ctx.void_type().fn_type(&[], false);
        let asm = self.e.ctx.create_inline_asm(ty, text.into(), "~{memory}".into(), true, false, None, false);
        self.e.b.build_indirect_call(ty, asm, &[], "")?;
        Ok(())
    }

    /// `cp.async.cg.shared.global`: 16 bytes from global `from` to shared `to`, or 16 zeros
    /// where `inside` is false (a source size of 0).
    pub(super) fn copy_async(
        &self,
        to: PointerValue<'ctx>,
        from: PointerValue<'ctx>,
        inside: IntValue<'ctx>,
    ) -> Result<(), LlvmError> {
        let (e, i32t, i64t) = (self.e, self.e.ctx.i32_type(), self.e.ctx.i64_type());
        let global = e.b.build_address_space_cast(from, e.ctx.ptr_type(AddressSpace::from(1u16)), "")?;
        let (to, from) = (e.b.build_ptr_to_int(to, i64t, "")?, e.b.build_ptr_to_int(global, i64t, "")?);
        let size = e.b.build_select(inside, i32t.const_int(16, false), i32t.const_zero(), "")?;
        let ty = e.ctx.void_type().fn_type(&[i64t.into(), i64t.into(), i32t.into()], false);
        let text = "cp.async.cg.shared.global [$0], [$1], 16, $2;".to_string();
        let asm = e.ctx.create_inline_asm(ty, text, "l,l,r,~{memory}".into(), true, false, None, false);
        e.b.build_indirect_call(ty, asm, &[to.into(), from.into(), size.into()], "")?;
        Ok(())
    }
}
