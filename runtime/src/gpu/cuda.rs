//! The CUDA driver as a [`Gpu`] (cudarc's `driver::result`, loaded at run time).
//!
//! One GPU per executor: the device's primary context (made current on whichever thread calls,
//! since the trainer runs ranks on threads of its own), four non-blocking streams (one per
//! [`Stream`]), the plan's PTX module for the device's architecture (sm_90 for compute
//! capability 9 and above, sm_80 for 8.x; PTX is compiled by the driver for the device at
//! load), the kernels' entries looked up once. Launches use [`autotp_llvm::nvptx::BLOCK`]
//! threads and one block per row, or per run of a row for elementwise kernels over few rows
//! ([`autotp_llvm::nvptx::blocks_per_row`]), capped at [`autotp_llvm::nvptx::MAX_BLOCKS`]: the kernels stride over
//! the rest. The same module holds the builtin kernels' data movement and their gathers and
//! scatter-adds (the program's `gpu_kernels`, chosen when the plan was compiled).
//! Events are made per record (timing off) and released at each synchronisation. Allocations
//! are zeroed on the compute stream before anything else touches them.
//! GEMMs are cuBLAS's ([`GemmCall`], the entry by its [`GemmLayout`]: `gemmEx`,
//! `gemmStridedBatchedEx` or `gemmBatchedEx`) on a handle made on first use with
//! `CUBLAS_DEFAULT_MATH` (f32 stays f32: no TF32) or, for [`GemmMath::Tf32`],
//! `CUBLAS_TF32_TENSOR_OP_MATH`; without libcublas they run on the host.
//!
//! Collectives between GPUs are NCCL's (cudarc's `nccl::result`, loaded at run time when
//! `libnccl.so` is on the library path: pip's NCCL ships `libnccl.so.2`, so a `libnccl.so` link
//! is needed): communicators made with `ncclCommInitRank` from ids the ranks share through the
//! host communicator, calls enqueued on our streams, aborted with `ncclCommAbort` from any
//! thread. Rows moved for strided collectives are `cuMemcpy2DAsync` copies.
//!
//! Nothing here runs without [`crate::cuda::probe`] having found a driver first: cudarc's
//! loader panics when the library is missing.

use std::ffi::{c_void, CString};

use cudarc::driver::{result, sys};

use autotp_kernels::DType;

use super::collectives::{Copy2d, NcclCall};
use super::gemm::{GemmCall, GemmLayout};
use super::{Entry, GemmMath, GemmOperands, Gpu, GpuEvent, NcclAborter, NcclId, NcclReach};
use crate::streams::Stream;
use crate::RuntimeError;
use autotp_program::Program;

/// alpha and beta of the GEMMs, as host scalars of their compute type.
static ONE_F32: f32 = 1.0;
static ZERO_F32: f32 = 0.0;
static ONE_F64: f64 = 1.0;
static ZERO_F64: f64 = 0.0;

/// cuBLAS's workspace: what NVIDIA recommends for Hopper (32 MiB), more than enough for Ampere.
const CUBLAS_WORKSPACE_BYTES: usize = 32 << 20;

/// A host scalar's address, as cuBLAS's `Ex` entries take alpha and beta.
fn scalar<T>(value: &'static T) -> *const c_void {
    value as *const T as *const c_void
}

/// A CUDA GPU (see the module doc).
pub struct CudaGpu {
    device: sys::CUdevice,
    context: sys::CUcontext,
    streams: [sys::CUstream; Stream::ALL.len()],
    /// Host memory page-locked by [`Gpu::pin_host`], unregistered when the GPU is dropped.
    pinned: Vec<usize>,
    module: sys::CUmodule,
    kernels: Vec<sys::CUfunction>,
    /// Blocks per row of each kernel and movement kernel ([`autotp_llvm::nvptx::blocks_per_row`]).
    kernel_parts: Vec<usize>,
    movement_parts: Vec<usize>,
    optimizer_steps: Vec<sys::CUfunction>,
    /// The builtin kernels' data movement and their gathers and scatter-adds (the program's
    /// `gpu_kernels`), entries of `module`.
    movement: Vec<sys::CUfunction>,
    indexed: Vec<sys::CUfunction>,
    /// Fused attention's passes (`gpu_kernels.attention`), entries of `module`.
    attention: Vec<sys::CUfunction>,
    /// Captured graphs, instantiated (`CUgraphExec`).
    graphs: Vec<sys::CUgraphExec>,
    /// NCCL communicators joined, and whether an aborter aborted them (then they are freed).
    communicators: Vec<NcclComm>,
    aborted: std::sync::Arc<std::sync::atomic::AtomicBool>,
    /// `GpuKernels::axis`' entries.
    axis: Vec<sys::CUfunction>,
    /// `GpuKernels::grouped`' entries.
    grouped: Vec<sys::CUfunction>,
    allocations: Vec<sys::CUdeviceptr>,
    events: Vec<sys::CUevent>,
    /// cuBLAS's handle once asked for (`Some(None)`: the library is missing).
    blas: Option<Option<cudarc::cublas::sys::cublasHandle_t>>,
    math: GemmMath,
    /// The device's name and compute capability, for messages.
    pub description: String,
}

