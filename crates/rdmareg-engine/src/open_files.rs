//! The process's open-file limit, which every engine raises as it starts.
//!
//! Every peer connection costs the process a descriptor, and at the soft
//! `RLIMIT_NOFILE` a listener's `accept` fails with `EMFILE`, so a peer that
//! holds many idle connections shuts honest peers out. The first engine of a
//! process raises the soft limit to the hard one, as far as the process may
//! raise it itself; that bounds such an attack by the hard limit, not by
//! the default soft one (1,024 on most systems).

use std::sync::OnceLock;

use rdmareg_core::RdmaError;

/// The process's `RLIMIT_NOFILE`: how many file descriptors it may hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpenFileLimit {
    /// The soft limit, which `open`, `socket` and `accept` fail at
    /// (`EMFILE`).
    pub soft: u64,
    /// The hard limit: the highest the soft limit can be raised to without
    /// privilege.
    pub hard: u64,
}

/// The process's open-file limit as it is now.
///
/// # Errors
/// [`RdmaError::Backend`] with the OS error when `getrlimit` fails.
pub fn open_file_limit() -> Result<OpenFileLimit, RdmaError> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `limit` is a valid, writable rlimit for the call's duration.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        return Err(RdmaError::backend(format!(
            "getrlimit(RLIMIT_NOFILE): {}",
            std::io::Error::last_os_error()
        )));
    }
    Ok(OpenFileLimit {
        soft: limit.rlim_cur,
        hard: limit.rlim_max,
    })
}

/// What [`raise_open_file_limit`] found and left.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpenFileLimitRaise {
    /// The limit before the engine raised it.
    pub before: OpenFileLimit,
    /// The limit after: the soft limit equals the hard one, unless the OS
    /// refused (then it is `before`).
    pub after: OpenFileLimit,
}

/// Raises the process's soft `RLIMIT_NOFILE` to its hard limit, once per
/// process; later calls return the first call's result.
///
/// Every peer connection costs a descriptor, and at the soft limit `accept`
/// fails with `EMFILE`, so the limit is raised as far as the process may
/// raise it itself. The limits before and after are logged once.
///
/// # Errors
/// [`RdmaError::Backend`] when the limit cannot be read; a refused raise is
/// not an error (it is logged, and `after` equals `before`).
pub fn raise_open_file_limit() -> Result<OpenFileLimitRaise, RdmaError> {
    static RAISED: OnceLock<Result<OpenFileLimitRaise, RdmaError>> = OnceLock::new();
    RAISED.get_or_init(raise_once).clone()
}

fn raise_once() -> Result<OpenFileLimitRaise, RdmaError> {
    let before = open_file_limit()?;
    if before.soft >= before.hard {
        tracing::info!(
            soft = before.soft,
            hard = before.hard,
            "open-file limit (RLIMIT_NOFILE) already at its hard limit"
        );
        return Ok(OpenFileLimitRaise {
            before,
            after: before,
        });
    }
    let raised = libc::rlimit {
        rlim_cur: before.hard,
        rlim_max: before.hard,
    };
    // SAFETY: `raised` is a valid rlimit; raising the soft limit up to the
    // hard one needs no privilege and touches nothing but this process's
    // limit.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } != 0 {
        tracing::warn!(
            soft = before.soft,
            hard = before.hard,
            error = %std::io::Error::last_os_error(),
            "cannot raise the open-file limit (RLIMIT_NOFILE) to its hard limit"
        );
        return Ok(OpenFileLimitRaise {
            before,
            after: before,
        });
    }
    let after = open_file_limit()?;
    tracing::info!(
        soft_before = before.soft,
        soft = after.soft,
        hard = after.hard,
        "raised the open-file limit (RLIMIT_NOFILE) to its hard limit"
    );
    Ok(OpenFileLimitRaise { before, after })
}
