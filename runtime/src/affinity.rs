//! Pinning threads to cores, as DeepSpeed's `--bind_cores_to_rank` does: a rank's kernel
//! threads then stay on their own cores instead of migrating between ranks' cores, which makes
//! timings (the pipeline bubble above all) repeatable on an otherwise idle machine.
//!
//! Linux only (`sched_getaffinity`/`sched_setaffinity`); elsewhere every call reports that it
//! is unsupported.

use std::io;

/// The cores this process may run on (its affinity mask, which a container's cpuset narrows),
/// in increasing order.
#[cfg(target_os = "linux")]
pub fn allowed_cores() -> io::Result<Vec<usize>> {
    // SAFETY: `set` is a plain bit set that the kernel fills; its size is passed with it.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    if unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok((0..libc::CPU_SETSIZE as usize).filter(|&core| unsafe { libc::CPU_ISSET(core, &set) }).collect())
}

/// Pins the calling thread to `core`.
#[cfg(target_os = "linux")]
pub fn pin_current_thread(core: usize) -> io::Result<()> {
    if core >= libc::CPU_SETSIZE as usize {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("there is no core {core}")));
    }
    // SAFETY: as above; `core` is inside the set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    unsafe { libc::CPU_SET(core, &mut set) };
    if unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(not(target_os = "linux"))]
pub fn allowed_cores() -> io::Result<Vec<usize>> {
    Err(io::Error::new(io::ErrorKind::Unsupported, "binding threads to cores needs Linux"))
}

#[cfg(not(target_os = "linux"))]
pub fn pin_current_thread(_core: usize) -> io::Result<()> {
    Err(io::Error::new(io::ErrorKind::Unsupported, "binding threads to cores needs Linux"))
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    #[test]
    fn a_pinned_thread_runs_on_its_core_only() -> io::Result<()> {
        let cores = allowed_cores()?;
        let &last = cores.last().expect("this process may run on some core");
        let pinned = std::thread::spawn(move || {
            pin_current_thread(last)?;
            allowed_cores()
        });
        let seen = pinned.join().expect("the pinned thread finishes")?;
        assert_eq!(seen, vec![last]);
        Ok(())
    }

    #[test]
    fn a_core_outside_the_set_is_refused() {
        let pinned = std::thread::spawn(|| pin_current_thread(libc::CPU_SETSIZE as usize));
        let result = pinned.join().expect("the thread finishes");
        assert!(result.is_err_and(|e| e.to_string().contains("no core")));
    }
}
