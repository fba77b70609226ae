//! Checks of `get_batch` and `get_shared_batch` (contract point 9).

use std::sync::Arc;
use std::time::Duration;

use rdmareg_core::RdmaError;

use super::BackendPair;
use super::buffer::Mapped;
use super::support::{
    FILL, assert_copied, get_request, kit_get_batch, kit_get_shared_batch, poll_then_drop,
    source_byte, unknown_peer,
};

/// Entries of the batch checks: remote offset, local offset, bytes.
const ENTRIES: [(usize, usize, usize); 5] = [
    (0, 0, 1),
    (7, 4096, 4096),
    (100, 9000, 3000),
    (5, 20_000, 1 << 16),
    (0, 200_000, 300_000),
];
/// Source and destination length of the batch checks.
const BATCH_BUFFER: usize = 1 << 20;
/// Transfer size of the dropped-batch check.
const LARGE: usize = 4 << 20;

/// A batch writes every entry where it belongs and returns `Ok` for each,
/// in order, touching nothing between entries; an empty batch returns an
/// empty list.
///
/// # Cancel safety
/// Dropped mid-way, it leaks what it registered rather than free it.
pub async fn a_batch_writes_every_entry_and_returns_each_in_order(pair: &BackendPair) {
    assert_eq!(
        kit_get_batch(&*pair.consumer, Vec::new()).await,
        Vec::<Result<(), RdmaError>>::new(),
        "an empty batch"
    );
    let src = Mapped::filled(&*pair.owner, BATCH_BUFFER, source_byte).await;
    let dst = Mapped::filled(&*pair.consumer, BATCH_BUFFER, |_| FILL).await;
    let requests = ENTRIES
        .iter()
        .map(|&(remote, local, len)| {
            get_request(pair, &src, remote as u64, &dst, local as u64, len as u64)
        })
        .collect();
    let outcomes = kit_get_batch(&*pair.consumer, requests).await;
    assert_eq!(
        outcomes,
        vec![Ok(()); ENTRIES.len()],
        "outcomes of the batch"
    );
    let written = dst.buf.snapshot();
    let mut expected = vec![FILL; BATCH_BUFFER];
    for (remote, local, len) in ENTRIES {
        for i in 0..len {
            expected[local + i] = source_byte(remote + i);
        }
    }
    if let Some(at) = (0..BATCH_BUFFER).find(|&i| written[i] != expected[i]) {
        panic!(
            "batch destination: wrong byte at offset {at}: {} instead of {}",
            written[at], expected[at]
        );
    }
    dst.release(&*pair.consumer).await;
    src.release(&*pair.owner).await;
}

/// A shared batch completes every post as a fresh batch would.
///
/// Three posts write every entry and return `Ok`; once one of its two
/// destinations is unmapped, the next post refuses that destination's
/// entries with `RegionNotFound`, writes nothing there, and still writes
/// the others.
///
/// # Cancel safety
/// Dropped mid-way, it leaks what it registered rather than free it.
pub async fn a_shared_batch_completes_every_post_as_a_fresh_one_would(pair: &BackendPair) {
    let src = Mapped::filled(&*pair.owner, BATCH_BUFFER, source_byte).await;
    let first = Mapped::filled(&*pair.consumer, BATCH_BUFFER, |_| FILL).await;
    let second = Mapped::filled(&*pair.consumer, BATCH_BUFFER, |_| FILL).await;
    // Entries alternate between the two destinations, in neither the
    // source's nor the destinations' order.
    let into_second = |index: usize| index % 2 == 1;
    let requests: Arc<[_]> = ENTRIES
        .iter()
        .rev()
        .enumerate()
        .map(|(index, &(remote, local, len))| {
            let destination = if into_second(index) { &second } else { &first };
            get_request(
                pair,
                &src,
                remote as u64,
                destination,
                local as u64,
                len as u64,
            )
        })
        .collect();
    let expected = |into: &dyn Fn(usize) -> bool| {
        let mut expected = vec![FILL; BATCH_BUFFER];
        for (index, &(remote, local, len)) in ENTRIES.iter().rev().enumerate() {
            if into(index) {
                for i in 0..len {
                    expected[local + i] = source_byte(remote + i);
                }
            }
        }
        expected
    };
    let expected_first = expected(&|index| !into_second(index));
    let expected_second = expected(&into_second);
    for post in 0..3 {
        first.buf.overwrite(FILL);
        second.buf.overwrite(FILL);
        let outcomes = kit_get_shared_batch(&*pair.consumer, Arc::clone(&requests)).await;
        assert_eq!(
            outcomes,
            vec![Ok(()); ENTRIES.len()],
            "outcomes of post {post}"
        );
        assert!(
            first.buf.snapshot() == expected_first && second.buf.snapshot() == expected_second,
            "post {post} of a shared batch did not write every entry where it belongs"
        );
    }
    // The second destination unmapped, its memory kept to see that nothing
    // is written to it.
    let second_id = second.id();
    let unmapped = pair.consumer.unmap(second_id).await;
    assert_eq!(unmapped, Ok(()), "unmap of the second destination");
    let second = second.confirm_unmapped();
    second.overwrite(FILL);
    first.buf.overwrite(FILL);
    let outcomes = kit_get_shared_batch(&*pair.consumer, Arc::clone(&requests)).await;
    let refused: Vec<_> = (0..ENTRIES.len())
        .map(|index| {
            if into_second(index) {
                Err(RdmaError::RegionNotFound)
            } else {
                Ok(())
            }
        })
        .collect();
    assert_eq!(
        outcomes, refused,
        "a shared batch posted after one of its destinations was unmapped"
    );
    assert!(
        second.snapshot() == vec![FILL; BATCH_BUFFER],
        "a shared batch wrote into a destination unmapped before the post"
    );
    assert!(
        first.buf.snapshot() == expected_first,
        "the entries into the destination still mapped were not written"
    );
    drop(second);
    first.release(&*pair.consumer).await;
    src.release(&*pair.owner).await;
}

