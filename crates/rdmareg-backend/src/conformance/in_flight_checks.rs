//! Checks of GETs in flight against unmaps of their destination.
//!
//! Contract point 4: a submitted unmap refuses new GETs, waits for the one
//! running, and after `Ok(())` nothing writes the memory. Transfers are
//! large enough to be in flight; the checks hold however the race falls.

use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use rdmareg_core::RdmaError;
use tokio::sync::oneshot;

use super::BackendPair;
use super::buffer::Mapped;
use super::support::{FILL, assert_copied, get_request, kit_get, poll_once, source_byte};

/// Transfer size of the in-flight checks.
const LARGE: usize = 8 << 20;
/// How long the destination is watched for late writes after its unmap.
const WATCH_FOR_LATE_WRITES: Duration = Duration::from_millis(50);

/// An unmapping destination refuses new GETs (`RegionNotFound`) and waits
/// for the one in flight, which completes with the right bytes before the
/// unmap returns `Ok(())`.
///
/// # Cancel safety
/// Dropped mid-way, it leaks what it registered rather than free it.
pub async fn unmapping_destination_refuses_new_gets_and_waits_for_the_one_in_flight(
    pair: &BackendPair,
) {
    let src = Mapped::filled(&*pair.owner, LARGE, source_byte).await;
    let dst = Mapped::filled(&*pair.consumer, LARGE, |_| FILL).await;

    let request = get_request(pair, &src, 0, &dst, 0, LARGE as u64);
    let consumer = Arc::clone(&pair.consumer);
    let (submitted_tx, submitted) = oneshot::channel();
    let transfer = tokio::spawn(async move {
        let mut get = kit_get(&*consumer, request);
        let first = futures::poll!(get.as_mut());
        let _ = submitted_tx.send(());
        match first {
            Poll::Ready(outcome) => outcome,
            Poll::Pending => get.await,
        }
    });
    submitted
        .await
        .expect("the GET task ended before submitting");

    let mut unmap = pair.consumer.unmap(dst.id());
    let unmap_first = futures::poll!(unmap.as_mut());

    let refused = kit_get(&*pair.consumer, get_request(pair, &src, 0, &dst, 0, 64)).await;
    assert_eq!(
        refused,
        Err(RdmaError::RegionNotFound),
        "a GET into a destination whose unmap was submitted"
    );

    let unmapped = match unmap_first {
        Poll::Ready(outcome) => outcome,
        Poll::Pending => unmap.await,
    };
    assert_eq!(
        unmapped,
        Ok(()),
        "unmap of a destination with a GET in flight"
    );
    let dst_buf = dst.confirm_unmapped();
    assert_copied(
        &dst_buf.snapshot(),
        0,
        0,
        LARGE,
        "destination when its unmap returned Ok",
    );
    let outcome = transfer.await.expect("the GET task panicked");
    assert_eq!(outcome, Ok(()), "the GET submitted before the unmap");
    src.release(&*pair.owner).await;
}

/// A dropped GET keeps its destination until its transfer is over: after
/// the unmap returns `Ok(())` the bytes do not change, and each is
/// untouched or the right source byte.
///
/// # Cancel safety
/// Dropped mid-way, it leaks what it registered rather than free it.
pub async fn dropped_get_keeps_the_destination_until_the_transfer_is_over(pair: &BackendPair) {
    let src = Mapped::filled(&*pair.owner, LARGE, source_byte).await;
    let dst = Mapped::filled(&*pair.consumer, LARGE, |_| FILL).await;

    let mut get = kit_get(
        &*pair.consumer,
        get_request(pair, &src, 0, &dst, 0, LARGE as u64),
    );
    let first = poll_once(get.as_mut());
    drop(get);

    let id = dst.id();
    assert_eq!(
        pair.consumer.unmap(id).await,
        Ok(()),
        "unmap of a destination whose GET was dropped"
    );
    let dst_buf = dst.confirm_unmapped();
    let at_unmap = dst_buf.snapshot();
    tokio::time::sleep(WATCH_FOR_LATE_WRITES).await;
    assert!(
        dst_buf.snapshot() == at_unmap,
        "the destination changed after its unmap returned Ok: the transfer outlived the registration"
    );
    for (i, &byte) in at_unmap.iter().enumerate() {
        assert!(
            byte == FILL || byte == source_byte(i),
            "destination byte {i} is {byte:#04x}: neither untouched nor the source byte"
        );
    }
    if let Poll::Ready(outcome) = first {
        assert_eq!(outcome, Ok(()), "the GET completed on its first poll");
        assert_copied(
            &at_unmap,
            0,
            0,
            LARGE,
            "destination of a GET that returned Ok",
        );
    }
    src.release(&*pair.owner).await;
}

/// Contract point 8: no byte is written to a destination after its GET
/// completed. A large GET with a far too short deadline completes
/// (`Timeout`, or `Ok`); bytes the caller writes afterwards stay.
///
/// # Cancel safety
/// Dropped mid-way, it leaks what it registered rather than free it.
pub async fn no_byte_is_written_after_a_get_completes(pair: &BackendPair) {
    const REWRITTEN: u8 = 0xC3;
    let src = Mapped::filled(&*pair.owner, LARGE, source_byte).await;
    let dst = Mapped::filled(&*pair.consumer, LARGE, |_| FILL).await;
    let mut request = get_request(pair, &src, 0, &dst, 0, LARGE as u64);
    request.deadline = Some(Duration::from_micros(1));
    let outcome = kit_get(&*pair.consumer, request).await;
    assert!(
        matches!(outcome, Ok(()) | Err(RdmaError::Timeout)),
        "a GET past its deadline returned {outcome:?}"
    );
    if outcome.is_ok() {
        assert_copied(&dst.buf.snapshot(), 0, 0, LARGE, "an Ok GET");
    }
    dst.buf.overwrite(REWRITTEN);
    tokio::time::sleep(WATCH_FOR_LATE_WRITES).await;
    // Also wait for what the backend says still uses the destination: on a
    // loaded machine such a transfer may outlast the watch window.
    let started = std::time::Instant::now();
    while pair
        .consumer
        .transfers_in_flight(dst.id())
        .is_some_and(|n| n > 0)
        && started.elapsed() < Duration::from_secs(10)
    {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let late = dst
        .buf
        .snapshot()
        .iter()
        .filter(|&&byte| byte != REWRITTEN)
        .count();
    assert_eq!(
        late, 0,
        "{late} bytes were written to the destination after the GET returned {outcome:?}"
    );
    dst.release(&*pair.consumer).await;
    src.release(&*pair.owner).await;
}
