//! Checks of `get`: it moves exactly the named bytes, and refuses ranges,
//! regions and peers it cannot serve with the typed error the contract names
//! (contract point 6).

use rdmareg_core::RdmaError;

use super::BackendPair;
use super::buffer::Mapped;
use super::support::{FILL, assert_copied, get_request, kit_get, source_byte, unknown_peer};

/// Shapes of a correct GET: source length, destination length, remote offset,
/// local offset, bytes.
const SHAPES: [(usize, usize, usize, usize, usize); 7] = [
    (1, 1, 0, 0, 1),
    (4096, 4096, 0, 0, 4096),
    (4096 + 7, 4096 + 13, 3, 5, 4096),
    (100, 100, 99, 0, 1),
    (1000, 1000, 17, 333, 600),
    (1 << 20, 1 << 20, 0, 0, 1 << 20),
    ((1 << 20) + 1, (1 << 20) + 3, 1, 3, 1 << 20),
];

/// A GET copies exactly `len` bytes from the remote offset to the local
/// offset — 1 B, a page, unaligned offsets on both sides, 1 MiB — and touches
/// nothing else of the destination.
///
/// # Cancel safety
/// Dropped mid-way, it leaks what it registered rather than free it.
pub async fn get_moves_the_right_bytes(pair: &BackendPair) {
    for (src_len, dst_len, remote_off, local_off, len) in SHAPES {
        let src = Mapped::filled(&*pair.owner, src_len, source_byte).await;
        let dst = Mapped::filled(&*pair.consumer, dst_len, |_| FILL).await;
        let request = get_request(
            pair,
            &src,
            remote_off as u64,
            &dst,
            local_off as u64,
            len as u64,
        );
        let what = format!("GET of {len} B from offset {remote_off} to offset {local_off}");
        assert_eq!(kit_get(&*pair.consumer, request).await, Ok(()), "{what}");
        assert_copied(&dst.buf.snapshot(), local_off, remote_off, len, &what);
        dst.release(&*pair.consumer).await;
        src.release(&*pair.owner).await;
    }
}

/// A destination range outside the pointer and length that were mapped — even
/// inside the page the backend pinned — a zero length, and offset arithmetic
/// that overflows are `OutOfRange`; the destination is untouched.
///
/// # Cancel safety
/// Dropped mid-way, it leaks what it registered rather than free it.
pub async fn get_outside_the_local_mapping_is_out_of_range(pair: &BackendPair) {
    let src = Mapped::filled(&*pair.owner, 4096, source_byte).await;
    // 100 bytes: the pinned page extends past the mapped length.
    let dst = Mapped::filled(&*pair.consumer, 100, |_| FILL).await;
    let cases: [(&str, u64, u64); 7] = [
        ("starting at the mapped length", 100, 1),
        ("ending one byte past the mapped length", 0, 101),
        ("straddling the mapped end", 50, 51),
        ("inside the pinned page but past the mapped length", 200, 8),
        ("of zero bytes", 0, 0),
        ("whose offset overflows", u64::MAX, 2),
        ("whose length overflows", 1, u64::MAX),
    ];
    for (what, local_offset, len) in cases {
        let request = get_request(pair, &src, 0, &dst, local_offset, len);
        assert_eq!(
            kit_get(&*pair.consumer, request).await,
            Err(RdmaError::OutOfRange),
            "GET into a local range {what}"
        );
        assert_copied(&dst.buf.snapshot(), 0, 0, 0, &format!("after a GET {what}"));
    }
    dst.release(&*pair.consumer).await;
    src.release(&*pair.owner).await;
}

/// A remote range the key's registration does not cover is `OutOfRange`
/// (skipped for a backend whose keys bound nothing: the kit never asks such a
/// backend to read outside a registration).
///
/// # Cancel safety
/// Dropped mid-way, it leaks what it registered rather than free it.
pub async fn get_outside_the_remote_registration_is_out_of_range(pair: &BackendPair) {
    if !pair.capabilities.remote_bounds_enforced {
        tracing::info!("remote bounds are not enforced by this backend: check skipped");
        return;
    }
    let src = Mapped::filled(&*pair.owner, 100, source_byte).await;
    let dst = Mapped::filled(&*pair.consumer, 4096, |_| FILL).await;
    let base = src.addr();
    let cases: [(&str, u64, u64); 5] = [
        ("starting at the registered length", base + 100, 1),
        ("ending one byte past the registration", base, 101),
        ("starting one byte before the registration", base - 1, 2),
        ("far past the registration", base + (1 << 30), 8),
        ("whose end overflows", u64::MAX - 1, 2),
    ];
    for (what, remote_addr, len) in cases {
        let mut request = get_request(pair, &src, 0, &dst, 0, len);
        request.remote_addr = remote_addr;
        assert_eq!(
            kit_get(&*pair.consumer, request).await,
            Err(RdmaError::OutOfRange),
            "GET of a remote range {what}"
        );
        assert_copied(&dst.buf.snapshot(), 0, 0, 0, &format!("after a GET {what}"));
    }
    dst.release(&*pair.consumer).await;
    src.release(&*pair.owner).await;
}

/// A destination id that names no local registration — never mapped, or
/// already unmapped — is `RegionNotFound`.
///
/// # Cancel safety
/// Dropped mid-way, it leaks what it registered rather than free it.
pub async fn get_into_an_unknown_local_region_is_region_not_found(pair: &BackendPair) {
    let src = Mapped::filled(&*pair.owner, 4096, source_byte).await;
    let dst = Mapped::filled(&*pair.consumer, 4096, |_| FILL).await;
    let gone = Mapped::filled(&*pair.consumer, 4096, |_| FILL).await;
    let gone_id = gone.id();
    gone.release(&*pair.consumer).await;

    let never = [u64::MAX, 0]
        .into_iter()
        .find(|&id| id != dst.id() && id != gone_id)
        .expect("two distinct candidate ids");
    for (what, id) in [("never mapped", never), ("already unmapped", gone_id)] {
        let mut request = get_request(pair, &src, 0, &dst, 0, 64);
        request.local_region_id = id;
        assert_eq!(
            kit_get(&*pair.consumer, request).await,
            Err(RdmaError::RegionNotFound),
            "GET into a local region {what}"
        );
    }
    dst.release(&*pair.consumer).await;
    src.release(&*pair.owner).await;
}

/// A GET naming a peer the consumer was never told about is `NotConfigured`.
///
/// # Cancel safety
/// Dropped mid-way, it leaks what it registered rather than free it.
pub async fn get_from_an_unknown_peer_is_not_configured(pair: &BackendPair) {
    let src = Mapped::filled(&*pair.owner, 4096, source_byte).await;
    let dst = Mapped::filled(&*pair.consumer, 4096, |_| FILL).await;
    let mut request = get_request(pair, &src, 0, &dst, 0, 64);
    request.peer = unknown_peer(pair);
    assert_eq!(
        kit_get(&*pair.consumer, request).await,
        Err(RdmaError::NotConfigured),
        "GET from an unknown peer"
    );
    assert_copied(
        &dst.buf.snapshot(),
        0,
        0,
        0,
        "after a GET from an unknown peer",
    );
    dst.release(&*pair.consumer).await;
    src.release(&*pair.owner).await;
}
