//! A GPU block's threads simulated on host threads, so that tests run generated GPU code as a GPU
//! would, warp-level operations included, on a machine without one: the kernels of the kernel
//! IR ([`crate::nvptx`]: block folds through warp shuffles and shared memory, barriers, rows
//! split across blocks, vectors of four) and the tensor-core attention passes
//! ([`crate::attention_tiles`]).
//!
//! The code is compiled for the host as [`crate::Function::SimulatedKernel`] or
//! [`crate::Function::SimulatedAttention`]: the same emitter, with the GPU's special registers,
//! barriers, shuffles, `mma.sync`, `ldmatrix`, `ex2` and shared memory replaced by a
//! [`SimulatedBlock`] passed as its last buffer (`crate::lanes`). Its entry is
//! `f(buffers, block, thread)`; [`launch`] starts a thread per GPU thread of each block and
//! each warp's operations meet at a barrier of the warp's 32 threads, where every lane puts its
//! operands and takes its result as PTX's ISA defines the operation:
//!
//! - `mma.sync.m16n8k16.row.col` with 16-bit A (16 x 16) and B (16 x 8) and an f32 C: lane `l`
//!   (group `g = l / 4`, pair `t = l % 4`) holds A's `(g, 2t..2t+2)`, `(g + 8, 2t..)`,
//!   `(g, 2t + 8..)`, `(g + 8, 2t + 8..)`, B's `(2t..2t+2, g)` and `(2t + 8..2t+10, g)` (the
//!   lower index in the low half of each word), and C's and D's `(g, 2t)`, `(g, 2t + 1)`,
//!   `(g + 8, 2t)`, `(g + 8, 2t + 1)`; the products are summed in f32 (a GPU's order within one
//!   `mma` is its own, so results may differ from it in the last bits);
//! - `ldmatrix.sync.m8n8.x4[.trans].b16`: lanes `8m..8m+8` name the rows of matrix `m`, each 8
//!   16-bit elements; lane `l` receives word `m` holding elements `(g, 2t)` and `(g, 2t + 1)`
//!   of matrix `m`, or with `.trans` `(2t, g)` and `(2t + 1, g)`;
//! - `shfl.sync.bfly`: lane `l` receives lane `l ^ offset`'s value;
//! - `ex2.approx.ftz.f32`: the host's `exp2`, a subnormal result flushed to 0.
//!
//! A simulated launch is slow (every warp operation is two barriers of 32 host threads) and is
//! for tests of small shapes only.

use std::sync::{Barrier, Mutex};

use autotp_kernels::DType;

/// Threads of a simulated block ([`crate::nvptx::BLOCK`]).
const THREADS: usize = crate::nvptx::BLOCK as usize;

/// What a simulated thread's code reads: its block's shared memory, the grid's blocks, and the
/// warp operations (the generated code calls them through these pointers with the block and
/// its thread index). The words the generated code reads come first, in this order.
#[repr(C)]
pub struct SimulatedBlock {
    shared: *mut u8,
    blocks: i64,
    barrier: extern "C" fn(&SimulatedBlock, i64),
    shuffle: extern "C" fn(&SimulatedBlock, i64, f32, i64) -> f32,
    mma: extern "C" fn(&SimulatedBlock, i64, *const i32, *mut f32),
    load_matrices: extern "C" fn(&SimulatedBlock, i64, *const u8, i64, *mut i32),
    exp2: extern "C" fn(&SimulatedBlock, i64, f32) -> f32,
    dtype: DType,
    block_barrier: Barrier,
    warps: Vec<Warp>,
}

/// The word offsets of [`SimulatedBlock`]'s fields the generated code reads.
pub(crate) mod word {
    pub const SHARED: usize = 0;
    pub const BLOCKS: usize = 1;
    pub const BARRIER: usize = 2;
    pub const SHUFFLE: usize = 3;
    pub const MMA: usize = 4;
    pub const LOAD_MATRICES: usize = 5;
    pub const EXP2: usize = 6;
}

/// What a warp's lanes put down for a warp operation.
#[derive(Clone, Copy, Default)]
struct Slot {
    words: [i32; 6],
    acc: [f32; 4],
    value: f32,
    address: usize,
}

struct Warp {
    barrier: Barrier,
    slots: Mutex<[Slot; 32]>,
}

impl SimulatedBlock {
    fn new(shared: &mut [u8], blocks: usize, dtype: DType) -> SimulatedBlock {
        SimulatedBlock {
            shared: shared.as_mut_ptr(),
            blocks: blocks as i64,
            barrier,
            shuffle,
            mma,
            load_matrices,
            exp2,
            dtype,
            block_barrier: Barrier::new(THREADS),
            warps: (0..THREADS / 32)
                .map(|_| Warp { barrier: Barrier::new(32), slots: Mutex::new([Slot::default(); 32]) })
                .collect(),
        }
    }

    /// Lane `thread % 32` puts its slot down, then takes its result from every lane's once all
    /// have, before any lane of the warp puts down the next.
    fn exchange<R>(&self, thread: i64, put: impl FnOnce(&mut Slot), take: impl FnOnce(&[Slot; 32], usize) -> R) -> R {
        let (warp, lane) = (&self.warps[thread as usize / 32], thread as usize % 32);
        put(&mut warp.slots.lock().unwrap_or_else(|p| p.into_inner())[lane]);
        warp.barrier.wait();
        let result = take(&warp.slots.lock().unwrap_or_else(|p| p.into_inner()), lane);
        warp.barrier.wait();
        result
    }

    fn widen(&self, bits: u16) -> f32 {
        match self.dtype {
            DType::F16 => half::f16::from_bits(bits).to_f32(),
            _ => f32::from_bits(u32::from(bits) << 16),
        }
    }
}

