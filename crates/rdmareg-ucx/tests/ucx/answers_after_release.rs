//! A read is answered only once UCX has let go of its destination: after
//! any error answer — deadline, the consumer's own shutdown, the owner going
//! away — the destination is the caller's again, and nothing lands in it
//! later. Each case fills the destination after the answer, waits, and
//! checks that no byte changed.

use crate::common;

use std::time::Duration;

use common::*;
use rdmareg_ucx::Transport;

const MIB: usize = 1024 * 1024;
const LEN: usize = 64 * MIB;
/// Long enough for any straggling fragment of a 64 MiB transfer.
const WATCH: Duration = Duration::from_millis(300);

fn transports() -> [Transport; 3] {
    [
        Transport::Tcp,
        Transport::SameHost,
        Transport::SharedMemoryNoErrorHandling,
    ]
}

/// Overwrites `buf` with `0xEE`, waits, and asserts it still holds only
/// that: nothing wrote into it after the answer.
async fn assert_quiet_after_answer(buf: &PageBuf, what: &str) {
    buf.fill(0xEE);
    tokio::time::sleep(WATCH).await;
    let changed = buf.snapshot().iter().filter(|&&b| b != 0xEE).count();
    assert_eq!(
        changed, 0,
        "{what}: {changed} bytes written after the answer"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_lands_after_a_deadline_answer() {
    for transport in transports() {
        let (owner, consumer) = engines(transport.clone());
        let (ob, cb) = (owner.backend(), consumer.backend());
        let src = PageBuf::filled(LEN, pattern);
        let dst = PageBuf::zeroed(LEN);
        let src_region = map(&ob, &src).await;
        let dst_region = map(&cb, &dst).await;
        let request = get_request(
            OWNER,
            &describe(&src, &src_region),
            &dst_region,
            0,
            Some(Duration::from_millis(2)),
        );
        // The answer is the real outcome: a receive that was already
        // running when the deadline passed and finished anyway (cma moves
        // 64 MiB in a few ms) answers `Ok`. Over tcp 64 MiB cannot arrive in
        // 2 ms, so there the deadline answer itself is exercised.
        let outcome = cb.get_into_test_memory(request).await;
        match (&transport, &outcome) {
            (Transport::Tcp, _) => assert_eq!(outcome, Err(rdmareg_core::RdmaError::Timeout)),
            (_, Ok(())) => assert!(dst.snapshot() == src.snapshot(), "an Ok read is whole"),
            (_, other) => assert_eq!(other, &Err(rdmareg_core::RdmaError::Timeout)),
        }
        assert_quiet_after_answer(&dst, &format!("deadline over {transport:?}")).await;
        consumer.shutdown().await;
        owner.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_lands_after_the_consumer_shuts_down_mid_read() {
    for transport in transports() {
        let (owner, consumer) = engines(transport.clone());
        let (ob, cb) = (owner.backend(), consumer.backend());
        let src = PageBuf::filled(LEN, pattern);
        let dst = PageBuf::zeroed(LEN);
        let src_region = map(&ob, &src).await;
        let dst_region = map(&cb, &dst).await;
        let request = get_request(OWNER, &describe(&src, &src_region), &dst_region, 0, None);
        let read = tokio::spawn({
            let cb = cb.clone();
            async move { cb.get_into_test_memory(request).await }
        });
        tokio::time::sleep(Duration::from_millis(5)).await;
        // The answer may come while the teardown still runs: the buffer is
        // the caller's from that moment, not from the end of the shutdown.
        let shutdown = tokio::spawn(async move {
            consumer.shutdown().await;
            consumer
        });
        let outcome = read.await.expect("the read task");
        match outcome {
            Ok(()) => assert!(dst.snapshot() == src.snapshot(), "an Ok read is whole"),
            Err(_) => {
                assert_quiet_after_answer(&dst, &format!("consumer shutdown over {transport:?}"))
                    .await
            }
        }
        drop(shutdown.await.expect("the shutdown task"));
        owner.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_lands_after_the_owner_goes_away_mid_read() {
    for transport in transports() {
        let (owner, consumer) = engines(transport.clone());
        let (ob, cb) = (owner.backend(), consumer.backend());
        let src = PageBuf::filled(LEN, pattern);
        let dst = PageBuf::zeroed(LEN);
        let src_region = map(&ob, &src).await;
        let dst_region = map(&cb, &dst).await;
        let request = get_request(
            OWNER,
            &describe(&src, &src_region),
            &dst_region,
            0,
            Some(Duration::from_secs(5)),
        );
        let read = tokio::spawn({
            let cb = cb.clone();
            async move { cb.get_into_test_memory(request).await }
        });
        tokio::time::sleep(Duration::from_millis(5)).await;
        let shutdown = tokio::spawn(async move {
            owner.shutdown().await;
            owner
        });
        let outcome = read.await.expect("the read task");
        match outcome {
            Ok(()) => assert!(dst.snapshot() == src.snapshot(), "an Ok read is whole"),
            Err(_) => {
                assert_quiet_after_answer(&dst, &format!("owner gone over {transport:?}")).await
            }
        }
        drop(shutdown.await.expect("the shutdown task"));
        consumer.shutdown().await;
    }
}