/// Bad entries of a batch get the typed error they would get alone.
///
/// A destination outside its mapping gets `OutOfRange`, an unknown destination
/// `RegionNotFound`, a malformed key `InvalidKey`, an unknown peer
/// `NotConfigured` — and the good entries around them are still written.
///
/// # Cancel safety
/// Dropped mid-way, it leaks what it registered rather than free it.
pub async fn a_batch_fails_each_entry_with_its_own_error(pair: &BackendPair) {
    let src = Mapped::filled(&*pair.owner, 8192, source_byte).await;
    let dst = Mapped::filled(&*pair.consumer, 8192, |_| FILL).await;
    let good_first = get_request(pair, &src, 0, &dst, 0, 100);
    let outside = get_request(pair, &src, 0, &dst, 8190, 100);
    let mut unknown_region = get_request(pair, &src, 0, &dst, 0, 10);
    unknown_region.local_region_id = dst.id().wrapping_add(1_000_000);
    let mut malformed = get_request(pair, &src, 0, &dst, 0, 10);
    malformed.packed_key = bytes::Bytes::from_static(&[0xFF; 3]);
    let mut stranger = get_request(pair, &src, 0, &dst, 0, 10);
    stranger.peer = unknown_peer(pair);
    let good_last = get_request(pair, &src, 4000, &dst, 4096, 4096);
    let outcomes = kit_get_batch(
        &*pair.consumer,
        vec![
            good_first,
            outside,
            unknown_region,
            malformed,
            stranger,
            good_last,
        ],
    )
    .await;
    assert_eq!(
        outcomes,
        vec![
            Ok(()),
            Err(RdmaError::OutOfRange),
            Err(RdmaError::RegionNotFound),
            Err(RdmaError::InvalidKey),
            Err(RdmaError::NotConfigured),
            Ok(()),
        ],
        "outcomes of a batch with bad entries"
    );
    let written = dst.buf.snapshot();
    assert_copied(&written[..4096], 0, 0, 100, "the first good entry");
    assert_copied(&written[4096..], 0, 4000, 4096, "the last good entry");
    dst.release(&*pair.consumer).await;
    src.release(&*pair.owner).await;
}

/// A dropped batch keeps its destinations until its transfers are over:
/// after an unmap of either returns `Ok(())`, its bytes do not change, and
/// each is untouched or the right source byte.
///
/// # Cancel safety
/// Dropped mid-way, it leaks what it registered rather than free it.
pub async fn a_dropped_batch_keeps_its_destinations_until_the_transfers_are_over(
    pair: &BackendPair,
) {
    let src = Mapped::filled(&*pair.owner, LARGE, source_byte).await;
    let first = Mapped::filled(&*pair.consumer, LARGE, |_| FILL).await;
    let second = Mapped::filled(&*pair.consumer, LARGE, |_| FILL).await;
    let half = (LARGE / 2) as u64;
    let requests = vec![
        get_request(pair, &src, 0, &first, 0, half),
        get_request(pair, &src, half, &first, half, half),
        get_request(pair, &src, 0, &second, 0, LARGE as u64),
    ];
    let consumer = Arc::clone(&pair.consumer);
    let batch = kit_get_batch(&*consumer, requests);
    let finished = poll_then_drop(batch, 2, Duration::from_micros(200)).await;
    if let Some(outcomes) = finished {
        assert_eq!(outcomes, vec![Ok(()); 3], "a batch that finished at once");
    }
    for (what, destination) in [("first", first), ("second", second)] {
        assert_eq!(
            pair.consumer.unmap(destination.id()).await,
            Ok(()),
            "unmap of the {what} destination of a dropped batch"
        );
        let buf = destination.confirm_unmapped();
        let at_unmap = buf.snapshot();
        for (i, &byte) in at_unmap.iter().enumerate() {
            assert!(
                byte == FILL || byte == source_byte(i),
                "{what} destination: byte {i} is {byte}, neither untouched nor the source's"
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(
            buf.snapshot() == at_unmap,
            "{what} destination changed after its unmap returned Ok"
        );
    }
    src.release(&*pair.owner).await;
}
