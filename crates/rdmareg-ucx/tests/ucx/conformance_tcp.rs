//! The backend conformance kit against two `UcxBackend`s over `UCX_TLS=tcp`
//! on the loopback interface.

use crate::common;

use rdmareg_backend::conformance::BackendPair;
use rdmareg_ucx::Transport;

async fn pair() -> BackendPair {
    common::backend_pair(Transport::Tcp)
}

rdmareg_backend::conformance_tests!(pair);
