//! Deadlines inside a write list: each entry keeps its own, even while
//! the list's message waits to be handed to the provider.

use std::time::{Duration, Instant};

use rdmareg_backend::RdmaBackend;
use rdmareg_core::{BackendPut, PeerId, RdmaError};

use super::*;

/// A batch's two small puts to one owner travel as one write list. The
/// owner is a raw endpoint that never progresses, so over `tcp;ofi_rxm`
/// the list's send waits unsent. The first put's deadline (300 ms) must
/// fail it alone with `Timeout`; the second keeps waiting for its own
/// (3 s) and fails then, also with `Timeout`, as each would alone.
#[test]
fn one_entrys_deadline_leaves_the_others_of_a_queued_list() {
    let rt = runtime();
    let config = config(Provider::Tcp).with_unreachable_after(Duration::from_secs(60));
    let owner = RawPeer::open(&config);
    let writer = OfiEngine::start(config).expect("writer starts");
    writer.add_peer(PeerId(1), owner.address()).unwrap();
    let key = raw_owner_key(owner.address(), 1 << 20);
    let src = Memory::filled(64, 0x11);
    let src_region = src.map(&rt, &writer.backend());
    let put = |offset: u64, deadline: Duration| BackendPut {
        peer: PeerId(1),
        remote_addr: 0x10_0000 + offset,
        packed_key: key.clone(),
        local_region_id: src_region.backend_region_id,
        local_offset: offset,
        len: 8,
        deadline: Some(deadline),
    };
    let requests = vec![
        put(0, Duration::from_millis(300)),
        put(8, Duration::from_secs(3)),
    ];
    let backend = writer.backend();
    let started = Instant::now();
    // SAFETY: nothing touches the source until the batch answered.
    let answers = rt.block_on(unsafe { backend.put_batch(requests) });
    let took = started.elapsed();
    let unmapped = rt.block_on(backend.unmap(src_region.backend_region_id));
    writer.shutdown_blocking();
    drop(owner);
    src.free_after(unmapped.is_ok());
    assert_eq!(
        answers[0],
        Err(RdmaError::Timeout),
        "the first at its deadline"
    );
    assert_eq!(
        answers[1],
        Err(RdmaError::Timeout),
        "the second, answered after {took:?}"
    );
    assert!(took >= Duration::from_secs(3), "answered after {took:?}");
}
