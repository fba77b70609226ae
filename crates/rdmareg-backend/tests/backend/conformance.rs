//! The loopback backend passes the whole conformance kit, through the public
//! API only: once with no faults, and once with every operation delayed so
//! that maps, unmaps and GETs really are in flight when the kit cancels,
//! drops or races them, and once with maps detached from their futures (a
//! dropped map is rolled back later, as over a progress thread).

use std::sync::Arc;
use std::time::Duration;

use rdmareg_backend::conformance::BackendPair;
use rdmareg_backend::loopback::{FaultOp, LoopbackBackend, LoopbackFabric};
use rdmareg_backend::{PeerId, RdmaBackend};

const OWNER: PeerId = PeerId(1);
const CONSUMER: PeerId = PeerId(2);

fn pair_on(owner: Arc<LoopbackBackend>, consumer: Arc<LoopbackBackend>) -> BackendPair {
    let (o, c) = (Arc::clone(&owner), Arc::clone(&consumer));
    BackendPair::new(owner, consumer, OWNER).with_teardown(async move {
        // The kit unmaps everything it mapped; teardown then has nothing to force.
        assert_eq!(o.live_registrations(), Some(0), "owner after the kit");
        assert_eq!(c.live_registrations(), Some(0), "consumer after the kit");
        c.shutdown().await;
        o.shutdown().await;
    })
}

async fn plain_pair() -> BackendPair {
    let fabric = LoopbackFabric::new();
    pair_on(fabric.backend(OWNER), fabric.backend(CONSUMER))
}

async fn delayed_pair() -> BackendPair {
    let fabric = LoopbackFabric::new();
    let (owner, consumer) = (fabric.backend(OWNER), fabric.backend(CONSUMER));
    for backend in [&owner, &consumer] {
        backend
            .faults()
            .set_delay(FaultOp::Map, Duration::from_millis(1));
        backend
            .faults()
            .set_delay(FaultOp::Unmap, Duration::from_millis(1));
        backend
            .faults()
            .set_delay(FaultOp::Get, Duration::from_millis(2));
    }
    pair_on(owner, consumer)
}

/// Maps run detached, as on a progress thread: a dropped map registers
/// anyway and is rolled back by an unmap of its own, which the unmap delay
/// holds open for a while.
async fn detached_pair() -> BackendPair {
    let fabric = LoopbackFabric::new();
    let (owner, consumer) = (fabric.backend(OWNER), fabric.backend(CONSUMER));
    for backend in [&owner, &consumer] {
        backend.faults().detach_maps(true);
        backend
            .faults()
            .set_delay(FaultOp::Map, Duration::from_millis(1));
        backend
            .faults()
            .set_delay(FaultOp::Unmap, Duration::from_millis(3));
    }
    pair_on(owner, consumer)
}

mod plain {
    rdmareg_backend::conformance_tests!(super::plain_pair);
}

mod delayed {
    rdmareg_backend::conformance_tests!(super::delayed_pair);
}

mod detached {
    rdmareg_backend::conformance_tests!(super::detached_pair);
}
