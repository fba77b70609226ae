//! Unmaps of a region that is at once served to a peer and the destination
//! of this engine's own read: the unmap waits for both, whichever ends
//! first, and answers `Ok` once the last one ended.

use crate::common;

use std::time::Duration;

use bytes::Bytes;
use common::raw_am::Raw;
use common::*;
use rdmareg_backend::RdmaBackend;
use rdmareg_core::{BackendGet, PeerId, RdmaError};
use rdmareg_ucx::read_protocol::{READ_REPLY_AM_ID, READ_REQUEST_AM_ID, ReadRequest, ServedKey};
use ucx_sys as sys;

/// How the engine names the raw owner that never answers.
const SILENT_OWNER: PeerId = PeerId(7);

/// The region is served to a consumer that holds a large reply (a read
/// lease at the owner) and is also the destination of a read this engine
/// sent to an owner that never answers. The unmap waits; the read into the
/// region times out first, while the reply is still held. The unmap must
/// keep waiting for the reply and answer `Ok` once the consumer lets it go,
/// not fail because a lease is still held when the destination hold ends.
#[test]
fn an_unmap_outlasts_a_read_into_the_region_then_answers_ok() {
    let rt = runtime();
    let engine = tcp_engine();
    let backend = engine.backend();
    let buf = PageBuf::filled(8 << 20, pattern);
    let region = rt.block_on(map(&backend, &buf));
    let key = ServedKey::decode(&region.packed_key).unwrap();

    // A consumer holds a rendezvous reply of the whole region: one lease.
    let consumer = Raw::new(true);
    let ep = consumer.connect(&engine.worker_address());
    let request = ReadRequest {
        request_id: 1,
        key,
        address: buf.addr() as u64,
        length: 8 << 20,
    };
    consumer.send_wait(
        ep,
        READ_REQUEST_AM_ID,
        &request.encode(),
        &[],
        sys::UCP_AM_SEND_FLAG_REPLY,
    );
    let held = consumer.progress_until(Duration::from_secs(10), |r| {
        r.messages(READ_REPLY_AM_ID)
            .first()
            .is_some_and(|m| !m.desc.is_null())
    });
    assert!(held, "the consumer holds a rendezvous reply");
    assert_eq!(engine.served_replies_in_flight(), 1);

    // A read into the same region, from an owner that never answers.
    let silent = Raw::new(false);
    engine.add_peer(SILENT_OWNER, silent.address()).unwrap();
    let get = {
        let backend = backend.clone();
        let request = BackendGet {
            peer: SILENT_OWNER,
            remote_addr: 0x10_0000,
            packed_key: Bytes::copy_from_slice(
                &ServedKey {
                    region_id: 1,
                    capability: [0x11; 16],
                }
                .encode(),
            ),
            local_region_id: region.backend_region_id,
            local_offset: 0,
            len: 4096,
            deadline: Some(Duration::from_millis(600)),
        };
        rt.spawn(async move { backend.get_into_test_memory(request).await })
    };
    let asked = silent.progress_until(Duration::from_secs(5), |r| {
        !r.messages(READ_REQUEST_AM_ID).is_empty()
    });
    assert!(asked, "the silent owner received the read");

    // The unmap waits for the read into the region and for the reply.
    let unmap = {
        let backend = backend.clone();
        let id = region.backend_region_id;
        rt.spawn(async move { backend.unmap(id).await })
    };
    // The read into the region runs into its deadline meanwhile; the
    // consumer stays alive and keeps the reply.
    let read_ended = consumer.progress_until(Duration::from_secs(5), |_| get.is_finished());
    let read = read_ended.then(|| rt.block_on(get).unwrap());
    consumer.progress_for(Duration::from_millis(500));
    // What the unmap answered while the reply was still held, if anything;
    // else what it answers once the consumer lets the reply go.
    let (early, result) = if unmap.is_finished() {
        (Some(rt.block_on(unmap).unwrap()), None)
    } else {
        consumer.release_held();
        let released = consumer.progress_until(Duration::from_secs(5), |_| unmap.is_finished());
        (None, released.then(|| rt.block_on(unmap).unwrap()))
    };
    drop(consumer);
    drop(silent);
    rt.block_on(engine.shutdown());
    let live = engine.live_registrations();
    drop(buf);

    assert_eq!(read, Some(Err(RdmaError::Timeout)), "the silent read");
    assert_eq!(
        early, None,
        "the unmap answered while a consumer still held a reply UCX reads from the region"
    );
    assert_eq!(result, Some(Ok(())), "the unmap after the reply was let go");
    assert_eq!(live, Some(0));
}
