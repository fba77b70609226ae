//! UCX status codes: their text, a non-blocking call's exits, [`RdmaError`].
//!
//! Every UCX failure that reaches a caller keeps UCX's status text
//! (`ucs_status_string`) in its message; the variant is what code matches.

use std::ffi::{CStr, c_void};

use rdmareg_core::RdmaError;
use ucx_sys::{UCS_ERR_LAST, UCS_OK, ucs_status_ptr_t, ucs_status_t};

/// UCX's description of `status` (`ucs_status_string`).
pub(crate) fn status_text(status: ucs_status_t) -> String {
    // SAFETY: ucs_status_string accepts any status value and returns a pointer
    // to a static NUL-terminated string (an "unknown" text for values it does
    // not know).
    let text = unsafe { ucx_sys::ucs_status_string(status) };
    if text.is_null() {
        return format!("status {status}");
    }
    // SAFETY: non-null, NUL-terminated and static, per ucs_status_string.
    unsafe { CStr::from_ptr(text) }
        .to_string_lossy()
        .into_owned()
}

/// `Ok(())` for `UCS_OK`, otherwise a [`RdmaError::Backend`] naming what was
/// attempted and UCX's status text.
pub(crate) fn check(status: ucs_status_t, what: &str) -> Result<(), RdmaError> {
    if status == UCS_OK {
        Ok(())
    } else {
        Err(backend_error(status, what))
    }
}

/// A [`RdmaError::Backend`] for a failed UCX call.
pub(crate) fn backend_error(status: ucs_status_t, what: &str) -> RdmaError {
    RdmaError::backend(format!("ucx: {what}: {}", status_text(status)))
}

/// Which of its three exits a non-blocking UCX call took.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PtrStatus {
    /// Completed inside the call (`UCS_OK`); no callback will run.
    Done,
    /// A request that completes later, through its callback.
    Pending(*mut c_void),
    /// Failed inside the call; no callback will run.
    Failed(ucs_status_t),
}

impl PtrStatus {
    /// Decodes a `ucs_status_ptr_t` the way `UCS_PTR_IS_ERR` /
    /// `UCS_PTR_IS_PTR` do: null is success, the top `|UCS_ERR_LAST|` values
    /// of the address space are error codes, everything else is a request.
    pub(crate) fn decode(ptr: ucs_status_ptr_t) -> PtrStatus {
        let raw = ptr as usize;
        // `UCS_ERR_LAST` sign-extended to pointer width: the lowest error value.
        let first_error = UCS_ERR_LAST as isize as usize;
        if raw == 0 {
            PtrStatus::Done
        } else if raw >= first_error {
            PtrStatus::Failed(raw as isize as ucs_status_t)
        } else {
            PtrStatus::Pending(ptr)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ucx_sys::{UCS_ERR_CONNECTION_RESET, UCS_ERR_NO_MEMORY};

    #[test]
    fn null_is_inline_completion() {
        assert_eq!(PtrStatus::decode(std::ptr::null_mut()), PtrStatus::Done);
    }

    #[test]
    fn error_values_decode_to_their_status() {
        for status in [UCS_ERR_NO_MEMORY, UCS_ERR_CONNECTION_RESET, UCS_ERR_LAST] {
            let ptr = status as isize as ucs_status_ptr_t;
            assert_eq!(PtrStatus::decode(ptr), PtrStatus::Failed(status));
        }
    }

    #[test]
    fn ordinary_pointers_are_requests() {
        let mut slot = 0u64;
        let ptr = (&mut slot as *mut u64).cast::<c_void>();
        assert_eq!(PtrStatus::decode(ptr), PtrStatus::Pending(ptr));
    }

    #[test]
    fn backend_errors_carry_the_ucx_status_text() {
        let err = backend_error(UCS_ERR_NO_MEMORY, "mapping memory");
        let RdmaError::Backend(text) = err else {
            panic!("expected a backend error, got {err:?}");
        };
        assert!(text.contains("mapping memory"), "{text}");
        assert!(text.to_lowercase().contains("memory"), "{text}");
        assert!(check(UCS_OK, "x").is_ok());
    }
}
