//! Descriptor misuse across the real seam: every refusal is a typed error,
//! the destination buffer is neither written nor surrendered, and the engine
//! keeps serving valid GETs afterwards.

use std::time::Duration;

use bytes::Bytes;
use rdmareg_registry::{Descriptor, DescriptorError, PeerId, PinnedBuf, RdmaError, RegionGuard};
use rdmareg_tests::{
    KIB, OWNER, Pair, assert_all, assert_same_bytes, engine_config, expected, patterned,
    registry_config,
};
use rdmareg_ucx::{Transport, UcxConfig};

/// Byte a destination is pre-filled with.
const UNTOUCHED: u8 = 0x5E;
/// Seed of the owner's region.
const SEED: u8 = 11;
/// Length of the owner's region.
const REGION: usize = 8 * KIB;

per_transport!(
    a_descriptor_naming_another_backend_is_refused,
    sub_ranges_outside_their_parent_are_out_of_range,
    tampered_packed_keys_are_refused_and_the_engine_keeps_serving,
    gets_larger_than_their_destination_are_out_of_range,
    a_get_from_a_peer_never_added_is_not_configured,
);

/// A pair, the owner's registered region and its descriptor as the consumer
/// decoded it.
async fn setup(transport: Transport) -> (Pair, RegionGuard, Descriptor) {
    setup_with(engine_config(transport)).await
}

/// [`setup`] with engines started from `engine`.
async fn setup_with(engine: UcxConfig) -> (Pair, RegionGuard, Descriptor) {
    let pair = Pair::start_with(engine, registry_config());
    let guard = pair
        .owner
        .registry
        .register_owned(patterned(REGION, SEED))
        .await
        .expect("owned registration");
    let wire = guard.descriptor().expect("descriptor").encode();
    (pair, guard, Descriptor::decode(&wire).expect("decodes"))
}

/// A consumer buffer of `len` bytes filled with [`UNTOUCHED`].
async fn untouched_buffer(pair: &Pair, len: usize) -> PinnedBuf {
    let mut buf = pair
        .consumer
        .registry
        .alloc_pinned(len)
        .await
        .expect("consumer buffer");
    buf.fill(UNTOUCHED);
    buf
}

/// The refused GET left `buf` in place and unwritten.
#[track_caller]
fn assert_unharmed(what: &str, buf: &PinnedBuf, len: usize) {
    assert!(
        !buf.is_surrendered(),
        "{what}: a refused GET keeps the buffer"
    );
    assert_eq!(buf.len(), len, "{what}");
    assert_all(what, buf, UNTOUCHED);
}

/// A valid GET of the whole region still works.
async fn assert_still_serving(pair: &Pair, descriptor: &Descriptor) {
    let mut buf = untouched_buffer(pair, REGION).await;
    pair.consumer
        .registry
        .get(OWNER, descriptor, &mut buf)
        .await
        .expect("a valid GET after the refusals");
    assert_same_bytes("valid GET", &buf, &expected(SEED, 0, REGION));
}

async fn finish(pair: Pair, guard: RegionGuard) {
    guard
        .unregister(Duration::from_secs(1))
        .await
        .expect("unregister");
    pair.shut_down(Duration::from_secs(5)).await;
}

async fn a_descriptor_naming_another_backend_is_refused(transport: Transport) {
    let (pair, guard, descriptor) = setup(transport).await;
    let foreign = Descriptor::new(
        "loopback",
        descriptor.addr(),
        descriptor.len(),
        descriptor.generation(),
        descriptor.packed_key().clone(),
    )
    .expect("a well-formed descriptor");
    let foreign = Descriptor::decode(&foreign.encode()).expect("decodes");
    let mut buf = untouched_buffer(&pair, REGION).await;
    assert_eq!(
        pair.consumer.registry.get(OWNER, &foreign, &mut buf).await,
        Err(RdmaError::InvalidDescriptor(
            DescriptorError::InvalidBackendKey
        ))
    );
    assert_unharmed("foreign backend", &buf, REGION);
    assert_eq!(pair.consumer.registry.stats().transfers_in_flight, 0);
    assert_still_serving(&pair, &descriptor).await;
    drop(buf);
    finish(pair, guard).await;
}

