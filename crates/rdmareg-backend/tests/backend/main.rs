//! The integration tests of `rdmareg-backend`, as one test binary: the
//! conformance kit against the loopback backend, the kit catching broken
//! backends, and the loopback's own behaviour, a module each.

#[path = "../common/mod.rs"]
mod common;

mod conformance;
mod kit_detects_broken_backends;
mod loopback_faults;
mod loopback_shutdown;
mod loopback_transfers;
