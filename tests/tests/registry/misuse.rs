//! Descriptor misuse across the real seam: every refusal is a typed error,
//! the destination buffer is neither written nor surrendered, and the engine
//! keeps serving valid GETs afterwards.

use std::time::Duration;

use bytes::Bytes;
use rdmareg_registry::{Descriptor, DescriptorError, PeerId, PinnedBuf, RdmaError, RegionGuard};
use rdmareg_tests::{
    EngineConfig, KIB, Lane, OWNER, Pair, assert_all, assert_same_bytes, engine_config, expected,
    patterned, registry_config,
};

/// Byte a destination is pre-filled with.
const UNTOUCHED: u8 = 0x5E;
/// Seed of the owner's region.
const SEED: u8 = 11;
/// Length of the owner's region.
const REGION: usize = 8 * KIB;

per_lane!(
    a_descriptor_naming_another_backend_is_refused,
    sub_ranges_outside_their_parent_are_out_of_range,
    tampered_packed_keys_are_refused_and_the_engine_keeps_serving,
    gets_larger_than_their_destination_are_refused,
    a_get_from_a_peer_never_added_is_not_configured,
);

/// A pair, the owner's registered region and its descriptor as the consumer
/// decoded it.
async fn setup(lane: Lane) -> (Pair, RegionGuard, Descriptor) {
    setup_with(lane.engine_config()).await
}