// SAFETY: the handles are the driver's, usable from any thread once the context is current
// (every method makes it current first); the executor uses the GPU from one thread at a time.
unsafe impl Send for CudaGpu {}

/// An NCCL communicator's handle, which any thread may abort.
#[derive(Clone, Copy)]
struct NcclComm(cudarc::nccl::sys::ncclComm_t);

// SAFETY: NCCL allows `ncclCommAbort` from another thread while calls wait on the communicator;
// nothing else is done with a handle off the GPU's thread.
unsafe impl Send for NcclComm {}
unsafe impl Sync for NcclComm {}

/// NCCL's element type for `dtype`; a gather moves the bytes of any.
fn nccl_type(dtype: DType, reduces: bool) -> Result<cudarc::nccl::sys::ncclDataType_t, RuntimeError> {
    use cudarc::nccl::sys::ncclDataType_t as T;
    Ok(match dtype {
        DType::F32 => T::ncclFloat32,
        DType::F64 => T::ncclFloat64,
        DType::F16 => T::ncclFloat16,
        DType::BF16 => T::ncclBfloat16,
        DType::I64 => T::ncclInt64,
        DType::I32 => T::ncclInt32,
        _ if !reduces => T::ncclUint8,
        other => return Err(RuntimeError::Device(format!("NCCL cannot sum {other} elements"))),
    })
}

/// `call`'s counts for NCCL: in elements, or bytes where a gather moves a type NCCL lacks.
fn nccl_count(count: usize, dtype: DType, nccl: cudarc::nccl::sys::ncclDataType_t) -> usize {
    match nccl {
        cudarc::nccl::sys::ncclDataType_t::ncclUint8 => count * dtype.size(),
        _ => count,
    }
}

fn driver(call: &str) -> impl Fn(result::DriverError) -> RuntimeError + '_ {
    move |e| RuntimeError::Device(format!("CUDA {call} failed: {e}"))
}

