//! The backend seam of rdmareg: what the registry needs from an RDMA provider.
//!
//! - [`RdmaBackend`]: the trait, with the contract every implementation honours.
//! - [`loopback::LoopbackBackend`]: a real in-process backend with fault
//!   injection, used to test the layers above deterministically.
//! - `conformance` (feature `testkit`): the reusable suite that checks a
//!   backend against the contract.

#![deny(unsafe_op_in_unsafe_fn)]

mod backend;
#[cfg(feature = "testkit")]
pub mod conformance;
pub mod leases;
pub mod loopback;
pub mod notices;
#[cfg(feature = "testkit")]
pub mod own_process;

pub use backend::{BackendLease, RdmaBackend};
/// The system page size, to which contract point 7 rounds.
pub use loopback::page_size;
pub use rdmareg_core::{
    Access, BackendGet, BackendPut, BackendRegion, LeaseEnd, LeaseTerms, PeerId, RdmaError,
};
