//! Open MPI's C library, loaded when a run needs it (`dlopen`), so that the `autotp` binary
//! starts on a machine without MPI and links nothing of it.
//!
//! Why not a binding crate: rsmpi (`mpi`) and ferrompi link `libmpi` into the binary, which
//! then does not start where MPI is missing, and rsmpi's non-blocking API ties requests to
//! scopes the executor's communication thread cannot hold. The backend needs 15 functions of
//! the C interface, declared here with their C types, the way CTranslate2's MPI stub loads
//! them.
//!
//! ABI: Open MPI's (libmpi.so.40: Open MPI 3, 4 and 5). Its handles (`MPI_Comm`,
//! `MPI_Datatype`, `MPI_Op`) are pointers, and its predefined handles are the addresses of
//! global objects the library exports (`MPI_COMM_WORLD` is `&ompi_mpi_comm_world`), read here
//! with `dlsym`. MPICH's ABI (integer handles) is not supported: loading its library is refused
//! by name. The library is opened with `RTLD_GLOBAL`, which Open MPI's own plugins need.

use std::ffi::{c_char, c_int, c_void, CStr, CString};

/// An Open MPI handle: a communicator, datatype, operation or request.
pub type Handle = *mut c_void;

/// Open MPI's `MPI_Status`.
#[repr(C)]
#[derive(Default)]
pub struct Status {
    pub source: c_int,
    pub tag: c_int,
    pub error: c_int,
    cancelled: c_int,
    ucount: usize,
}

pub const THREAD_MULTIPLE: c_int = 3;
pub const COMM_TYPE_SHARED: c_int = 0;
pub const SUCCESS: c_int = 0;

/// The library names tried in order; `AUTOTP_MPI_LIBRARY` names another.
const LIBRARY_NAMES: [&str; 2] = ["libmpi.so.40", "libmpi.so"];

#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error(
        "cannot load Open MPI's library ({tried}): {reason}; install Open MPI (Debian: apt-get install openmpi-bin) \
         or name the library with AUTOTP_MPI_LIBRARY"
    )]
    NotFound { tried: String, reason: String },
    #[error("{library} lacks the symbol {symbol}: it is not Open MPI's libmpi (MPICH and others are not supported)")]
    MissingSymbol { library: String, symbol: &'static str },
}

macro_rules! functions {
    ($($name:ident : fn($($arg:ty),*);)*) => {
        /// The loaded library's functions (each returns an MPI error code) and predefined
        /// handles.
        #[allow(non_snake_case)]
        pub struct MpiLibrary {
            $(pub $name: unsafe extern "C" fn($($arg),*) -> c_int,)*
            pub comm_world: Handle,
            pub byte: Handle,
            pub float: Handle,
            pub double: Handle,
            pub int64: Handle,
            pub op_sum: Handle,
            pub info_null: Handle,
        }

        impl MpiLibrary {
            /// Opens the library and reads every symbol the backend uses.
            pub fn load() -> Result<MpiLibrary, LoadError> {
                let (library, handle) = open()?;
                let symbol = |name: &'static str| -> Result<*mut c_void, LoadError> {
                    let c_name = CString::new(name).expect("no NUL in symbol names");
                    // SAFETY: `handle` is an open library; dlsym only reads it.
                    let address = unsafe { libc::dlsym(handle, c_name.as_ptr()) };
                    if address.is_null() {
                        return Err(LoadError::MissingSymbol { library: library.clone(), symbol: name });
                    }
                    Ok(address)
                };
                Ok(MpiLibrary {
                    // SAFETY: each symbol is the C function of that name in the MPI standard,
                    // with the signature declared here (Open MPI's mpi.h).
                    $($name: unsafe { std::mem::transmute::<*mut c_void, unsafe extern "C" fn($($arg),*) -> c_int>(symbol(stringify!($name))?) },)*
                    comm_world: symbol("ompi_mpi_comm_world")?,
                    byte: symbol("ompi_mpi_byte")?,
                    float: symbol("ompi_mpi_float")?,
                    double: symbol("ompi_mpi_double")?,
                    int64: symbol("ompi_mpi_int64_t")?,
                    op_sum: symbol("ompi_mpi_op_sum")?,
                    info_null: symbol("ompi_mpi_info_null")?,
                })
            }
        }
    };
}