impl CudaGpu {
    /// Opens GPU `ordinal` and loads `program`'s kernels for it.
    pub fn open(ordinal: usize, program: &Program, math: GemmMath) -> Result<CudaGpu, RuntimeError> {
        let found = crate::cuda::probe()?;
        if ordinal >= found.devices {
            return Err(RuntimeError::Device(format!(
                "GPU {ordinal} does not exist: the driver sees {} GPU(s)",
                found.devices
            )));
        }
        result::init().map_err(driver("cuInit"))?;
        let device = result::device::get(ordinal as i32).map_err(driver("cuDeviceGet"))?;
        // SAFETY: `device` came from cuDeviceGet.
        let (major, minor) = unsafe {
            use sys::CUdevice_attribute::*;
            (
                result::device::get_attribute(device, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
                    .map_err(driver("cuDeviceGetAttribute"))?,
                result::device::get_attribute(device, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)
                    .map_err(driver("cuDeviceGetAttribute"))?,
            )
        };
        let name = result::device::get_name(device).map_err(driver("cuDeviceGetName"))?;
        let description = format!("GPU {ordinal} ({name}, compute capability {major}.{minor})");
        let arch = match major {
            9.. => "sm_90",
            8 => "sm_80",
            _ => {
                return Err(RuntimeError::Device(format!(
                    "{description}: autotp's kernels need compute capability 8.0 or newer"
                )))
            }
        };
        let ptx = program.ptx.iter().find(|m| m.arch == arch).ok_or_else(|| {
            RuntimeError::Device(format!(
                "{description}: the plan carries no PTX for {arch} (compile it with generated kernels)"
            ))
        })?;
        // SAFETY: `device` came from cuDeviceGet; the context is released in `drop`.
        let context = unsafe { result::primary_ctx::retain(device) }.map_err(driver("cuDevicePrimaryCtxRetain"))?;
        // SAFETY: a retained primary context.
        unsafe { result::ctx::set_current(context) }.map_err(driver("cuCtxSetCurrent"))?;
        let mut gpu = CudaGpu {
            device,
            context,
            streams: [std::ptr::null_mut(); Stream::ALL.len()],
            pinned: Vec::new(),
            module: std::ptr::null_mut(),
            kernels: Vec::new(),
            kernel_parts: program.kernels.iter().map(autotp_llvm::nvptx::blocks_per_row).collect(),
            movement_parts: Vec::new(),
            optimizer_steps: Vec::new(),
            movement: Vec::new(),
            indexed: Vec::new(),
            attention: Vec::new(),
            axis: Vec::new(),
            grouped: Vec::new(),
            graphs: Vec::new(),
            communicators: Vec::new(),
            aborted: Default::default(),
            allocations: Vec::new(),
            events: Vec::new(),
            blas: None,
            math,
            description,
        };
        for stream in &mut gpu.streams {
            *stream =
                result::stream::create(result::stream::StreamKind::NonBlocking).map_err(driver("cuStreamCreate"))?;
        }
        let image = CString::new(ptx.code.as_str())
            .map_err(|_| RuntimeError::Device(format!("the plan's {arch} PTX holds a NUL byte")))?;
        // SAFETY: a NUL-terminated PTX text, which the driver compiles for the device.
        gpu.module = unsafe { result::module::load_data(image.as_ptr() as *const c_void) }
            .map_err(driver("cuModuleLoadData (compiling the plan's PTX)"))?;
        let function = |module: sys::CUmodule, name: String| -> Result<sys::CUfunction, RuntimeError> {
            let symbol = CString::new(name.clone()).expect("entry names have no NUL");
            // SAFETY: a loaded module.
            unsafe { result::module::get_function(module, symbol) }
                .map_err(|e| RuntimeError::Device(format!("the plan's PTX lacks entry {name}: {e}")))
        };
        gpu.kernels = (0..program.kernels.len())
            .map(|i| function(gpu.module, autotp_llvm::nvptx::entry_name(i)))
            .collect::<Result<_, _>>()?;
        gpu.optimizer_steps = program
            .optimizer_kernels()
            .iter()
            .map(|k| function(gpu.module, k.entry_name()))
            .collect::<Result<_, _>>()?;
        let gpu_kernels = &program.gpu_kernels;
        gpu.movement_parts = gpu_kernels.movement.iter().map(autotp_llvm::nvptx::blocks_per_row).collect();
        gpu.movement = (0..gpu_kernels.movement.len())
            .map(|i| function(gpu.module, autotp_llvm::nvptx::movement_entry_name(i)))
            .collect::<Result<_, _>>()?;
        gpu.indexed = (0..gpu_kernels.indexed.len())
            .map(|i| function(gpu.module, autotp_llvm::indexed::entry_name(i)))
            .collect::<Result<_, _>>()?;
        gpu.attention = (0..gpu_kernels.attention.len())
            .map(|i| function(gpu.module, autotp_llvm::attention::entry_name(i)))
            .collect::<Result<_, _>>()?;
        gpu.axis = (0..gpu_kernels.axis.len())
            .map(|i| function(gpu.module, autotp_llvm::axis::entry_name(i)))
            .collect::<Result<_, _>>()?;
        gpu.grouped = (0..gpu_kernels.grouped.len())
            .map(|i| function(gpu.module, autotp_llvm::grouped::entry_name(i)))
            .collect::<Result<_, _>>()?;
        Ok(gpu)
    }

    /// cuBLAS's handle, made on first use in `self.math`'s mode (`CUBLAS_DEFAULT_MATH`, f32
    /// GEMMs in f32, unless `--tf32`); `None`, with one warning, where the library cannot be
    /// loaded.
    fn cublas(&mut self) -> Result<Option<cudarc::cublas::sys::cublasHandle_t>, RuntimeError> {
        use cudarc::cublas::sys as blas;
        if let Some(handle) = self.blas {
            return Ok(handle);
        }
        self.current()?;
        // SAFETY: a library probe (it loads nothing else and never panics).
        let handle = if unsafe { blas::is_culib_present() } {
            let handle = cudarc::cublas::result::create_handle()
                .map_err(|e| RuntimeError::Device(format!("cublasCreate: {e:?}")))?;
            let mode = match self.math {
                GemmMath::F32 => blas::cublasMath_t::CUBLAS_DEFAULT_MATH,
                GemmMath::Tf32 => blas::cublasMath_t::CUBLAS_TF32_TENSOR_OP_MATH,
            };
            // SAFETY: a fresh handle.
            unsafe { blas::cublasSetMathMode(handle, mode) }
                .result()
                .map_err(|e| RuntimeError::Device(format!("cublasSetMathMode: {e:?}")))?;
            // A workspace of our own, so that no GEMM allocates one later, inside a captured
            // graph (`--cuda-graph`), where allocating is not allowed.
            let workspace = self.alloc(CUBLAS_WORKSPACE_BYTES)?;
            // SAFETY: an allocation of this GPU, for the handle's life (the GPU's).
            unsafe { blas::cublasSetWorkspace_v2(handle, workspace as *mut c_void, CUBLAS_WORKSPACE_BYTES) }
                .result()
                .map_err(|e| RuntimeError::Device(format!("cublasSetWorkspace: {e:?}")))?;
            Some(handle)
        } else {
            tracing::warn!("cuBLAS (libcublas) could not be loaded: GEMMs run on the host");
            None
        };
        self.blas = Some(handle);
        Ok(handle)
    }

    fn current(&self) -> Result<(), RuntimeError> {
        // SAFETY: the context is retained until `drop`.
        unsafe { result::ctx::set_current(self.context) }.map_err(driver("cuCtxSetCurrent"))
    }

    fn stream(&self, stream: Stream) -> sys::CUstream {
        self.streams[stream as usize]
    }

    /// A new event made with `flags`, recorded on `stream` (kept until the next synchronisation).
    fn record_event(&mut self, stream: Stream, flags: sys::CUevent_flags) -> Result<GpuEvent, RuntimeError> {
        self.current()?;
        let event = result::event::create(flags).map_err(driver("cuEventCreate"))?;
        self.events.push(event);
        // SAFETY: a fresh event and one of this GPU's streams.
        unsafe { result::event::record(event, self.stream(stream)) }.map_err(driver("cuEventRecord"))?;
        Ok(GpuEvent(self.events.len() - 1))
    }
}

impl Gpu for CudaGpu {
    fn alloc(&mut self, bytes: usize) -> Result<u64, RuntimeError> {
        self.current()?;
        // The zeroing must be complete before anything writes the allocation. `cuMemsetD8`
        // (the legacy default stream) is asynchronous and does not order with our non-blocking
        // streams: it zeroed uploads made after it (seen on an H100 with a 16 GB arena, where
        // cuBLAS then read zeroed pointer arrays). So: zero on the compute stream and wait.
        // SAFETY: a fresh allocation of `bytes` (at least 1) on one of our streams.
        let address = unsafe {
            let address = result::malloc_sync(bytes.max(1)).map_err(|e| {
                RuntimeError::Device(format!("{}: cannot allocate {bytes} bytes: {e}", self.description))
            })?;
            let compute = self.stream(Stream::Compute);
            result::memset_d8_async(address, 0, bytes.max(1), compute).map_err(driver("cuMemsetD8Async"))?;
            result::stream::synchronize(compute).map_err(driver("cuStreamSynchronize"))?;
            address
        };
        self.allocations.push(address);
        Ok(address)
    }

