//! The process-wide JIT: LLVM's ORC LLJIT (thread-safe, owned by this module for the life of the
//! process), fed object files that [`crate::cpu`] makes, and an on-disk cache of those files.
//!
//! A kernel is known by a SHA-256 of its description (its name aside), the host target and this
//! code generator's sources (`build.rs` hashes them); a kernel compiled once in a process is reused by every later plan, and the
//! kernels a plan still needs are compiled together into one object file, stored under
//! `$AUTOTP_KERNEL_CACHE` (default `$XDG_CACHE_HOME/autotp/kernels`, else
//! `~/.cache/autotp/kernels`; `off` disables it) by the SHA-256 of their keys. A plan loaded
//! again finds that file and skips LLVM's optimiser and code generator.

use std::collections::HashMap;
use std::ffi::{CStr, CString};
use std::path::PathBuf;
use std::sync::{Mutex, OnceLock};

use inkwell::llvm_sys::error::{LLVMDisposeErrorMessage, LLVMErrorRef, LLVMGetErrorMessage};
use inkwell::llvm_sys::orc2::lljit::{
    LLVMOrcCreateLLJIT, LLVMOrcCreateLLJITBuilder, LLVMOrcLLJITAddObjectFile, LLVMOrcLLJITGetGlobalPrefix,
    LLVMOrcLLJITGetMainJITDylib, LLVMOrcLLJITLookup, LLVMOrcLLJITRef,
};
use inkwell::llvm_sys::orc2::{
    LLVMOrcCreateDynamicLibrarySearchGeneratorForProcess, LLVMOrcDefinitionGeneratorRef, LLVMOrcExecutorAddress,
    LLVMOrcJITDylibAddGenerator,
};
use sha2::{Digest, Sha256};

use crate::cpu::{object_code, CpuKernel, HostTarget, KernelFn};
use crate::{Function, LlvmError};

struct Jit {
    lljit: LLVMOrcLLJITRef,
    target: HostTarget,
    /// Entry points by kernel key.
    loaded: HashMap<String, KernelFn>,
}

// SAFETY: LLJIT is thread-safe; the lock around `Jit` serialises our use of it anyway.
unsafe impl Send for Jit {}

static JIT: OnceLock<Mutex<Result<Jit, String>>> = OnceLock::new();

fn take_error(error: LLVMErrorRef) -> Result<(), String> {
    if error.is_null() {
        return Ok(());
    }
    // SAFETY: a non-null LLVMErrorRef is consumed exactly once by LLVMGetErrorMessage.
    unsafe {
        let message = LLVMGetErrorMessage(error);
        let text = CStr::from_ptr(message).to_string_lossy().into_owned();
        LLVMDisposeErrorMessage(message);
        Err(text)
    }
}

impl Jit {
    fn start() -> Result<Jit, String> {
        let target = HostTarget::detect().map_err(|e| e.to_string())?;
        let mut lljit: LLVMOrcLLJITRef = std::ptr::null_mut();
        // SAFETY: the builder is consumed by LLVMOrcCreateLLJIT; the generator lets objects
        // resolve symbols of this process (the optimiser may call memcpy or memset).
        unsafe {
            take_error(LLVMOrcCreateLLJIT(&mut lljit, LLVMOrcCreateLLJITBuilder()))?;
            let mut generator: LLVMOrcDefinitionGeneratorRef = std::ptr::null_mut();
            take_error(LLVMOrcCreateDynamicLibrarySearchGeneratorForProcess(
                &mut generator,
                LLVMOrcLLJITGetGlobalPrefix(lljit),
                None,
                std::ptr::null_mut(),
            ))?;
            LLVMOrcJITDylibAddGenerator(LLVMOrcLLJITGetMainJITDylib(lljit), generator);
        }
        Ok(Jit { lljit, target, loaded: HashMap::new() })
    }

    fn add_object(&mut self, object: &[u8]) -> Result<(), String> {
        use inkwell::llvm_sys::core::LLVMCreateMemoryBufferWithMemoryRangeCopy;
        let name = CString::new("autotp_kernels").expect("no NUL");
        // SAFETY: the buffer copies `object`; LLJIT takes ownership of it.
        unsafe {
            let buffer =
                LLVMCreateMemoryBufferWithMemoryRangeCopy(object.as_ptr() as *const _, object.len(), name.as_ptr());
            take_error(LLVMOrcLLJITAddObjectFile(self.lljit, LLVMOrcLLJITGetMainJITDylib(self.lljit), buffer))
        }
    }

