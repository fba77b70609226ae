//! The backend conformance kit against two `UcxBackend`s over the same-host
//! lane (tcp for control, cma for data, memory invalidation and peer error
//! handling on) — once with the direct-read lane open (the default: reads
//! are one-sided cma copies the owner does not check), once with it closed
//! (every read served by the owner).

use crate::common;

use rdmareg_backend::conformance::BackendPair;
use rdmareg_ucx::Transport;

async fn pair() -> BackendPair {
    common::backend_pair(Transport::SameHost)
}

rdmareg_backend::conformance_tests!(pair);

mod served_by_the_owner {
    use super::*;

    async fn pair() -> BackendPair {
        common::backend_pair_with(
            common::config(Transport::SameHost).with_same_host_direct_reads(false),
        )
    }

    rdmareg_backend::conformance_tests!(pair);
}