functions! {
    MPI_Initialized: fn(*mut c_int);
    MPI_Init_thread: fn(*mut c_int, *mut *mut *mut c_char, c_int, *mut c_int);
    MPI_Finalize: fn();
    MPI_Abort: fn(Handle, c_int);
    MPI_Comm_rank: fn(Handle, *mut c_int);
    MPI_Comm_size: fn(Handle, *mut c_int);
    MPI_Comm_split: fn(Handle, c_int, c_int, *mut Handle);
    MPI_Comm_split_type: fn(Handle, c_int, c_int, Handle, *mut Handle);
    MPI_Allreduce: fn(*const c_void, *mut c_void, c_int, Handle, Handle, Handle);
    MPI_Iallreduce: fn(*const c_void, *mut c_void, c_int, Handle, Handle, Handle, *mut Handle);
    MPI_Test: fn(*mut Handle, *mut c_int, *mut Status);
    MPI_Allgather: fn(*const c_void, c_int, Handle, *mut c_void, c_int, Handle, Handle);
    MPI_Alltoall: fn(*const c_void, c_int, Handle, *mut c_void, c_int, Handle, Handle);
    MPI_Alltoallv: fn(*const c_void, *const c_int, *const c_int, Handle, *mut c_void, *const c_int, *const c_int, Handle, Handle);
    MPI_Bcast: fn(*mut c_void, c_int, Handle, c_int, Handle);
    MPI_Barrier: fn(Handle);
    MPI_Isend: fn(*const c_void, c_int, Handle, c_int, c_int, Handle, *mut Handle);
    MPI_Recv: fn(*mut c_void, c_int, Handle, c_int, c_int, Handle, *mut Status);
    MPI_Testall: fn(c_int, *mut Handle, *mut c_int, *mut Status);
    MPI_Waitall: fn(c_int, *mut Handle, *mut Status);
    MPI_Error_string: fn(c_int, *mut c_char, *mut c_int);
}

// SAFETY: the struct holds function pointers and the addresses of the library's predefined
// objects, which never change; MPI is initialised with MPI_THREAD_MULTIPLE before any call
// from several threads.
unsafe impl Send for MpiLibrary {}
unsafe impl Sync for MpiLibrary {}

impl MpiLibrary {
    /// The library's text for an error code.
    pub fn error_string(&self, code: c_int) -> String {
        let mut text = vec![0 as c_char; 1024];
        let mut len: c_int = 0;
        // SAFETY: Open MPI writes at most MPI_MAX_ERROR_STRING (256) bytes with the NUL.
        let rc = unsafe { (self.MPI_Error_string)(code, text.as_mut_ptr(), &mut len) };
        if rc != SUCCESS {
            return format!("MPI error {code}");
        }
        // SAFETY: the library wrote a NUL-terminated string.
        unsafe { CStr::from_ptr(text.as_ptr()) }.to_string_lossy().into_owned()
    }
}

/// Opens the first library name that loads, with `RTLD_NOW | RTLD_GLOBAL`.
fn open() -> Result<(String, *mut c_void), LoadError> {
    let names: Vec<String> = match std::env::var("AUTOTP_MPI_LIBRARY") {
        Ok(name) => vec![name],
        Err(_) => LIBRARY_NAMES.iter().map(|n| n.to_string()).collect(),
    };
    let mut reason = String::new();
    for name in &names {
        let c_name = CString::new(name.as_str())
            .map_err(|_| LoadError::NotFound { tried: name.clone(), reason: "the name holds a NUL byte".into() })?;
        // SAFETY: loading a shared library runs its initialisers; Open MPI's have no
        // preconditions.
        let handle = unsafe { libc::dlopen(c_name.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
        if !handle.is_null() {
            return Ok((name.clone(), handle));
        }
        // SAFETY: dlerror returns the last error as a NUL-terminated string (or null).
        let error = unsafe { libc::dlerror() };
        if !error.is_null() {
            reason = unsafe { CStr::from_ptr(error) }.to_string_lossy().into_owned();
        }
    }
    Err(LoadError::NotFound { tried: names.join(", "), reason })
}