async fn sub_ranges_outside_their_parent_are_out_of_range(transport: Transport) {
    let (pair, guard, descriptor) = setup(transport).await;
    let mut pool_buf = pair
        .owner
        .registry
        .alloc_pinned(REGION)
        .await
        .expect("owner pool buffer");
    pool_buf.describe().await.expect("a describable buffer");
    let len = REGION as u64;
    let outside = [
        (0, 0),
        (len, 1),
        (len - 1, 2),
        (1, len),
        (0, len + 1),
        (u64::MAX, 2),
        (2, u64::MAX),
    ];
    for (offset, sub_len) in outside {
        let what = format!("[{offset}, +{sub_len})");
        assert_eq!(
            guard.descriptor_range(offset, sub_len),
            Err(RdmaError::OutOfRange),
            "region {what}"
        );
        assert_eq!(
            pool_buf.descriptor_range(offset, sub_len),
            Err(RdmaError::OutOfRange),
            "pool buffer {what}"
        );
        assert_eq!(
            descriptor.slice(offset, sub_len).map_err(RdmaError::from),
            Err(RdmaError::OutOfRange),
            "decoded descriptor {what}"
        );
    }
    // A slice of a slice is bounded by the slice, not the region.
    let middle = descriptor.slice(KIB as u64, KIB as u64).expect("inside");
    assert_eq!(
        middle.slice(1, KIB as u64).map_err(RdmaError::from),
        Err(RdmaError::OutOfRange)
    );
    let inner = middle.slice(1, KIB as u64 - 1).expect("inside the slice");
    let mut buf = untouched_buffer(&pair, KIB).await;
    pair.consumer
        .registry
        .get(OWNER, &inner, &mut buf)
        .await
        .expect("GET of a slice of a slice");
    assert_same_bytes(
        "slice of a slice",
        &buf[..KIB - 1],
        &expected(SEED, KIB + 1, KIB - 1),
    );
    assert_eq!(buf[KIB - 1], UNTOUCHED);
    drop((buf, pool_buf));
    finish(pair, guard).await;
}