/// [`setup`] with engines started from `engine`.
async fn setup_with(engine: EngineConfig) -> (Pair, RegionGuard, Descriptor) {
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

async fn a_descriptor_naming_another_backend_is_refused(lane: Lane) {
    let (pair, guard, descriptor) = setup(lane).await;
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

async fn sub_ranges_outside_their_parent_are_out_of_range(lane: Lane) {
    let (pair, guard, descriptor) = setup(lane).await;
    let pool_buf = pair
        .owner
        .registry
        .alloc_pinned(REGION)
        .await
        .expect("owner pool buffer")
        .describe()
        .await
        .expect("a describable buffer");
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

/// How a lane's keys are tampered with: keys that must not decode, keys
/// that decode but name no registration the consumer was given, and where
/// the key's last capability byte is.
struct Tampering {
    malformed: Vec<(&'static str, Vec<u8>)>,
    forged: Vec<(&'static str, Vec<u8>)>,
    last_capability_byte: usize,
}

/// `key` with the byte at `at` XORed with `mask`.
fn flipped(key: &[u8], at: usize, mask: u8) -> Vec<u8> {
    let mut bytes = key.to_vec();
    bytes[at] ^= mask;
    bytes
}

/// `key` with `bytes` written at `at`.
fn overwritten(key: &[u8], at: usize, bytes: &[u8]) -> Vec<u8> {
    let mut key = key.to_vec();
    key[at..at + bytes.len()].copy_from_slice(bytes);
    key
}

/// Changes of length any layout refuses.
fn resized(key: &[u8]) -> Vec<(&'static str, Vec<u8>)> {
    vec![
        ("every byte 0xFF", vec![0xFF; key.len()]),
        ("truncated by one byte", key[..key.len() - 1].to_vec()),
        ("truncated to one byte", key[..1].to_vec()),
        ("extended by a zero byte", [key, &[0]].concat()),
        ("extended by garbage", [key, &[0xA7; 16]].concat()),
    ]
}

/// The UCX owner-served key: magic (2), version, lane, region id (8),
/// capability (16).
fn ucx_tampering(key: &[u8]) -> Tampering {
    assert_eq!(
        key.len(),
        28,
        "an owner-served key: magic, version, lane, id, capability"
    );
    let mut malformed = vec![
        ("the magic flipped", flipped(key, 0, 0x80)),
        ("an unknown version", flipped(key, 2, 0x40)),
        ("an unknown lane", flipped(key, 3, 0x01)),
        ("a UCX-packed key", vec![0; 9]),
    ];
    malformed.extend(resized(key));
    Tampering {
        malformed,
        forged: vec![
            ("another region id", flipped(key, 4, 0x01)),
            ("a capability bit flipped", flipped(key, 12, 0x01)),
            ("the last capability byte flipped", flipped(key, 27, 0x80)),
        ],
        last_capability_byte: 27,
    }
}

/// The libfabric key (`rdmareg_ofi::key`, version 2): version, flags,
/// region id (8, at 2), capability (16, at 10), MR key (8, at 26), base,
/// length, address length (2, at 50), the owner's fabric address (at 52).
fn ofi_tampering(key: &[u8]) -> Tampering {
    use rdmareg_ofi::key::{FLAG_OWNER_SERVED, HEADER_LEN, KEY_VERSION};
    assert!(key.len() > HEADER_LEN, "a key carries the owner's address");
    assert_eq!(
        (key[0], key[1]),
        (KEY_VERSION, FLAG_OWNER_SERVED),
        "an owner-served key"
    );
    let mut malformed = vec![
        ("an unknown version", flipped(key, 0, 0x40)),
        ("an unknown flag", flipped(key, 1, 0x80)),
        (
            "a one-sided key for an owner-served engine",
            flipped(key, 1, FLAG_OWNER_SERVED),
        ),
        ("region id zero", overwritten(key, 2, &[0; 8])),
        ("an MR key on an owner-served key", flipped(key, 26, 0x01)),
        ("a registered length of zero", overwritten(key, 42, &[0; 8])),
        ("an address length of zero", overwritten(key, 50, &[0, 0])),
        (
            "an address of another owner",
            flipped(key, key.len() - 1, 0x01),
        ),
        ("a UCX-packed key", vec![0; 9]),
    ];
    malformed.extend(resized(key));
    Tampering {
        malformed,
        forged: vec![
            // The top byte: a flip never makes the id zero.
            ("another region id", flipped(key, 9, 0x01)),
            ("a capability bit flipped", flipped(key, 10, 0x01)),
            ("the last capability byte flipped", flipped(key, 25, 0x80)),
        ],
        last_capability_byte: 25,
    }
}

/// Keys are checked by the owner, so UCX's same-host direct-read lane
/// (whose reads the owner never sees; see `rdmareg_ucx`'s crate docs) is
/// closed here.
async fn tampered_packed_keys_are_refused_and_the_engine_keeps_serving(lane: Lane) {
    let engine: EngineConfig = match &lane {
        Lane::Ucx(transport) => engine_config(transport.clone())
            .with_same_host_direct_reads(false)
            .into(),
        Lane::Ofi(_) => lane.engine_config(),
    };
    let (pair, guard, descriptor) = setup_with(engine).await;
    let key = descriptor.packed_key().to_vec();
    let tampering = match lane {
        Lane::Ucx(_) => ucx_tampering(&key),
        Lane::Ofi(_) => ofi_tampering(&key),
    };
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
    let mut buf = untouched_buffer(&pair, REGION).await;
    // Malformed keys never leave the consumer; well-formed keys naming a
    // registration the consumer was not given are refused by the owner,
    // and the consumer learns only "not found".
    let cases = tampering
        .malformed
        .into_iter()
        .map(|(what, bytes)| (what, bytes, RdmaError::InvalidKey))
        .chain(
            tampering
                .forged
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
    // Tampering with the encoding itself: the key ends the encoding, so its
    // last capability byte sits at a fixed distance from the end; a cut
    // encoding no longer decodes.
    let mut wire = descriptor.encode().to_vec();
    let capability_byte = wire.len() - key.len() + tampering.last_capability_byte;
    wire[capability_byte] ^= 0xEE;
    let tampered = Descriptor::decode(&wire).expect("still a descriptor");
    assert_eq!(
        pair.consumer.registry.get(OWNER, &tampered, &mut buf).await,
        Err(RdmaError::RegionNotFound),
        "key byte tampered on the wire"
    );
    let last = wire.len() - 1;
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

async fn gets_larger_than_their_destination_are_refused(lane: Lane) {
    let (pair, guard, descriptor) = setup(lane).await;
    let registry = &pair.consumer.registry;
    let mut small = untouched_buffer(&pair, REGION - 1).await;
    assert_eq!(
        registry.get(OWNER, &descriptor, &mut small).await,
        Err(RdmaError::DestinationTooSmall {
            needed: REGION as u64,
            available: REGION as u64 - 1
        }),
        "one byte too many"
    );
    assert_unharmed("one byte too many", &small, REGION - 1);

    let mut exact = untouched_buffer(&pair, REGION).await;
    for offset in [1, REGION] {
        assert_eq!(
            registry
                .get_into(OWNER, &descriptor, &mut exact, offset)
                .await,
            Err(RdmaError::DestinationTooSmall {
                needed: (offset + REGION) as u64,
                available: REGION as u64
            }),
            "at destination offset {offset}"
        );
    }
    assert_eq!(
        registry
            .get_into(OWNER, &descriptor, &mut exact, usize::MAX)
            .await,
        Err(RdmaError::OutOfRange),
        "an offset whose sum with the length overflows"
    );
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

async fn a_get_from_a_peer_never_added_is_not_configured(lane: Lane) {
    let (pair, guard, descriptor) = setup(lane).await;
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