    fn upload(&mut self, stream: Stream, address: u64, bytes: &[u8]) -> Result<(), RuntimeError> {
        self.current()?;
        // SAFETY: the caller's address lies in an allocation of this GPU. From pageable host
        // memory the driver stages the bytes before returning, so they may be reused at once;
        // from pinned memory the copy runs in the stream's order, as `Gpu::upload` says.
        unsafe { result::memcpy_htod_async(address, bytes, self.stream(stream)) }.map_err(driver("cuMemcpyHtoDAsync"))
    }

    fn pin_host(&mut self, address: usize, len: usize) -> Result<(), RuntimeError> {
        if len == 0 {
            return Ok(());
        }
        self.current()?;
        // SAFETY: host memory the caller keeps alive longer than this GPU, which unregisters it.
        unsafe { sys::cuMemHostRegister_v2(address as *mut c_void, len, 0) }
            .result()
            .map_err(driver("cuMemHostRegister"))?;
        self.pinned.push(address);
        Ok(())
    }

    fn download(&mut self, stream: Stream, address: u64, into: &mut [u8]) -> Result<(), RuntimeError> {
        self.current()?;
        // SAFETY: as `upload`; the stream is synchronised before `into` is read.
        unsafe {
            result::memcpy_dtoh_async(into, address, self.stream(stream)).map_err(driver("cuMemcpyDtoHAsync"))?;
            result::stream::synchronize(self.stream(stream)).map_err(driver("cuStreamSynchronize"))
        }
    }

    fn zero(&mut self, stream: Stream, address: u64, len: usize) -> Result<(), RuntimeError> {
        self.current()?;
        // SAFETY: the range lies in an allocation of this GPU.
        unsafe { result::memset_d8_async(address, 0, len, self.stream(stream)) }.map_err(driver("cuMemsetD8Async"))
    }

    fn copy(&mut self, stream: Stream, from: u64, to: u64, len: usize) -> Result<(), RuntimeError> {
        self.current()?;
        // SAFETY: both ranges lie in allocations of this GPU.
        unsafe { result::memcpy_dtod_async(to, from, len, self.stream(stream)) }.map_err(driver("cuMemcpyDtoDAsync"))
    }

