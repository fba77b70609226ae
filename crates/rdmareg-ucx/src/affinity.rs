//! Pinning the progress thread to the CPUs the caller names.
//!
//! See [`UcxConfig::progress_cpus`](crate::UcxConfig::progress_cpus).
//!
//! A lone read hands over between the caller, this progress thread and the
//! owner's, and each hand-over costs a context switch when two of them
//! share a CPU. A library cannot know which CPUs are free, so nothing is
//! pinned by default. The thread pins itself before it creates any UCX
//! object; a set the kernel refuses fails the engine's start.

use rdmareg_core::RdmaError;

/// CPU numbers the kernel's affinity mask can hold (`CPU_SETSIZE`).
pub(crate) const MAX_CPU: usize = libc::CPU_SETSIZE as usize;

/// Checks a CPU set before the engine starts: not empty, every CPU number
/// below [`MAX_CPU`].
pub(crate) fn validate(cpus: &[usize]) -> Result<(), String> {
    if cpus.is_empty() {
        return Err("progress_cpus must name at least one CPU".into());
    }
    if let Some(cpu) = cpus.iter().find(|&&cpu| cpu >= MAX_CPU) {
        return Err(format!(
            "progress_cpus names CPU {cpu}, past the largest the kernel's mask holds ({})",
            MAX_CPU - 1
        ));
    }
    Ok(())
}

/// Pins the calling thread to `cpus` (already validated).
pub(crate) fn pin_current_thread(cpus: &[usize]) -> Result<(), RdmaError> {
    // SAFETY: an all-zero `cpu_set_t` is the empty set; the macros below
    // only set bits of it.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    for &cpu in cpus {
        debug_assert!(cpu < MAX_CPU);
        // SAFETY: `set` is a live `cpu_set_t` and `cpu` is below its size.
        unsafe { libc::CPU_SET(cpu, &mut set) };
    }
    // SAFETY: pid 0 is the calling thread; `set` is a valid mask of the
    // size passed.
    let status =
        unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) };
    if status != 0 {
        let err = std::io::Error::last_os_error();
        return Err(RdmaError::backend_caused_by(
            format!("ucx: pinning the progress thread to CPUs {cpus:?}"),
            err,
        ));
    }
    tracing::debug!(?cpus, "progress thread pinned");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_empty_or_oversized_cpu_set_is_refused() {
        assert!(validate(&[]).is_err());
        assert!(validate(&[0, MAX_CPU]).is_err());
        assert!(validate(&[0, MAX_CPU - 1]).is_ok());
    }
}
