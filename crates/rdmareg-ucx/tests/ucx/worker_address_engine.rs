//! A consumer handed a malformed worker address gets a typed error, and the
//! process lives: before validation, a flipped first byte or most random
//! 64-byte addresses made UCX abort it (`address.c`, SIGABRT) at the first
//! GET to that peer.

use crate::common;

use bytes::Bytes;
use common::*;
use rdmareg_core::{PeerId, RdmaError};
use rdmareg_ucx::Transport;

/// The peer id the malformed addresses are recorded under.
const FAKE_OWNER: PeerId = PeerId(7);

/// Deterministic pseudo-random bytes (xorshift64*), so a failure reproduces.
fn random_bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            state ^= state >> 12;
            state ^= state << 25;
            state ^= state >> 27;
            (state.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 56) as u8
        })
        .collect()
}

/// Malformed addresses derived from the real `address`, with a name each.
fn malformed(address: &Bytes) -> Vec<(String, Bytes)> {
    let real = address.to_vec();
    let mut cases = vec![
        ("empty".to_owned(), Bytes::new()),
        (
            "the header byte alone".to_owned(),
            Bytes::copy_from_slice(&real[..1]),
        ),
        (
            "cut one byte short".to_owned(),
            Bytes::copy_from_slice(&real[..real.len() - 1]),
        ),
        (
            "with a byte appended".to_owned(),
            Bytes::from([real.as_slice(), &[0]].concat()),
        ),
    ];
    for flip in [0x01u8, 0x02, 0x04, 0x08, 0xFF] {
        let mut bytes = real.clone();
        bytes[0] ^= flip;
        cases.push((format!("byte 0 xor {flip:#04x}"), Bytes::from(bytes)));
    }
    for seed in 1..=8 {
        cases.push((
            format!("random 64 bytes, seed {seed}"),
            Bytes::from(random_bytes(seed, 64)),
        ));
    }
    cases
}

async fn malformed_addresses_are_refused_and_gets_to_them_fail_typed(transport: Transport) {
    let (owner, consumer) = engines(transport);
    let (ob, cb) = (owner.backend(), consumer.backend());
    let src = PageBuf::filled(4096, pattern);
    let dst = PageBuf::zeroed(4096);
    let src_region = map(&ob, &src).await;
    let dst_region = map(&cb, &dst).await;
    let desc = describe(&src, &src_region);

    for (what, address) in malformed(&owner.worker_address()) {
        let refused = consumer.add_peer(FAKE_OWNER, address.clone());
        assert!(
            matches!(refused, Err(RdmaError::InvalidWorkerAddress(_))),
            "{what}: add_peer answered {refused:?}"
        );
        let request = get_request(FAKE_OWNER, &desc, &dst_region, 0, None);
        assert_eq!(
            cb.get_into_test_memory(request).await,
            Err(RdmaError::NotConfigured),
            "{what}: GET to the refused peer"
        );

        // A malformed re-add of a known peer leaves its good address in place.
        let refused = consumer.add_peer(OWNER, address);
        assert!(
            matches!(refused, Err(RdmaError::InvalidWorkerAddress(_))),
            "{what}: re-adding the owner answered {refused:?}"
        );
    }
    assert!(dst.snapshot().iter().all(|&b| b == 0), "nothing was copied");

    let request = get_request(OWNER, &desc, &dst_region, 0, None);
    assert_eq!(
        cb.get_into_test_memory(request).await,
        Ok(()),
        "the real owner still serves"
    );
    assert_eq!(dst.snapshot(), src.snapshot());
    consumer.shutdown().await;
    owner.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_addresses_are_refused_over_tcp_and_gets_to_them_fail_typed() {
    malformed_addresses_are_refused_and_gets_to_them_fail_typed(Transport::Tcp).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_addresses_are_refused_on_the_same_host_and_gets_to_them_fail_typed() {
    malformed_addresses_are_refused_and_gets_to_them_fail_typed(Transport::SameHost).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_refusal_says_what_is_wrong_and_names_the_peer() {
    let (owner, consumer) = engines(Transport::Tcp);
    let mut bytes = owner.worker_address().to_vec();
    bytes[0] ^= 0x02;
    let Err(RdmaError::InvalidWorkerAddress(text)) = consumer.add_peer(FAKE_OWNER, bytes.into())
    else {
        panic!("a flipped version nibble must be refused");
    };
    assert!(text.contains("version 2"), "{text}");
    assert!(text.contains(&FAKE_OWNER.to_string()), "{text}");
    consumer.shutdown().await;
    owner.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_well_formed_address_of_a_worker_that_is_gone_fails_the_get_typed() {
    let (owner, consumer) = engines(Transport::Tcp);
    let (ob, cb) = (owner.backend(), consumer.backend());
    let src = PageBuf::filled(4096, pattern);
    let dst = PageBuf::zeroed(4096);
    let src_region = map(&ob, &src).await;
    let dst_region = map(&cb, &dst).await;
    let desc = describe(&src, &src_region);

    // A second owner, started and shut down: its address is well formed and
    // names a listener that no longer exists.
    let gone = rdmareg_ucx::UcxEngine::start(config(Transport::Tcp)).expect("engine starts");
    let address = gone.worker_address();
    gone.shutdown().await;
    consumer
        .add_peer(FAKE_OWNER, address)
        .expect("a real address is accepted");
    let request = get_request(
        FAKE_OWNER,
        &desc,
        &dst_region,
        0,
        Some(std::time::Duration::from_secs(2)),
    );
    let answer = cb.get_into_test_memory(request).await;
    assert!(
        answer.is_err(),
        "GET to a vanished worker answered {answer:?}"
    );
    consumer.shutdown().await;
    owner.shutdown().await;
}
