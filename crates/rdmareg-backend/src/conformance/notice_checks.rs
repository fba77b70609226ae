//! Checks of notices (contract point 10): a notice reaches the owner only
//! after a read that succeeded, once and in send order, and bad notices
//! are typed errors. A backend without notices must say so.

use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use futures::stream::BoxStream;
use rdmareg_core::{MAX_NOTICE_BYTES, Notice, RdmaError};

use super::BackendPair;
use super::buffer::Mapped;
use super::support::{FILL, assert_copied, get_request, kit_get_with_notice, source_byte};

/// How long a notice may take to arrive.
const ARRIVAL: Duration = Duration::from_secs(10);

/// How long the kit waits to see that no notice arrives.
const SILENCE: Duration = Duration::from_millis(200);

/// The owner's notices, or `None` for a backend without them (checked to
/// refuse them as [`RdmaError::Unsupported`]).
async fn owner_notices(pair: &BackendPair) -> Option<BoxStream<'static, Notice>> {
    if !pair.capabilities.notices {
        assert!(
            matches!(pair.owner.notices(), Err(RdmaError::Unsupported { .. })),
            "a backend without notices refuses a stream of them as unsupported"
        );
        let sent = pair
            .consumer
            .send_notice(pair.owner_as_seen_by_consumer, Bytes::from_static(b"x"))
            .await;
        assert!(
            matches!(sent, Err(RdmaError::Unsupported { .. })),
            "a backend without notices refuses to send one as unsupported: {sent:?}"
        );
        return None;
    }
    Some(pair.owner.notices().expect("the owner's notices"))
}

/// The next notice, waiting at most [`ARRIVAL`].
async fn next(notices: &mut BoxStream<'static, Notice>, what: &str) -> Notice {
    match tokio::time::timeout(ARRIVAL, notices.next()).await {
        Ok(Some(notice)) => notice,
        Ok(None) => panic!("the owner's notices ended before {what}"),
        Err(_) => panic!("{what} did not arrive within {ARRIVAL:?}"),
    }
}

/// A GET with a notice copies its bytes, and the owner then receives the
/// notice with its bytes, from the sender the consumer names.
///
/// # Cancel safety
/// Dropped mid-way, it leaks what it registered rather than free it.
pub async fn a_notice_reaches_the_owner_after_its_read(pair: &BackendPair) {
    let Some(mut notices) = owner_notices(pair).await else {
        return;
    };
    let src = Mapped::filled(&*pair.owner, 8192, source_byte).await;
    let dst = Mapped::filled(&*pair.consumer, 8192, |_| FILL).await;
    let request = get_request(pair, &src, 100, &dst, 0, 4000);
    let result =
        kit_get_with_notice(&*pair.consumer, request, Bytes::from_static(b"read 1 done")).await;
    assert_eq!(result, Ok(()), "a GET with a notice");
    assert_copied(&dst.buf.snapshot(), 0, 100, 4000, "a GET with a notice");
    let notice = next(&mut notices, "the notice of a completed read").await;
    assert_eq!(&notice.bytes[..], b"read 1 done");
    assert_eq!(
        Some(notice.from),
        pair.consumer.notice_sender(),
        "the notice names the engine that sent it"
    );
    dst.release(&*pair.consumer).await;
    src.release(&*pair.owner).await;
}

