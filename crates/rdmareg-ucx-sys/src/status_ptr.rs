//! The `UCS_PTR_*` and `UCS_STATUS_*` macros of `ucs/type/status.h`, written
//! as functions.
//!
//! A non-blocking UCP call returns a [`ucs_status_ptr_t`] that is one of
//! three things: null (`UCS_OK`, completed inline), a small negative number
//! cast to a pointer (an error status), or a real request pointer (the
//! operation is in progress). The error range is the top of the address
//! space, from `(uintptr_t)UCS_ERR_LAST` up, where no request can live.
//!
//! The names are the C macro names so code reads like UCX's documentation.

#![allow(non_snake_case)]

use crate::{UCS_ERR_LAST, UCS_INPROGRESS, ucs_status_ptr_t, ucs_status_t};

/// `(uintptr_t)UCS_ERR_LAST`: the lowest address that encodes an error.
const LOWEST_ERROR_ADDR: usize = UCS_ERR_LAST as isize as usize;

/// `UCS_PTR_IS_ERR`: whether `ptr` encodes an error status.
#[inline]
pub fn UCS_PTR_IS_ERR(ptr: ucs_status_ptr_t) -> bool {
    ptr.addr() >= LOWEST_ERROR_ADDR
}

/// `UCS_PTR_IS_PTR`: whether `ptr` is a request (neither null nor an error).
#[inline]
pub fn UCS_PTR_IS_PTR(ptr: ucs_status_ptr_t) -> bool {
    ptr.addr().wrapping_sub(1) < LOWEST_ERROR_ADDR - 1
}

/// `UCS_PTR_RAW_STATUS`: the status encoded in `ptr`, meaningful only when
/// `ptr` is null or an error.
#[inline]
pub fn UCS_PTR_RAW_STATUS(ptr: ucs_status_ptr_t) -> ucs_status_t {
    // The C macro truncates `(intptr_t)ptr` to the status type; so does this.
    ptr.addr() as isize as ucs_status_t
}

/// `UCS_PTR_STATUS`: `UCS_INPROGRESS` for a request, otherwise the encoded
/// status (`UCS_OK` for null).
#[inline]
pub fn UCS_PTR_STATUS(ptr: ucs_status_ptr_t) -> ucs_status_t {
    if UCS_PTR_IS_PTR(ptr) {
        UCS_INPROGRESS
    } else {
        UCS_PTR_RAW_STATUS(ptr)
    }
}

/// `UCS_STATUS_PTR`: a status encoded as a status pointer (no provenance:
/// it never points anywhere).
#[inline]
pub fn UCS_STATUS_PTR(status: ucs_status_t) -> ucs_status_ptr_t {
    std::ptr::without_provenance_mut(status as isize as usize)
}

/// `UCS_STATUS_IS_ERR`: whether `status` is an error (negative).
#[inline]
pub fn UCS_STATUS_IS_ERR(status: ucs_status_t) -> bool {
    status < 0
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{UCS_ERR_CANCELED, UCS_ERR_IO_ERROR, UCS_ERR_NO_MESSAGE, UCS_OK};

    fn request() -> ucs_status_ptr_t {
        // Any real heap address stands for a request; the caller frees it.
        Box::into_raw(Box::new(0u64)).cast()
    }

    #[test]
    fn null_is_ok_and_neither_request_nor_error() {
        let null = std::ptr::null_mut();
        assert!(!UCS_PTR_IS_ERR(null));
        assert!(!UCS_PTR_IS_PTR(null));
        assert_eq!(UCS_PTR_STATUS(null), UCS_OK);
    }

    #[test]
    fn every_error_status_round_trips_through_a_pointer() {
        for status in UCS_ERR_LAST..0 {
            let ptr = UCS_STATUS_PTR(status);
            assert!(UCS_PTR_IS_ERR(ptr), "status {status}");
            assert!(!UCS_PTR_IS_PTR(ptr), "status {status}");
            assert_eq!(UCS_PTR_STATUS(ptr), status);
        }
    }

    #[test]
    fn a_request_pointer_is_in_progress() {
        let ptr = request();
        assert!(UCS_PTR_IS_PTR(ptr));
        assert!(!UCS_PTR_IS_ERR(ptr));
        assert_eq!(UCS_PTR_STATUS(ptr), UCS_INPROGRESS);
        // SAFETY: `ptr` came from `Box::into_raw` of a `u64` in `request`.
        drop(unsafe { Box::from_raw(ptr.cast::<u64>()) });
    }

    #[test]
    fn the_error_range_starts_exactly_at_ucs_err_last() {
        let lowest_error = std::ptr::without_provenance_mut(LOWEST_ERROR_ADDR);
        let highest_request = std::ptr::without_provenance_mut(LOWEST_ERROR_ADDR - 1);
        assert!(UCS_PTR_IS_ERR(lowest_error));
        assert_eq!(UCS_PTR_STATUS(lowest_error), UCS_ERR_LAST);
        assert!(UCS_PTR_IS_PTR(highest_request));
        assert!(!UCS_PTR_IS_ERR(highest_request));
    }

    #[test]
    fn status_is_err_only_for_negative_statuses() {
        assert!(!UCS_STATUS_IS_ERR(UCS_OK));
        assert!(!UCS_STATUS_IS_ERR(UCS_INPROGRESS));
        assert!(UCS_STATUS_IS_ERR(UCS_ERR_NO_MESSAGE));
        assert!(UCS_STATUS_IS_ERR(UCS_ERR_IO_ERROR));
        assert!(UCS_STATUS_IS_ERR(UCS_ERR_CANCELED));
    }
}
