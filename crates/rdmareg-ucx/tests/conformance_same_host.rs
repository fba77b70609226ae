//! The backend conformance kit against two `UcxBackend`s over the same-host
//! lane: tcp for control plus cma for data, with memory invalidation and peer
//! error handling on.

mod common;

use rdmareg_backend::conformance::BackendPair;
use rdmareg_ucx::Transport;

async fn pair() -> BackendPair {
    common::backend_pair(Transport::SameHost)
}

rdmareg_backend::conformance_tests!(pair);
