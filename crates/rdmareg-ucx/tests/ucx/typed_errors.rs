//! Bad requests get typed errors from the engine, never a panic: unknown
//! peers, destinations outside the mapping, malformed keys, bad settings.

use crate::common;

use std::time::Duration;

use bytes::Bytes;
use common::*;
use rdmareg_backend::RdmaBackend;
use rdmareg_core::{PeerId, RdmaError};
use rdmareg_ucx::{Transport, UcxConfig, UcxEngine};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn get_from_a_peer_never_added_is_not_configured() {
    let (owner, consumer) = engines(Transport::Tcp);
    let (ob, cb) = (owner.backend(), consumer.backend());
    let src = PageBuf::filled(4096, pattern);
    let dst = PageBuf::zeroed(4096);
    let src_region = map(&ob, &src).await;
    let dst_region = map(&cb, &dst).await;
    let desc = describe(&src, &src_region);

    let request = get_request(PeerId(99), &desc, &dst_region, 0, None);
    assert_eq!(
        cb.get_into_test_memory(request).await,
        Err(RdmaError::NotConfigured)
    );

    // A removed peer is unknown again.
    consumer.remove_peer(OWNER).unwrap();
    let request = get_request(OWNER, &desc, &dst_region, 0, None);
    assert_eq!(
        cb.get_into_test_memory(request).await,
        Err(RdmaError::NotConfigured)
    );
    assert!(dst.snapshot().iter().all(|&b| b == 0), "nothing was copied");
    consumer.shutdown().await;
    owner.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn destination_ranges_outside_the_mapped_length_are_out_of_range() {
    let (owner, consumer) = engines(Transport::SameHost);
    let (ob, cb) = (owner.backend(), consumer.backend());
    let src = PageBuf::filled(4096, pattern);
    // Map 100 bytes of a page: the page-rounded range is no licence.
    let dst = PageBuf::zeroed(4096);
    let src_region = map(&ob, &src).await;
    let dst_region = cb.map_test_memory(dst.addr(), 100).await.unwrap();
    assert!(dst_region.effective_len >= 100);
    let desc = describe(&src, &src_region);

    for (offset, len) in [
        (0u64, 101u64),
        (100, 1),
        (4000, 8),
        (1, u64::MAX),
        (u64::MAX, 1),
    ] {
        let mut request = get_request(OWNER, &desc, &dst_region, offset, None);
        request.len = len;
        assert_eq!(
            cb.get_into_test_memory(request).await,
            Err(RdmaError::OutOfRange),
            "offset {offset} len {len}"
        );
    }
    let mut zero = get_request(OWNER, &desc, &dst_region, 0, None);
    zero.len = 0;
    assert_eq!(
        cb.get_into_test_memory(zero).await,
        Err(RdmaError::OutOfRange),
        "zero length"
    );
    assert!(dst.snapshot().iter().all(|&b| b == 0), "nothing was copied");
    consumer.shutdown().await;
    owner.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_keys_are_refused_before_ucx_sees_them() {
    let (owner, consumer) = engines(Transport::SameHost);
    let (ob, cb) = (owner.backend(), consumer.backend());
    let src = PageBuf::filled(4096, pattern);
    let dst = PageBuf::zeroed(4096);
    let src_region = map(&ob, &src).await;
    let dst_region = map(&cb, &dst).await;
    let desc = describe(&src, &src_region);
    let real = src_region.packed_key.clone();

    let with_byte = |at: usize, value: u8| {
        let mut key = real.to_vec();
        key[at] = value;
        Bytes::from(key)
    };
    let cases = [
        ("empty", Bytes::new()),
        ("one byte", Bytes::from_static(&[0])),
        ("a UCX-packed remote key", nine_byte_ucx_key()),
        ("another backend's magic", with_byte(0, b'X')),
        ("a version this build does not know", with_byte(2, 9)),
        ("a lane this build does not serve", with_byte(3, 7)),
        (
            "the real key plus garbage",
            Bytes::from([real.as_ref(), &[1, 2, 3]].concat()),
        ),
        (
            "the real (same-host) key cut short",
            real.slice(..real.len() - 1),
        ),
        (
            "a same-host key whose UCX key names memory domains it does not carry",
            // The UCX key starts after the 50 fixed bytes of a lane-2 key.
            with_byte(50, 0xFF),
        ),
    ];
    for (what, key) in cases {
        let mut request = get_request(OWNER, &desc, &dst_region, 0, None);
        request.packed_key = key;
        assert_eq!(
            cb.get_into_test_memory(request).await,
            Err(RdmaError::InvalidKey),
            "{what}"
        );
    }
    assert!(dst.snapshot().iter().all(|&b| b == 0), "nothing was copied");

    // The well-formed key still works afterwards.
    let request = get_request(OWNER, &desc, &dst_region, 0, None);
    assert_eq!(cb.get_into_test_memory(request).await, Ok(()));
    assert_eq!(dst.snapshot(), src.snapshot());
    consumer.shutdown().await;
    owner.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn get_into_an_unmapped_region_is_region_not_found() {
    let (owner, consumer) = engines(Transport::Tcp);
    let (ob, cb) = (owner.backend(), consumer.backend());
    let src = PageBuf::filled(4096, pattern);
    let dst = PageBuf::zeroed(4096);
    let src_region = map(&ob, &src).await;
    let dst_region = map(&cb, &dst).await;
    assert_eq!(cb.unmap(dst_region.backend_region_id).await, Ok(()));
    let request = get_request(OWNER, &describe(&src, &src_region), &dst_region, 0, None);
    assert_eq!(
        cb.get_into_test_memory(request).await,
        Err(RdmaError::RegionNotFound)
    );
    consumer.shutdown().await;
    owner.shutdown().await;
}

#[test]
fn an_engine_with_an_unknown_transport_fails_to_start_with_the_ucx_status_text() {
    init_tracing();
    let config = UcxConfig::default().with_transport(Transport::Custom {
        tls: "no-such-transport".into(),
    });
    match UcxEngine::start(config) {
        Err(RdmaError::Backend(text)) => assert!(text.starts_with("ucx: "), "{text}"),
        other => panic!("expected a backend error, got {other:?}"),
    }
}

#[test]
fn degenerate_engine_settings_are_refused_at_start() {
    let config = UcxConfig::default().with_park_timeout(Duration::ZERO);
    assert!(matches!(
        UcxEngine::start(config),
        Err(RdmaError::Backend(_))
    ));
}

#[test]
fn an_empty_peer_address_is_refused() {
    init_tracing();
    let engine = UcxEngine::start(config(Transport::Tcp)).unwrap();
    assert!(matches!(
        engine.add_peer(PeerId(5), Bytes::new()),
        Err(RdmaError::InvalidWorkerAddress(_))
    ));
    assert!(engine.shutdown_blocking());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_get_between_engines_on_different_transports_fails_cleanly() {
    // An owner without tcp cannot be reached by a tcp-only consumer.
    let owner = UcxEngine::start(config(Transport::SharedMemoryNoErrorHandling)).unwrap();
    let consumer = UcxEngine::start(config(Transport::Tcp)).unwrap();
    consumer.add_peer(OWNER, owner.worker_address()).unwrap();
    let (ob, cb) = (owner.backend(), consumer.backend());
    let src = PageBuf::filled(4096, pattern);
    let dst = PageBuf::zeroed(4096);
    let src_region = map(&ob, &src).await;
    let dst_region = map(&cb, &dst).await;
    let request = get_request(OWNER, &describe(&src, &src_region), &dst_region, 0, None);
    match cb.get_into_test_memory(request).await {
        Err(RdmaError::Backend(text)) => assert!(text.contains("ucx"), "{text}"),
        other => panic!("expected a backend error, got {other:?}"),
    }
    consumer.shutdown().await;
    owner.shutdown().await;
    assert_eq!(consumer.live_registrations(), Some(0));
}