/// A notice whose read failed never reaches the owner: a notice sent on
/// its own afterwards is the first the owner receives (a reader's notices
/// arrive in order, so a withheld one sent anyway would come first).
///
/// # Cancel safety
/// Dropped mid-way, it leaks what it registered rather than free it.
pub async fn a_notice_is_withheld_when_its_read_fails(pair: &BackendPair) {
    let Some(mut notices) = owner_notices(pair).await else {
        return;
    };
    let src = Mapped::filled(&*pair.owner, 4096, source_byte).await;
    let dst = Mapped::filled(&*pair.consumer, 100, |_| FILL).await;
    let past_the_destination = get_request(pair, &src, 0, &dst, 50, 100);
    assert_eq!(
        kit_get_with_notice(
            &*pair.consumer,
            past_the_destination,
            Bytes::from_static(b"withheld: out of range")
        )
        .await,
        Err(RdmaError::OutOfRange)
    );
    let mut unknown_destination = get_request(pair, &src, 0, &dst, 0, 10);
    unknown_destination.local_region_id = u64::MAX;
    assert_eq!(
        kit_get_with_notice(
            &*pair.consumer,
            unknown_destination,
            Bytes::from_static(b"withheld: no destination")
        )
        .await,
        Err(RdmaError::RegionNotFound)
    );
    assert_copied(&dst.buf.snapshot(), 0, 0, 0, "after the failed GETs");
    pair.consumer
        .send_notice(
            pair.owner_as_seen_by_consumer,
            Bytes::from_static(b"marker"),
        )
        .await
        .expect("a notice on its own");
    let first = next(&mut notices, "the marker").await;
    assert_eq!(
        &first.bytes[..],
        b"marker",
        "the first notice the owner received"
    );
    dst.release(&*pair.consumer).await;
    src.release(&*pair.owner).await;
}

/// Notices sent one after another arrive each once, in the order sent.
///
/// # Cancel safety
/// Cancel safe: it registers nothing.
pub async fn notices_arrive_once_and_in_send_order(pair: &BackendPair) {
    let Some(mut notices) = owner_notices(pair).await else {
        return;
    };
    const COUNT: u32 = 50;
    for n in 0..COUNT {
        pair.consumer
            .send_notice(
                pair.owner_as_seen_by_consumer,
                Bytes::from(n.to_le_bytes().to_vec()),
            )
            .await
            .expect("a notice");
    }
    for n in 0..COUNT {
        let notice = next(&mut notices, "each notice").await;
        assert_eq!(
            &notice.bytes[..],
            n.to_le_bytes(),
            "notice {n} in send order"
        );
    }
    assert!(
        tokio::time::timeout(SILENCE, notices.next()).await.is_err(),
        "no notice arrives twice"
    );
}

/// A notice over [`MAX_NOTICE_BYTES`] is refused as `NoticeTooLarge`, and
/// a GET carrying one reads nothing; one of exactly the bound arrives.
///
/// # Cancel safety
/// Dropped mid-way, it leaks what it registered rather than free it.
pub async fn an_oversized_notice_is_refused_before_anything_is_read(pair: &BackendPair) {
    let Some(mut notices) = owner_notices(pair).await else {
        return;
    };
    let too_large = Bytes::from(vec![7u8; MAX_NOTICE_BYTES + 1]);
    let refused = Err(RdmaError::NoticeTooLarge {
        length: MAX_NOTICE_BYTES as u64 + 1,
    });
    let src = Mapped::filled(&*pair.owner, 4096, source_byte).await;
    let dst = Mapped::filled(&*pair.consumer, 4096, |_| FILL).await;
    let request = get_request(pair, &src, 0, &dst, 0, 4096);
    assert_eq!(
        kit_get_with_notice(&*pair.consumer, request, too_large.clone()).await,
        refused
    );
    assert_copied(&dst.buf.snapshot(), 0, 0, 0, "after a refused notice");
    assert_eq!(
        pair.consumer
            .send_notice(pair.owner_as_seen_by_consumer, too_large)
            .await,
        refused
    );
    let largest = Bytes::from(vec![9u8; MAX_NOTICE_BYTES]);
    pair.consumer
        .send_notice(pair.owner_as_seen_by_consumer, largest.clone())
        .await
        .expect("a notice of exactly the bound");
    assert_eq!(
        next(&mut notices, "the largest notice").await.bytes,
        largest
    );
    dst.release(&*pair.consumer).await;
    src.release(&*pair.owner).await;
}

/// A notice to a peer the consumer was never told about is
/// `NotConfigured`.
///
/// # Cancel safety
/// Cancel safe: it registers nothing.
pub async fn a_notice_to_an_unknown_peer_is_not_configured(pair: &BackendPair) {
    if owner_notices(pair).await.is_none() {
        return;
    }
    let unknown = super::support::unknown_peer(pair);
    assert_eq!(
        pair.consumer
            .send_notice(unknown, Bytes::from_static(b"nobody"))
            .await,
        Err(RdmaError::NotConfigured)
    );
}