    fn launch(&mut self, stream: Stream, entry: Entry, rows: usize, args: &[u64]) -> Result<(), RuntimeError> {
        if rows == 0 {
            return Ok(());
        }
        self.current()?;
        let (function, parts) = match entry {
            Entry::Kernel(i) => (self.kernels.get(i), self.kernel_parts.get(i)),
            Entry::OptimizerStep(i) => (self.optimizer_steps.get(i), Some(&1)),
            Entry::Movement(i) => (self.movement.get(i), self.movement_parts.get(i)),
            Entry::Indexed(i) => (self.indexed.get(i), Some(&1)),
            Entry::Attention(i) => (self.attention.get(i), Some(&1)),
            Entry::Axis(i) => (self.axis.get(i), Some(&1)),
            Entry::Grouped(i) => (self.grouped.get(i), Some(&1)),
        };
        let (function, parts) =
            function.zip(parts).ok_or_else(|| RuntimeError::Device(format!("the plan has no entry {entry:?}")))?;
        let (function, parts) = (*function, *parts);
        // Every parameter is 8 bytes: a device address, or (the chunk count) an i64.
        let mut values: Vec<u64> = args.to_vec();
        let mut params: Vec<*mut c_void> = values.iter_mut().map(|v| v as *mut u64 as *mut c_void).collect();
        let blocks = autotp_llvm::nvptx::launch_blocks(rows, parts) as u32;
        // SAFETY: the entry's parameters are `args.len()` pointers (or the i64 count), as
        // `autotp_llvm::nvptx` declares them; the addresses are a validated program's regions.
        unsafe {
            result::launch_kernel(
                function,
                (blocks, 1, 1),
                (autotp_llvm::nvptx::BLOCK, 1, 1),
                0,
                self.stream(stream),
                &mut params,
            )
        }
        .map_err(|e| RuntimeError::Device(format!("launching {entry:?} on {}: {e}", self.description)))
    }

    fn gemm(&mut self, stream: Stream, call: &GemmCall, operands: &GemmOperands) -> Result<bool, RuntimeError> {
        let Some(handle) = self.cublas()? else { return Ok(false) };
        self.current()?;
        use cudarc::cublas::sys as blas;
        let op = |transpose: bool| {
            if transpose {
                blas::cublasOperation_t::CUBLAS_OP_T
            } else {
                blas::cublasOperation_t::CUBLAS_OP_N
            }
        };
        let int = |v: usize| {
            i32::try_from(v).map_err(|_| RuntimeError::Device(format!("a GEMM dimension of {v} exceeds cuBLAS's int")))
        };
        let (m, n, k, lda, ldb, ldc) =
            (int(call.m)?, int(call.n)?, int(call.k)?, int(call.lda)?, int(call.ldb)?, int(call.ldc)?);
        let count = int(call.products.len())?;
        let (ty, compute, one, zero) = match call.dtype {
            DType::F32 => (
                blas::cudaDataType::CUDA_R_32F,
                blas::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                scalar(&ONE_F32),
                scalar(&ZERO_F32),
            ),
            DType::F64 => (
                blas::cudaDataType::CUDA_R_64F,
                blas::cublasComputeType_t::CUBLAS_COMPUTE_64F,
                scalar(&ONE_F64),
                scalar(&ZERO_F64),
            ),
            // Mixed precision: 16-bit operands, products summed in f32, rounded once.
            DType::BF16 => (
                blas::cudaDataType::CUDA_R_16BF,
                blas::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                scalar(&ONE_F32),
                scalar(&ZERO_F32),
            ),
            DType::F16 => (
                blas::cudaDataType::CUDA_R_16F,
                blas::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                scalar(&ONE_F32),
                scalar(&ZERO_F32),
            ),
            other => return Err(RuntimeError::Device(format!("cuBLAS GEMM of {other}"))),
        };
        let algorithm = blas::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT;
        let size = call.dtype.size() as u64;
        let first = |which: usize, base: u64| (base + call.products[0][which] as u64 * size) as *mut c_void;
        let (a, b, c) = (first(0, operands.rhs.0), first(1, operands.lhs.0), first(2, operands.out.0));
        let (ta, tb) = (op(call.transpose_a), op(call.transpose_b));
        let layout = call.layout();
        // SAFETY: the products lie inside the operands' regions, with the leading dimensions
        // `GemmCall::of` derived from the operands' strides (tested against the builtin kernel);
        // the first product's addresses and the uniform strides, or the pointer arrays made at
        // load, give every product; alpha and beta are host scalars of the compute type (the
        // default pointer mode).
        let status = unsafe {
            cudarc::cublas::result::set_stream(handle, self.stream(stream) as blas::cudaStream_t)
                .map_err(|e| RuntimeError::Device(format!("cublasSetStream: {e:?}")))?;
            match layout {
                GemmLayout::One => blas::cublasGemmEx(
                    handle, ta, tb, m, n, k, one, a, ty, lda, b, ty, ldb, zero, c, ty, ldc, compute, algorithm,
                ),
                GemmLayout::Strided([sa, sb, sc]) => blas::cublasGemmStridedBatchedEx(
                    handle, ta, tb, m, n, k, one, a, ty, lda, sa, b, ty, ldb, sb, zero, c, ty, ldc, sc, count, compute,
                    algorithm,
                ),
                GemmLayout::Pointers => {
                    let [a, b, c] = operands.pointers;
                    blas::cublasGemmBatchedEx(
                        handle,
                        ta,
                        tb,
                        m,
                        n,
                        k,
                        one,
                        a as *const *const c_void,
                        ty,
                        lda,
                        b as *const *const c_void,
                        ty,
                        ldb,
                        zero,
                        c as *const *mut c_void,
                        ty,
                        ldc,
                        count,
                        compute,
                        algorithm,
                    )
                }
            }
        };
        status
            .result()
            .map_err(|e| {
                RuntimeError::Device(format!(
                    "cuBLAS GEMM ({layout:?}, {} m {m} n {n} k {k}, op {}{}, ld {lda}/{ldb}/{ldc}, {count} products) on {}: {e:?}",
                    call.dtype,
                    if call.transpose_a { "T" } else { "N" },
                    if call.transpose_b { "T" } else { "N" },
                    self.description
                ))
            })?;
        Ok(true)
    }