/// Keys are checked by the owner, so the same-host direct-read lane (whose
/// reads the owner never sees; see `rdmareg_ucx`'s crate docs) is closed
/// here.
async fn tampered_packed_keys_are_refused_and_the_engine_keeps_serving(transport: Transport) {
    let engine = engine_config(transport).with_same_host_direct_reads(false);
    let (pair, guard, descriptor) = setup_with(engine).await;
    let key = descriptor.packed_key().to_vec();
    assert_eq!(
        key.len(),
        28,
        "an owner-served key: magic, version, lane, id, capability"
    );
    let with_key = |bytes: Vec<u8>| {
        let tampered = Descriptor::new(
            descriptor.backend_key(),
            descriptor.addr(),
            descriptor.len(),
            descriptor.generation(),
            Bytes::from(bytes),
        )
        .expect("the descriptor itself is well formed");
        // Across the wire like any other descriptor.
        Descriptor::decode(&tampered.encode()).expect("decodes")
    };
    let flipped = |at: usize, mask: u8| {
        let mut bytes = key.clone();
        bytes[at] ^= mask;
        bytes
    };
    // Malformed keys never leave the consumer.
    let malformed: Vec<(&str, Vec<u8>)> = vec![
        ("the magic flipped", flipped(0, 0x80)),
        ("an unknown version", flipped(2, 0x40)),
        ("an unknown lane", flipped(3, 0x01)),
        ("every byte 0xFF", vec![0xFF; key.len()]),
        ("a UCX-packed key", vec![0; 9]),
        ("truncated by one byte", key[..key.len() - 1].to_vec()),
        ("truncated to one byte", key[..1].to_vec()),
        ("extended by a zero byte", [key.as_slice(), &[0]].concat()),
        (
            "extended by garbage",
            [key.as_slice(), &[0xA7; 16]].concat(),
        ),
    ];
    // Well-formed keys naming a registration the consumer was not given:
    // the owner refuses them, and the consumer learns only "not found".
    let forged: Vec<(&str, Vec<u8>)> = vec![
        ("another region id", flipped(4, 0x01)),
        ("a capability bit flipped", flipped(12, 0x01)),
        ("the last capability byte flipped", flipped(27, 0x80)),
    ];
    let mut buf = untouched_buffer(&pair, REGION).await;
    let cases = malformed
        .into_iter()
        .map(|(what, bytes)| (what, bytes, RdmaError::InvalidKey))
        .chain(
            forged
                .into_iter()
                .map(|(what, bytes)| (what, bytes, RdmaError::RegionNotFound)),
        );
    for (what, bytes, error) in cases {
        let tampered = with_key(bytes);
        assert_eq!(
            pair.consumer.registry.get(OWNER, &tampered, &mut buf).await,
            Err(error),
            "{what}"
        );
        assert_unharmed(what, &buf, REGION);
    }
    // Tampering with the encoding itself: the last byte on the wire is the
    // key's last capability byte; a cut encoding no longer decodes.
    let mut wire = descriptor.encode().to_vec();
    let last = wire.len() - 1;
    wire[last] ^= 0xEE;
    let tampered = Descriptor::decode(&wire).expect("still a descriptor");
    assert_eq!(
        pair.consumer.registry.get(OWNER, &tampered, &mut buf).await,
        Err(RdmaError::RegionNotFound),
        "key byte tampered on the wire"
    );
    assert!(matches!(
        Descriptor::decode(&wire[..last]),
        Err(DescriptorError::Truncated { needed: 1 })
    ));
    assert_unharmed("after every tampered key", &buf, REGION);
    assert_eq!(pair.consumer.registry.stats().transfers_in_flight, 0);

    assert_still_serving(&pair, &descriptor).await;
    drop(buf);
    finish(pair, guard).await;
}

async fn gets_larger_than_their_destination_are_out_of_range(transport: Transport) {
    let (pair, guard, descriptor) = setup(transport).await;
    let registry = &pair.consumer.registry;
    let mut small = untouched_buffer(&pair, REGION - 1).await;
    assert_eq!(
        registry.get(OWNER, &descriptor, &mut small).await,
        Err(RdmaError::OutOfRange),
        "one byte too many"
    );
    assert_unharmed("one byte too many", &small, REGION - 1);

    let mut exact = untouched_buffer(&pair, REGION).await;
    for offset in [1, REGION, usize::MAX] {
        assert_eq!(
            registry
                .get_into(OWNER, &descriptor, &mut exact, offset)
                .await,
            Err(RdmaError::OutOfRange),
            "at destination offset {offset}"
        );
    }
    assert_unharmed("past the end", &exact, REGION);
    // The same bytes fit exactly at offset 0, and a shorter slice fits at 1.
    let short = descriptor.slice(0, REGION as u64 - 1).unwrap();
    registry
        .get_into(OWNER, &short, &mut exact, 1)
        .await
        .expect("a fitting GET");
    assert_eq!(exact[0], UNTOUCHED);
    assert_same_bytes("fitted", &exact[1..], &expected(SEED, 0, REGION - 1));
    drop((small, exact));
    finish(pair, guard).await;
}

async fn a_get_from_a_peer_never_added_is_not_configured(transport: Transport) {
    let (pair, guard, descriptor) = setup(transport).await;
    let mut buf = untouched_buffer(&pair, REGION).await;
    assert_eq!(
        pair.consumer
            .registry
            .get(PeerId(99), &descriptor, &mut buf)
            .await,
        Err(RdmaError::NotConfigured)
    );
    assert_unharmed("unknown peer", &buf, REGION);
    assert_eq!(pair.consumer.registry.stats().transfers_in_flight, 0);
    assert_still_serving(&pair, &descriptor).await;
    drop(buf);
    finish(pair, guard).await;
}
