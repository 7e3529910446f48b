//! CUDA GPUs: finding the driver and its GPUs without linking anything of CUDA.
//!
//! The `autotp` binary starts on machines without CUDA, so the driver (`libcuda.so.1`) is
//! opened at run time with `dlopen`, and the three calls a probe needs (`cuInit`,
//! `cuDriverGetVersion`, `cuDeviceGetCount`) are looked up with `dlsym`. cudarc's own probe
//! (`is_culib_present`) goes through the loader that panics when the library is missing, so
//! nothing of cudarc may run before [`probe`] has succeeded.
//!
//! Every CUDA path starts here: without a driver it fails with one line naming the library
//! (`no CUDA driver found: libcuda.so.1 could not be loaded (...)`), never a panic.

use std::ffi::{c_int, c_void, CStr, CString};

use crate::RuntimeError;

/// The driver library every CUDA installation provides (the unversioned name is a development
/// symlink); `AUTOTP_CUDA_DRIVER` names another.
const DRIVER_LIBRARY: &str = "libcuda.so.1";

fn driver_library() -> String {
    std::env::var("AUTOTP_CUDA_DRIVER").unwrap_or_else(|_| DRIVER_LIBRARY.to_string())
}

/// What the probe found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CudaDriver {
    /// The CUDA version the driver supports, as the driver encodes it (13000 = 13.0).
    pub version: i32,
    /// GPUs visible to this process (after `CUDA_VISIBLE_DEVICES`).
    pub devices: usize,
}

impl CudaDriver {
    /// `13.0` for version 13000.
    pub fn version_name(&self) -> String {
        format!("{}.{}", self.version / 1000, self.version % 1000 / 10)
    }
}

/// Where a plan runs: `--device cpu|cuda`.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub enum DeviceKind {
    #[default]
    Cpu,
    Cuda,
}

impl DeviceKind {
    pub fn parse(name: &str) -> Option<DeviceKind> {
        match name {
            "cpu" => Some(DeviceKind::Cpu),
            "cuda" => Some(DeviceKind::Cuda),
            _ => None,
        }
    }
}

/// Loads the driver (once per process; the library stays loaded) and counts its GPUs.
pub fn probe() -> Result<CudaDriver, RuntimeError> {
    let library = driver_library();
    let no_driver =
        |why: String| RuntimeError::Device(format!("no CUDA driver found: {library} could not be loaded ({why})"));
    let name = CString::new(library.as_str()).map_err(|_| no_driver("the name holds a NUL byte".into()))?;
    // SAFETY: loading the driver runs its initialisers, which have no preconditions.
    let handle = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    if handle.is_null() {
        return Err(no_driver(last_dl_error()));
    }
    let symbol = |name: &str| -> Result<*mut c_void, RuntimeError> {
        let c_name = CString::new(name).expect("no NUL in symbol names");
        // SAFETY: `handle` is an open library; dlsym only reads it.
        let address = unsafe { libc::dlsym(handle, c_name.as_ptr()) };
        match address.is_null() {
            true => Err(RuntimeError::Device(format!("{library} lacks {name}: it is not NVIDIA's CUDA driver"))),
            false => Ok(address),
        }
    };
    type Init = unsafe extern "C" fn(u32) -> c_int;
    type GetInt = unsafe extern "C" fn(*mut c_int) -> c_int;
    // SAFETY: these are the driver API's functions of these names (cuda.h): `CUresult
    // cuInit(unsigned int)`, `CUresult cuDriverGetVersion(int*)`, `CUresult
    // cuDeviceGetCount(int*)`.
    let (init, driver_version, device_count) = unsafe {
        (
            std::mem::transmute::<*mut c_void, Init>(symbol("cuInit")?),
            std::mem::transmute::<*mut c_void, GetInt>(symbol("cuDriverGetVersion")?),
            std::mem::transmute::<*mut c_void, GetInt>(symbol("cuDeviceGetCount")?),
        )
    };
    let mut version: c_int = 0;
    let mut devices: c_int = 0;
    // SAFETY: the functions write one int each through valid pointers.
    unsafe {
        check(driver_version(&mut version), "cuDriverGetVersion")?;
        check(init(0), "cuInit")?;
        check(device_count(&mut devices), "cuDeviceGetCount")?;
    }
    if devices <= 0 {
        return Err(RuntimeError::Device(format!(
            "the CUDA driver ({library}) sees no GPU (CUDA_VISIBLE_DEVICES={})",
            std::env::var("CUDA_VISIBLE_DEVICES").unwrap_or_else(|_| "unset".into())
        )));
    }
    Ok(CudaDriver { version, devices: devices as usize })
}

/// A driver call's result as an error naming the call and the driver's code.
fn check(code: c_int, call: &str) -> Result<(), RuntimeError> {
    match code {
        0 => Ok(()),
        // CUDA_ERROR_NO_DEVICE: the driver is installed, the GPUs are not visible.
        100 => Err(RuntimeError::Device(format!("{call} found no CUDA GPU (CUDA_ERROR_NO_DEVICE)"))),
        code => Err(RuntimeError::Device(format!("{call} failed with CUDA error {code}"))),
    }
}

/// The loader's message for the last failed `dlopen`.
fn last_dl_error() -> String {
    // SAFETY: dlerror returns the last error as a NUL-terminated string, or null.
    let error = unsafe { libc::dlerror() };
    match error.is_null() {
        true => "no reason given".into(),
        false => unsafe { CStr::from_ptr(error) }.to_string_lossy().into_owned(),
    }
}