    fn record(&mut self, stream: Stream) -> Result<GpuEvent, RuntimeError> {
        self.record_event(stream, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
    }

    fn record_timed(&mut self, stream: Stream) -> Result<GpuEvent, RuntimeError> {
        self.record_event(stream, sys::CUevent_flags::CU_EVENT_DEFAULT)
    }

    fn elapsed(&mut self, start: GpuEvent, end: GpuEvent) -> Result<std::time::Duration, RuntimeError> {
        self.current()?;
        let event = |e: GpuEvent| {
            self.events.get(e.0).copied().ok_or_else(|| RuntimeError::Device(format!("no CUDA event {}", e.0)))
        };
        let (start, end) = (event(start)?, event(end)?);
        // SAFETY: recorded timed events, kept until the next synchronisation.
        let milliseconds = unsafe {
            result::event::synchronize(end).map_err(driver("cuEventSynchronize"))?;
            result::event::elapsed(start, end).map_err(driver("cuEventElapsedTime"))?
        };
        Ok(std::time::Duration::from_secs_f64(f64::from(milliseconds.max(0.0)) * 1e-3))
    }

    fn wait(&mut self, stream: Stream, event: GpuEvent) -> Result<(), RuntimeError> {
        self.current()?;
        let event =
            *self.events.get(event.0).ok_or_else(|| RuntimeError::Device(format!("no CUDA event {}", event.0)))?;
        // SAFETY: a recorded event (kept until the next synchronisation) and one of our streams.
        unsafe {
            result::stream::wait_event(self.stream(stream), event, sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT)
        }
        .map_err(driver("cuStreamWaitEvent"))
    }

    fn synchronize(&mut self) -> Result<(), RuntimeError> {
        self.current()?;
        for stream in Stream::ALL {
            // SAFETY: one of our streams.
            unsafe { result::stream::synchronize(self.stream(stream)) }.map_err(|e| {
                RuntimeError::Device(format!("{}: the {} stream failed: {e}", self.description, stream.name()))
            })?;
        }
        for event in self.events.drain(..) {
            // SAFETY: complete (its stream is synchronised) and never used again.
            let _ = unsafe { result::event::destroy(event) };
        }
        Ok(())
    }

    fn memory(&mut self) -> Result<(usize, usize), RuntimeError> {
        self.current()?;
        result::mem_get_info().map_err(driver("cuMemGetInfo"))
    }

    fn copy_2d(&mut self, stream: Stream, copy: &Copy2d) -> Result<(), RuntimeError> {
        if copy.rows == 0 || copy.width == 0 {
            return Ok(());
        }
        self.current()?;
        let device = sys::CUmemorytype::CU_MEMORYTYPE_DEVICE;
        let parameters = sys::CUDA_MEMCPY2D {
            srcXInBytes: 0,
            srcY: 0,
            srcMemoryType: device,
            srcHost: std::ptr::null(),
            srcDevice: copy.from,
            srcArray: std::ptr::null_mut(),
            srcPitch: copy.from_pitch,
            dstXInBytes: 0,
            dstY: 0,
            dstMemoryType: device,
            dstHost: std::ptr::null_mut(),
            dstDevice: copy.to,
            dstArray: std::ptr::null_mut(),
            dstPitch: copy.to_pitch,
            WidthInBytes: copy.width,
            Height: copy.rows,
        };
        // SAFETY: both ranges lie in allocations of this GPU (the program's validated regions).
        unsafe { sys::cuMemcpy2DAsync_v2(&parameters, self.stream(stream)) }.result().map_err(driver("cuMemcpy2DAsync"))
    }

    fn nccl_reach(&mut self) -> NcclReach {
        // SAFETY: a library probe (it loads nothing else and never panics).
        match unsafe { cudarc::nccl::sys::is_culib_present() } {
            true => NcclReach::Anywhere,
            false => NcclReach::Unavailable,
        }
    }

    fn device_uuid(&mut self) -> Result<[u8; 16], RuntimeError> {
        let mut uuid = sys::CUuuid { bytes: [0; 16] };
        // SAFETY: a device of this driver.
        unsafe { sys::cuDeviceGetUuid_v2(&mut uuid, self.device) }.result().map_err(driver("cuDeviceGetUuid"))?;
        Ok(uuid.bytes.map(|b| b as u8))
    }

    fn nccl_id(&mut self) -> Result<NcclId, RuntimeError> {
        let id =
            cudarc::nccl::result::get_uniqueid().map_err(|e| RuntimeError::Comm(format!("ncclGetUniqueId: {e:?}")))?;
        Ok(id.internal.map(|b| b as u8))
    }

    fn nccl_join(&mut self, id: &NcclId, ranks: usize, rank: usize) -> Result<usize, RuntimeError> {
        self.current()?;
        let id = cudarc::nccl::sys::ncclUniqueId { internal: id.map(|b| b as std::ffi::c_char) };
        let mut comm = std::ptr::null_mut();
        // SAFETY: every rank of the communicator calls this with the same id, on its own device.
        unsafe { cudarc::nccl::result::comm_init_rank(&mut comm, ranks as i32, id, rank as i32) }
            .map_err(|e| RuntimeError::Comm(format!("ncclCommInitRank (rank {rank} of {ranks}): {e:?}")))?;
        self.communicators.push(NcclComm(comm));
        Ok(self.communicators.len() - 1)
    }

    fn nccl(&mut self, stream: Stream, comm: usize, call: &NcclCall) -> Result<(), RuntimeError> {
        use cudarc::nccl::result as nccl;
        use cudarc::nccl::sys::{ncclDataType_t::ncclUint8, ncclRedOp_t::ncclSum};
        self.current()?;
        let NcclComm(handle) = *(self.communicators.get(comm))
            .ok_or_else(|| RuntimeError::Device(format!("no NCCL communicator {comm}")))?;
        let on = self.stream(stream) as cudarc::nccl::sys::cudaStream_t;
        let pointer = |address: u64| address as *mut c_void;
        // SAFETY: the buffers are the program's regions (and scratch) on this device; every
        // rank issues the same calls in the same order on the communicator.
        let issued = unsafe {
            match *call {
                NcclCall::AllReduce { send, recv, count, dtype } => {
                    let ty = nccl_type(dtype, true)?;
                    nccl::all_reduce(pointer(send), pointer(recv), count, ty, ncclSum, handle, on)
                }
                NcclCall::AllGather { send, recv, count, dtype } => {
                    let ty = nccl_type(dtype, false)?;
                    nccl::all_gather(pointer(send), pointer(recv), nccl_count(count, dtype, ty), ty, handle, on)
                }
                NcclCall::ReduceScatter { send, recv, count, dtype } => {
                    let ty = nccl_type(dtype, true)?;
                    nccl::reduce_scatter(pointer(send), pointer(recv), count, ty, ncclSum, handle, on)
                }
                NcclCall::AllToAll { send, recv, count, dtype } => {
                    let ty = nccl_type(dtype, false)?;
                    let (count, piece) = (nccl_count(count, dtype, ty), (count * dtype.size()) as u64);
                    let ranks =
                        nccl::comm_count(handle).map_err(|e| RuntimeError::Comm(format!("ncclCommCount: {e:?}")))?;
                    nccl::group_start().map_err(|e| RuntimeError::Comm(format!("ncclGroupStart: {e:?}")))?;
                    let mut issued = Ok(cudarc::nccl::result::NcclStatus::Success);
                    for peer in 0..ranks {
                        let at = peer as u64 * piece;
                        issued = nccl::send(pointer(send + at), count, ty, peer, handle, on)
                            .and_then(|_| nccl::recv(pointer(recv + at), count, ty, peer, handle, on));
                        if issued.is_err() {
                            break;
                        }
                    }
                    // The group is closed whatever happened inside it.
                    let ended = nccl::group_end();
                    issued.and(ended)
                }
                NcclCall::RingShift { send, recv, count, dtype, next, previous } => {
                    let ty = nccl_type(dtype, false)?;
                    let count = nccl_count(count, dtype, ty);
                    nccl::group_start().map_err(|e| RuntimeError::Comm(format!("ncclGroupStart: {e:?}")))?;
                    let issued = nccl::send(pointer(send), count, ty, next as i32, handle, on)
                        .and_then(|_| nccl::recv(pointer(recv), count, ty, previous as i32, handle, on));
                    // The group is closed whatever happened inside it.
                    let ended = nccl::group_end();
                    issued.and(ended)
                }
                NcclCall::Send { send, bytes, peer } => {
                    nccl::send(pointer(send), bytes, ncclUint8, peer as i32, handle, on)
                }
                NcclCall::Recv { recv, bytes, peer } => {
                    nccl::recv(pointer(recv), bytes, ncclUint8, peer as i32, handle, on)
                }
            }
        };
        issued.map(|_| ()).map_err(|e| RuntimeError::Comm(format!("NCCL {call:?}: {e:?}")))
    }

    fn begin_capture(&mut self) -> Result<(), RuntimeError> {
        self.current()?;
        // Relaxed: other ranks' threads may allocate or synchronise meanwhile.
        let mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
        // SAFETY: one of our streams, not capturing.
        unsafe { sys::cuStreamBeginCapture_v2(self.stream(Stream::Compute), mode) }
            .result()
            .map_err(driver("cuStreamBeginCapture"))
    }

    fn end_capture(&mut self) -> Result<usize, RuntimeError> {
        self.current()?;
        // The streams that joined the capture (by waiting on its events) join back.
        for stream in [Stream::Collectives, Stream::Peer, Stream::Transfer] {
            let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
            // SAFETY: one of our streams.
            unsafe { sys::cuStreamIsCapturing(self.stream(stream), &mut status) }
                .result()
                .map_err(driver("cuStreamIsCapturing"))?;
            if status == sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE {
                let event = self.record(stream)?;
                self.wait(Stream::Compute, event)?;
            }
        }
        let mut graph = std::ptr::null_mut();
        let mut exec = std::ptr::null_mut();
        // SAFETY: the capture this GPU began; the graph is freed once instantiated.
        unsafe {
            sys::cuStreamEndCapture(self.stream(Stream::Compute), &mut graph)
                .result()
                .map_err(driver("cuStreamEndCapture"))?;
            let instantiated = sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0).result();
            let _ = sys::cuGraphDestroy(graph);
            instantiated.map_err(driver("cuGraphInstantiate"))?;
        }
        self.graphs.push(exec);
        Ok(self.graphs.len() - 1)
    }

