//! The backend conformance kit against two `OfiBackend`s over libfabric's
//! `shm` provider, in one process.

use crate::common;

use rdmareg_backend::conformance::BackendPair;
use rdmareg_ofi::Provider;

async fn pair() -> BackendPair {
    common::backend_pair(Provider::Shm)
}

rdmareg_backend::conformance_tests!(pair);