    fn lookup(&self, symbol: &str) -> Result<KernelFn, String> {
        let name = CString::new(symbol).map_err(|e| e.to_string())?;
        let mut address: LLVMOrcExecutorAddress = 0;
        // SAFETY: looks up a symbol this JIT defined; the address is that function's code,
        // which the JIT keeps for the life of the process.
        unsafe {
            take_error(LLVMOrcLLJITLookup(self.lljit, &mut address, name.as_ptr()))?;
            if address == 0 {
                return Err(format!("symbol {symbol} resolved to null"));
            }
            Ok(std::mem::transmute::<usize, KernelFn>(address as usize))
        }
    }

    fn key(&self, function: Function) -> String {
        let mut hash = Sha256::new();
        let description = match function {
            Function::Kernel(kernel) => {
                let mut unnamed = kernel.clone();
                unnamed.name.clear();
                serde_json::to_vec(&Function::Kernel(&unnamed))
            }
            Function::OptimizerStep(_)
            | Function::Attention(_)
            | Function::Axis(_)
            | Function::Grouped(_)
            | Function::SimulatedKernel(_)
            | Function::SimulatedAttention(_) => serde_json::to_vec(&function),
        };
        hash.update(description.expect("kernels serialise"));
        hash.update(self.target.description.as_bytes());
        hash.update(env!("AUTOTP_CODEGEN_HASH").as_bytes());
        hex(&hash.finalize())
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn cache_dir() -> Option<PathBuf> {
    match std::env::var_os("AUTOTP_KERNEL_CACHE") {
        Some(dir) if dir == "off" => None,
        Some(dir) => Some(PathBuf::from(dir)),
        None => {
            let base = std::env::var_os("XDG_CACHE_HOME")
                .map(PathBuf::from)
                .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
            Some(base.join("autotp").join("kernels"))
        }
    }
}

/// Writes `bytes` to `path` through a temporary sibling and a rename, so a reader never sees a
/// partial file. Failures only cost the cache entry.
fn store(path: &std::path::Path, bytes: &[u8]) {
    let Some(dir) = path.parent() else { return };
    if std::fs::create_dir_all(dir).is_err() {
        return;
    }
    let staging =
        dir.join(format!(".{}.{}", path.file_name().unwrap_or_default().to_string_lossy(), std::process::id()));
    if std::fs::write(&staging, bytes).is_ok() && std::fs::rename(&staging, path).is_err() {
        let _ = std::fs::remove_file(&staging);
    }
}

/// See [`crate::compile_cpu`].
pub(crate) fn compile(functions: &[Function]) -> Result<Vec<CpuKernel>, LlvmError> {
    let jit = JIT.get_or_init(|| Mutex::new(Jit::start()));
    let mut guard = jit.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let jit = guard.as_mut().map_err(|e| LlvmError::llvm("JIT start", e.clone()))?;
    let keys: Vec<String> = functions.iter().map(|f| jit.key(*f)).collect();
    let mut missing: Vec<(String, Function)> = Vec::new();
    for (key, function) in keys.iter().zip(functions) {
        if let Function::Kernel(kernel) = function {
            kernel.check()?;
        }
        if !jit.loaded.contains_key(key) && !missing.iter().any(|(k, _)| k == key) {
            missing.push((key.clone(), *function));
        }
    }
    if !missing.is_empty() {
        let symbols: Vec<(String, Function)> = missing.iter().map(|(key, f)| (symbol(key), *f)).collect();
        let mut batch = Sha256::new();
        for (key, _) in &missing {
            batch.update(key.as_bytes());
        }
        let path = cache_dir().map(|dir| dir.join(format!("{}.o", hex(&batch.finalize()))));
        let cached = path.as_ref().and_then(|p| std::fs::read(p).ok());
        let started = std::time::Instant::now();
        let object = match cached {
            Some(object) => {
                tracing::debug!(kernels = symbols.len(), bytes = object.len(), "kernels from the disk cache");
                object
            }
            None => {
                let object = object_code(&symbols, &jit.target)?;
                tracing::debug!(
                    kernels = symbols.len(),
                    bytes = object.len(),
                    seconds = started.elapsed().as_secs_f64(),
                    "compiled kernels for this CPU"
                );
                if let Some(path) = &path {
                    store(path, &object);
                }
                object
            }
        };
        jit.add_object(&object).map_err(|e| LlvmError::llvm("JIT loading", e))?;
        for (key, _) in &missing {
            let function = jit.lookup(&symbol(key)).map_err(|e| LlvmError::llvm("JIT lookup", e))?;
            jit.loaded.insert(key.clone(), function);
        }
        tracing::debug!(kernels = symbols.len(), seconds = started.elapsed().as_secs_f64(), "kernels loaded");
    }
    Ok(keys.iter().map(|key| CpuKernel { function: jit.loaded[key] }).collect())
}

fn symbol(key: &str) -> String {
    format!("autotp_kernel_{}", &key[..24])
}