    fn replay(&mut self, graph: usize) -> Result<(), RuntimeError> {
        self.current()?;
        let exec = *self.graphs.get(graph).ok_or_else(|| RuntimeError::Device(format!("no CUDA graph {graph}")))?;
        // SAFETY: an instantiated graph of this GPU, over its allocations.
        unsafe { sys::cuGraphLaunch(exec, self.stream(Stream::Compute)) }.result().map_err(driver("cuGraphLaunch"))
    }

    fn nccl_aborter(&mut self) -> NcclAborter {
        let (communicators, aborted) = (self.communicators.clone(), self.aborted.clone());
        Box::new(move || {
            if aborted.swap(true, std::sync::atomic::Ordering::SeqCst) {
                return;
            }
            for NcclComm(handle) in &communicators {
                // SAFETY: a communicator this GPU joined; NCCL allows aborting from any thread.
                let _ = unsafe { cudarc::nccl::result::comm_abort(*handle) };
            }
        })
    }
}

impl Drop for CudaGpu {
    fn drop(&mut self) {
        if self.current().is_err() {
            return;
        }
        let _ = self.synchronize();
        // SAFETY: every handle was made by this GPU and is released once.
        unsafe {
            if let Some(Some(handle)) = self.blas.take() {
                let _ = cudarc::cublas::result::destroy_handle(handle);
            }
            for exec in self.graphs.drain(..) {
                let _ = sys::cuGraphExecDestroy(exec);
            }
            let aborted = self.aborted.load(std::sync::atomic::Ordering::SeqCst);
            for NcclComm(handle) in self.communicators.drain(..).filter(|_| !aborted) {
                let _ = cudarc::nccl::result::comm_destroy(handle);
            }
            for address in self.allocations.drain(..) {
                let _ = result::free_sync(address);
            }
            for address in self.pinned.drain(..) {
                let _ = sys::cuMemHostUnregister(address as *mut c_void);
            }
            if !self.module.is_null() {
                let _ = result::module::unload(self.module);
            }
            for stream in self.streams {
                if !stream.is_null() {
                    let _ = result::stream::destroy(stream);
                }
            }
            let _ = result::primary_ctx::release(self.device);
        }
    }
}