/// `ex2.approx.ftz.f32`: 2^x, subnormal results flushed to 0.
extern "C" fn exp2(_block: &SimulatedBlock, _thread: i64, x: f32) -> f32 {
    let power = x.exp2();
    if power != 0.0 && power.abs() < f32::MIN_POSITIVE {
        0.0
    } else {
        power
    }
}

extern "C" fn barrier(block: &SimulatedBlock, _thread: i64) {
    block.block_barrier.wait();
}

extern "C" fn shuffle(block: &SimulatedBlock, thread: i64, value: f32, offset: i64) -> f32 {
    block.exchange(thread, |slot| slot.value = value, |slots, lane| slots[lane ^ offset as usize].value)
}

/// The two 16-bit halves of a word: (low, high).
fn halves(word: i32) -> [u16; 2] {
    [word as u32 as u16, (word as u32 >> 16) as u16]
}

extern "C" fn mma(block: &SimulatedBlock, thread: i64, words: *const i32, acc: *mut f32) {
    // SAFETY: the generated code passes 6 words (a's 4, b's 2) and 4 floats.
    let (words, acc) = unsafe { (std::slice::from_raw_parts(words, 6), std::slice::from_raw_parts_mut(acc, 4)) };
    let mut mine = Slot::default();
    mine.words.copy_from_slice(words);
    mine.acc.copy_from_slice(acc);
    let d = block.exchange(
        thread,
        |slot| *slot = mine,
        |slots, lane| {
            let (mut a, mut b) = ([[0f32; 16]; 16], [[0f32; 8]; 16]);
            for (l, slot) in slots.iter().enumerate() {
                let (g, t) = (l / 4, l % 4);
                for (w, (row, col)) in
                    [(g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8)].into_iter().enumerate()
                {
                    let [low, high] = halves(slot.words[w]);
                    (a[row][col], a[row][col + 1]) = (block.widen(low), block.widen(high));
                }
                for (w, k) in [(4, 2 * t), (5, 2 * t + 8)] {
                    let [low, high] = halves(slot.words[w]);
                    (b[k][g], b[k + 1][g]) = (block.widen(low), block.widen(high));
                }
            }
            let (g, t) = (lane / 4, lane % 4);
            let c = slots[lane].acc;
            let at = [(g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1)];
            at.map(|(row, col)| (0..16).fold(0f32, |sum, k| a[row][k].mul_add(b[k][col], sum)))
                .iter()
                .zip(c)
                .map(|(product, c)| product + c)
                .collect::<Vec<f32>>()
        },
    );
    acc.copy_from_slice(&d);
}

extern "C" fn load_matrices(block: &SimulatedBlock, thread: i64, address: *const u8, transposed: i64, out: *mut i32) {
    let words = block.exchange(
        thread,
        |slot| slot.address = address as usize,
        |slots, lane| {
            let (g, t) = (lane / 4, lane % 4);
            let element = |row: usize, col: usize| {
                // SAFETY: each row address names 8 16-bit elements of the block's shared memory.
                unsafe { std::ptr::read_unaligned((row as *const u16).add(col)) }
            };
            (0..4)
                .map(|m| {
                    let rows = |r: usize| slots[8 * m + r].address;
                    let (low, high) = match transposed != 0 {
                        true => (element(rows(2 * t), g), element(rows(2 * t + 1), g)),
                        false => (element(rows(g), 2 * t), element(rows(g), 2 * t + 1)),
                    };
                    (u32::from(high) << 16 | u32::from(low)) as i32
                })
                .collect::<Vec<i32>>()
        },
    );
    // SAFETY: the generated code passes room for 4 words.
    unsafe { std::ptr::copy_nonoverlapping(words.as_ptr(), out, 4) };
}

/// Runs `entry` (a kernel or a tensor-core attention pass compiled as
/// [`crate::Function::SimulatedKernel`] or [`crate::Function::SimulatedAttention`]) on `blocks`
/// simulated blocks, one after the other, a host thread per GPU thread, each block with
/// `shared_bytes` of shared memory; `dtype` is what its `mma`s multiply (bf16 or f16).
///
/// # Safety
/// As [`crate::cpu::CpuKernel::run`]: `buffers` must be the entry's, of its sizes.
pub unsafe fn launch(
    entry: crate::cpu::CpuKernel,
    buffers: &[*mut u8],
    blocks: usize,
    shared_bytes: usize,
    dtype: DType,
) {
    let mut shared = vec![0u8; shared_bytes];
    for b in 0..blocks {
        let block = SimulatedBlock::new(&mut shared, blocks, dtype);
        let mut words: Vec<usize> = buffers.iter().map(|&p| p as usize).collect();
        words.push(&block as *const SimulatedBlock as usize);
        std::thread::scope(|scope| {
            for thread in 0..THREADS {
                let words = &words;
                scope.spawn(move || {
                    let pointers: Vec<*mut u8> = words.iter().map(|&w| w as *mut u8).collect();
                    // SAFETY: the caller's buffers and this block outlive the scope.
                    unsafe { entry.run(&pointers, b..thread) };
                });
            }
        });
    }
}

/// [`launch`] of an attention pass `f` compiled as [`crate::Function::SimulatedAttention`],
/// with the shared memory it takes (none a thread per row).
///
/// # Safety
/// As [`launch`].
pub unsafe fn launch_attention(
    entry: crate::cpu::CpuKernel,
    f: &autotp_kernels::attention::AttentionFunction,
    buffers: &[*mut u8],
    blocks: usize,
) {
    let shared_bytes = if f.tensor_cores { crate::attention_tiles::shared_bytes(f) } else { 0 };
    unsafe { launch(entry, buffers, blocks, shared_bytes, f.dtype) }
}
