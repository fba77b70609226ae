//! Hostile writers: write messages sent by hand. The owner drops what does
//! not parse, refuses what its owner machine refuses with a typed code and
//! changes no byte, and keeps serving honest writes.

use rdmareg_core::Access;

use super::*;
use crate::protocol::{
    REFUSAL_BIT, WRITE_CHUNK_MAX, WRITE_REPLY_LEN, WRITE_TAG, WriteRequest, refusal_code,
};
use rdmareg_engine::served::Refusal;

const LEN: usize = 8192;

/// The reply code a write got: `Ok(length written)` or the refusal code;
/// `None` when nothing came within half a second.
fn write_answer(
    peer: &mut RawPeer,
    to_owner: u64,
    id: u64,
    wire: Vec<u8>,
) -> Option<Result<u64, u8>> {
    let (answer, index) = peer.receive(to_owner, id, REPLY_IGNORE, WRITE_REPLY_LEN);
    peer.send(to_owner, WRITE_TAG, wire);
    let until = Instant::now() + Duration::from_millis(500);
    while Instant::now() < until {
        peer.poll();
        if let Some(ended) = peer.ended.get(&answer) {
            return match ended.clone() {
                Ended::Done { len, tag } if tag & REFUSAL_BIT != 0 => {
                    assert_eq!(len, 0, "a refusal carries no bytes");
                    Some(Err(((tag >> 48) & 0xFF) as u8))
                }
                Ended::Done { len, .. } => {
                    assert_eq!(len, WRITE_REPLY_LEN);
                    let mut raw = [0u8; 8];
                    raw.copy_from_slice(&peer.buffers[index][..8]);
                    Some(Ok(u64::from_le_bytes(raw)))
                }
                Ended::Failed(text) => panic!("the reply receive failed: {text}"),
            };
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    None
}

fn garbage_and_wrong_writes_change_nothing(provider: Provider) {
    let rt = runtime();
    let config = config(provider);
    let owner = OfiEngine::start(config.clone()).expect("owner starts");
    let o = owner.backend();
    let writable = Memory::filled(LEN, 0xAA);
    let read_only = Memory::filled(LEN, 0xBB);
    // SAFETY: the range is this test's own allocation, reached only through
    // its address while registered (`snapshot` copies once no write is in
    // flight), freed only once unregistered.
    let w_region = rt
        .block_on(unsafe { o.map_with_access(writable.addr(), LEN, Access::ReadWrite) })
        .expect("maps writable");
    let r_region = read_only.map(&rt, &o);
    let w_key = PackedKey::decode(&w_region.packed_key).unwrap();
    let r_key = PackedKey::decode(&r_region.packed_key).unwrap();
    let mut peer = RawPeer::open(&config);
    let to_owner = peer.insert(&owner.fabric_address());
    let me = peer.address().to_vec();
    let header = |id: u64, key: &PackedKey, address: u64, length: u64| WriteRequest {
        request_id: id,
        region_id: key.region_id,
        capability: key.capability,
        address,
        length,
        reply_to: me.clone(),
    };
    let base = writable.addr() as u64;
    let honest = header(1, &w_key, base + 8, 16).encode_with(&[0x5A; 16]);
    // Frames that do not parse are dropped: no reply.
    let mut wrong_version = honest.clone();
    wrong_version[0] = 1;
    let mut nonzero = honest.clone();
    nonzero[2] = 7;
    for (what, id, wire) in [
        ("empty", 2, Vec::new()),
        ("a truncated header", 3, honest[..40].to_vec()),
        ("a read's version", 4, wrong_version),
        ("non-zero reserved bytes", 5, nonzero),
        (
            "zero length",
            6,
            header(6, &w_key, base, 0).encode_with(&[]),
        ),
        (
            "a length over the chunk",
            7,
            header(7, &w_key, base, WRITE_CHUNK_MAX + 1).encode_with(&[1; 64]),
        ),
        (
            "request id 0",
            0,
            header(0, &w_key, base, 4).encode_with(&[1; 4]),
        ),
    ] {
        assert_eq!(
            write_answer(&mut peer, to_owner, id.max(1) + 100, wire),
            None,
            "{what}"
        );
    }
    // Frames that parse but the owner must refuse, each with its code.
    let mut forged = w_key.clone();
    forged.capability[3] ^= 1;
    let cases = [
        (
            "a short payload",
            header(11, &w_key, base, 16).encode_with(&[1; 15]),
            Refusal::RegionUnknown,
        ),
        (
            "a long payload",
            header(12, &w_key, base, 16).encode_with(&[1; 17]),
            Refusal::RegionUnknown,
        ),
        (
            "a forged capability",
            header(13, &forged, base, 16).encode_with(&[1; 16]),
            Refusal::CapabilityMismatch,
        ),
        (
            "a read-only registration",
            header(14, &r_key, read_only.addr() as u64, 16).encode_with(&[1; 16]),
            Refusal::AccessDenied,
        ),
        (
            "a range past the end",
            header(15, &w_key, base + LEN as u64 - 8, 16).encode_with(&[1; 16]),
            Refusal::OutOfRange,
        ),
        (
            "a range below the base",
            header(16, &w_key, base - 8, 16).encode_with(&[1; 16]),
            Refusal::OutOfRange,
        ),
        (
            "a wrapping range",
            header(17, &w_key, u64::MAX - 4, 16).encode_with(&[1; 16]),
            Refusal::OutOfRange,
        ),
        (
            "an unknown registration",
            WriteRequest {
                region_id: u64::MAX,
                ..header(18, &w_key, base, 16)
            }
            .encode_with(&[1; 16]),
            Refusal::RegionUnknown,
        ),
    ];
    for (what, wire, refusal) in cases {
        let id = u64::from_le_bytes(wire[4..12].try_into().unwrap());
        assert_eq!(
            write_answer(&mut peer, to_owner, id, wire),
            Some(Err(refusal_code(refusal))),
            "{what}"
        );
    }
    assert!(
        writable.snapshot().iter().all(|&b| b == 0xAA),
        "no refused write changed a byte"
    );
    assert!(read_only.snapshot().iter().all(|&b| b == 0xBB));
    // The owner still serves an honest write.
    assert_eq!(write_answer(&mut peer, to_owner, 1, honest), Some(Ok(16)));
    let after = writable.snapshot();
    assert!(after[8..24].iter().all(|&b| b == 0x5A));
    assert!(after[..8].iter().chain(&after[24..]).all(|&b| b == 0xAA));
    let unmapped = [
        rt.block_on(o.unmap(w_region.backend_region_id)),
        rt.block_on(o.unmap(r_region.backend_region_id)),
    ];
    drop(peer);
    rt.block_on(owner.shutdown());
    assert_eq!(unmapped, [Ok(()), Ok(())]);
    assert_eq!(owner.live_registrations(), 0);
    writable.free_after(true);
    read_only.free_after(true);
}

#[test]
fn garbage_and_wrong_writes_change_nothing_over_tcp() {
    garbage_and_wrong_writes_change_nothing(Provider::Tcp);
}

#[test]
fn garbage_and_wrong_writes_change_nothing_over_shm() {
    garbage_and_wrong_writes_change_nothing(Provider::Shm);
}
