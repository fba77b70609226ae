//! Checks of packed-key handling: malformed keys are refused before the
//! backend interprets them, and stale keys are detected where the backend can
//! tell (contract point 6).
//!
//! Every GET here names bytes inside a live registration, so a backend that
//! wrongly accepted a key would still read only memory the kit owns.

use bytes::Bytes;
use rdmareg_core::{MAX_PACKED_KEY_LEN, RdmaError};

use super::BackendPair;
use super::buffer::Mapped;
use super::support::{FILL, assert_copied, get_request, kit_get, source_byte};

/// Empty, garbage, truncated (every proper prefix of a real key), extended
/// (a real key plus a byte) and oversized keys are `InvalidKey`; nothing is
/// copied and nothing panics.
///
/// # Cancel safety
/// Dropped mid-way, it leaks what it registered rather than free it.
pub async fn malformed_keys_are_invalid_key(pair: &BackendPair) {
    let src = Mapped::filled(&*pair.owner, 4096, source_byte).await;
    let dst = Mapped::filled(&*pair.consumer, 4096, |_| FILL).await;
    let real = src.region.packed_key.clone();

    let mut keys: Vec<(String, Bytes)> = vec![("empty".into(), Bytes::new())];
    for len in [1, 7, 9, 33, 200] {
        keys.push((format!("{len} bytes of 0xFF"), Bytes::from(vec![0xFF; len])));
    }
    for cut in 1..real.len() {
        keys.push((
            format!("the real key cut to {cut} bytes"),
            real.slice(..cut),
        ));
    }
    let mut extended = real.to_vec();
    extended.push(0);
    keys.push(("the real key plus one byte".into(), Bytes::from(extended)));
    let mut oversized = real.to_vec();
    oversized.resize(MAX_PACKED_KEY_LEN + 1, 0xA5);
    keys.push((
        format!(
            "{} bytes starting with the real key",
            MAX_PACKED_KEY_LEN + 1
        ),
        Bytes::from(oversized),
    ));

    for (what, key) in keys {
        let mut request = get_request(pair, &src, 0, &dst, 0, 64);
        request.packed_key = key;
        assert_eq!(
            kit_get(&*pair.consumer, request).await,
            Err(RdmaError::InvalidKey),
            "GET with {what}"
        );
        assert_copied(
            &dst.buf.snapshot(),
            0,
            0,
            0,
            &format!("after a GET with {what}"),
        );
    }
    dst.release(&*pair.consumer).await;
    src.release(&*pair.owner).await;
}

/// A well-formed key whose registration was unmapped is refused with an
/// error (skipped for a backend that cannot tell: such a GET would read
/// memory that is no longer registered).
///
/// # Cancel safety
/// Dropped mid-way, it leaks what it registered rather than free it.
pub async fn stale_key_after_unmap_is_refused(pair: &BackendPair) {
    if !pair.capabilities.unknown_remote_key_detected {
        tracing::info!("this backend cannot detect stale keys: check skipped");
        return;
    }
    let src = Mapped::filled(&*pair.owner, 4096, source_byte).await;
    let dst = Mapped::filled(&*pair.consumer, 4096, |_| FILL).await;
    let request = get_request(pair, &src, 0, &dst, 0, 64);
    // Keep the source memory allocated: a backend that wrongly accepted the
    // stale key would still read only memory the kit owns.
    let src_buf = {
        let id = src.id();
        assert_eq!(pair.owner.unmap(id).await, Ok(()), "unmap of the source");
        src.confirm_unmapped()
    };
    let outcome = kit_get(&*pair.consumer, request).await;
    assert!(
        outcome.is_err(),
        "GET with a stale key returned {outcome:?}"
    );
    assert_copied(&dst.buf.snapshot(), 0, 0, 0, "after a GET with a stale key");
    dst.release(&*pair.consumer).await;
    drop(src_buf);
}
