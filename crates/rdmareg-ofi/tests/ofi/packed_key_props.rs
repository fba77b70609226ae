//! Property tests of the packed key: every malformed key is a typed error,
//! decoding never panics, and what decodes is canonical.

use crate::common;

use std::time::Duration;

use bytes::Bytes;
use common::SeamForTestMemory;
use proptest::prelude::*;
use rdmareg_backend::RdmaBackend;
use rdmareg_core::{BackendGet, RdmaError};
use rdmareg_ofi::Provider;
use rdmareg_ofi::key::{
    CAPABILITY_LEN, FLAG_LEASE, FLAG_OWNER_SERVED, HEADER_LEN, KeyKind, MAX_FABRIC_ADDRESS,
    PackedKey,
};

fn valid_key() -> impl Strategy<Value = PackedKey> {
    (
        (any::<bool>(), any::<bool>()),
        (1u64.., any::<[u8; CAPABILITY_LEN]>(), any::<u64>()),
        1u64..(u64::MAX / 2),
        1u64..(u64::MAX / 2),
        proptest::collection::vec(any::<u8>(), 1..=MAX_FABRIC_ADDRESS),
    )
        .prop_map(
            |((owner_served, virt_addr), (region_id, capability, mr_key), base, len, owner)| {
                PackedKey {
                    owner_served,
                    virt_addr,
                    region_id,
                    capability,
                    // An owner-served key carries no memory key.
                    mr_key: if owner_served { 0 } else { mr_key },
                    base,
                    len,
                    owner: Bytes::from(owner),
                }
            },
        )
}

proptest! {
    #[test]
    fn arbitrary_bytes_decode_to_a_canonical_key_or_invalid_key(
        bytes in proptest::collection::vec(any::<u8>(), 0..400)
    ) {
        let bytes = Bytes::from(bytes);
        match PackedKey::decode(&bytes) {
            Ok(key) => prop_assert_eq!(key.encode(), bytes),
            Err(err) => prop_assert_eq!(err, RdmaError::InvalidKey),
        }
    }

    #[test]
    fn valid_keys_round_trip(key in valid_key()) {
        prop_assert_eq!(PackedKey::decode(&key.encode()), Ok(key));
    }

    #[test]
    fn every_truncation_or_extension_of_a_key_is_invalid_key(
        key in valid_key(), cut in any::<prop::sample::Index>(), extra in 1usize..8
    ) {
        let wire = key.encode();
        let cut = cut.index(wire.len());
        prop_assert_eq!(PackedKey::decode(&wire.slice(..cut)), Err(RdmaError::InvalidKey));
        let mut longer = wire.to_vec();
        longer.extend(std::iter::repeat_n(0u8, extra));
        prop_assert_eq!(PackedKey::decode(&Bytes::from(longer)), Err(RdmaError::InvalidKey));
    }

    #[test]
    fn a_wrong_version_unknown_flag_or_wrong_address_length_is_invalid_key(
        key in valid_key(), version in 3u8.., flag in 1u8..63, delta in 1u16..10
    ) {
        let wire = key.encode().to_vec();
        let mut bad = wire.clone();
        bad[0] = version;
        prop_assert_eq!(PackedKey::decode(&Bytes::from(bad)), Err(RdmaError::InvalidKey));
        let mut bad = wire.clone();
        bad[1] |= flag << 2;
        prop_assert_eq!(PackedKey::decode(&Bytes::from(bad)), Err(RdmaError::InvalidKey));
        let mut bad = wire.clone();
        let stated = u16::from_le_bytes([bad[50], bad[51]]).wrapping_add(delta);
        bad[50..52].copy_from_slice(&stated.to_le_bytes());
        prop_assert_eq!(PackedKey::decode(&Bytes::from(bad)), Err(RdmaError::InvalidKey));
        prop_assert!(wire.len() > HEADER_LEN);
        let mut old = wire.clone();
        old[0] = 1;
        prop_assert_eq!(PackedKey::decode(&Bytes::from(old)), Err(RdmaError::InvalidKey), "a version-1 key");
    }

    #[test]
    fn bytes_read_as_either_kind_of_key_decode_canonically_or_to_invalid_key(
        bytes in proptest::collection::vec(any::<u8>(), 0..400), lease_flags in any::<bool>()
    ) {
        let mut bytes = bytes;
        if lease_flags && bytes.len() > 1 {
            // Reach the lease layout more often than chance would.
            bytes[1] = FLAG_OWNER_SERVED | FLAG_LEASE;
        }
        let bytes = Bytes::from(bytes);
        match PackedKey::decode_any(&bytes) {
            Ok((key, KeyKind::Lease)) => {
                prop_assert!(key.owner_served && !key.virt_addr && key.mr_key == 0);
                prop_assert_eq!(key.encode_lease(), bytes);
            }
            Ok((key, KeyKind::Registration)) => prop_assert_eq!(key.encode(), bytes),
            Err(err) => prop_assert_eq!(err, RdmaError::InvalidKey),
        }
    }

    #[test]
    fn lease_keys_round_trip_and_only_the_lease_decoder_takes_them(key in valid_key()) {
        let lease = key.encode_lease();
        let decoded = PackedKey::decode_lease(&lease);
        prop_assert_eq!(decoded.clone().map(|k| k.encode_lease()), Ok(lease.clone()));
        prop_assert_eq!(
            decoded.map(|k| (k.region_id, k.capability, k.base, k.len, k.owner)),
            Ok((key.region_id, key.capability, key.base, key.len, key.owner.clone()))
        );
        prop_assert_eq!(PackedKey::decode(&lease), Err(RdmaError::InvalidKey));
        prop_assert_eq!(PackedKey::decode_lease(&key.encode()), Err(RdmaError::InvalidKey));
    }

    #[test]
    fn an_owner_served_key_naming_a_memory_key_or_region_zero_is_invalid_key(
        key in valid_key(), mr_key in 1u64..
    ) {
        let served = PackedKey { owner_served: true, mr_key, ..key.clone() };
        prop_assert_eq!(PackedKey::decode(&served.encode()), Err(RdmaError::InvalidKey));
        let zero = PackedKey { region_id: 0, ..key };
        prop_assert_eq!(PackedKey::decode(&zero.encode()), Err(RdmaError::InvalidKey));
    }
}

