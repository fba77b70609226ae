//! The integration tests of the `rdmareg` facade, as one test binary: each
//! module is a group of tests of one behaviour, named by it. One binary
//! links the engines once instead of once per group.

mod accounting_after_errors;
mod adversarial_seam;
mod backend_seam_from_safe_code;
mod dropped_without_shutdown;
mod facade;
mod metrics_flood;
mod metrics_http;
mod notices;
mod offer;
mod overlapping_lists;
#[cfg(feature = "discovery")]
mod published;
mod two_processes;