/// Through a running engine: a GET with key bytes that are garbage, or a
/// well-formed key of an owner that is not the peer named, is refused with
/// `InvalidKey` before libfabric sees it; nothing lands.
#[test]
fn gets_with_malformed_or_foreign_keys_are_invalid_key_through_the_engine() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let (owner, consumer) = common::engines(Provider::Tcp);
    let c = consumer.backend();
    let mut dst = vec![0u8; 4096];
    let dst_region = runtime
        .block_on(c.map_test_memory(dst.as_mut_ptr() as usize, dst.len()))
        .unwrap();
    let request = |key: Bytes| BackendGet {
        peer: common::OWNER,
        remote_addr: 0x1000,
        packed_key: key,
        local_region_id: dst_region.backend_region_id,
        local_offset: 0,
        len: 64,
        deadline: Some(Duration::from_secs(5)),
    };
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig::with_cases(64));
    runner
        .run(
            &(proptest::collection::vec(any::<u8>(), 0..400), valid_key()),
            |(garbage, mut foreign)| {
                let garbage = Bytes::from(garbage);
                if PackedKey::decode(&garbage).is_err() {
                    let answer = runtime.block_on(c.get_into_test_memory(request(garbage)));
                    prop_assert_eq!(answer, Err(RdmaError::InvalidKey));
                }
                // A well-formed key naming another owner than the peer.
                if foreign.owner == owner.fabric_address() {
                    foreign.owner = Bytes::from_static(b"elsewhere");
                }
                let answer = runtime.block_on(c.get_into_test_memory(request(foreign.encode())));
                prop_assert_eq!(answer, Err(RdmaError::InvalidKey));
                Ok(())
            },
        )
        .unwrap();
    runtime
        .block_on(c.unmap(dst_region.backend_region_id))
        .unwrap();
    assert!(dst.iter().all(|&b| b == 0), "no byte landed");
    consumer.shutdown_blocking();
    owner.shutdown_blocking();
    assert_eq!(consumer.live_registrations(), 0);
}

/// Through a running engine: a release is sent only for a lease key of
/// the peer it names. The region's own key, garbage, and a lease key
/// naming another owner are `InvalidKey`, an unknown peer is
/// `NotConfigured`, and the lease's own key is sent.
#[test]
fn releases_of_keys_that_are_no_lease_of_the_peer_are_refused_through_the_engine() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let (owner, consumer) = common::engines(Provider::Tcp);
    let (o, c) = (owner.backend(), consumer.backend());
    let src = vec![3u8; 4096];
    let region = runtime
        .block_on(o.map_test_memory(src.as_ptr() as usize, src.len()))
        .unwrap();
    let terms = rdmareg_core::LeaseTerms {
        readers: 1,
        expires_at: std::time::Instant::now() + Duration::from_secs(60),
    };
    let lease = runtime
        .block_on(o.lease(region.backend_region_id, terms))
        .expect("a lease");
    let mut elsewhere = PackedKey::decode_lease(&lease.packed_key).expect("a lease key");
    elsewhere.owner = Bytes::from_static(b"elsewhere");
    let release = |peer, key: Bytes| runtime.block_on(c.release_lease(peer, key));
    assert_eq!(
        release(common::OWNER, region.packed_key.clone()),
        Err(RdmaError::InvalidKey)
    );
    assert_eq!(
        release(common::OWNER, Bytes::from_static(b"no key")),
        Err(RdmaError::InvalidKey)
    );
    assert_eq!(
        release(common::OWNER, elsewhere.encode_lease()),
        Err(RdmaError::InvalidKey)
    );
    assert_eq!(
        release(rdmareg_core::PeerId(99), lease.packed_key.clone()),
        Err(RdmaError::NotConfigured)
    );
    assert_eq!(release(common::OWNER, lease.packed_key.clone()), Ok(()));
    runtime.block_on(o.unmap(region.backend_region_id)).unwrap();
    consumer.shutdown_blocking();
    owner.shutdown_blocking();
    assert_eq!(owner.live_registrations(), 0);
}
