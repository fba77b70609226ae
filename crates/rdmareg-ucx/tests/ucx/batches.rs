//! Batches through the UCX engine: one command for many reads, each entry
//! answered as its own read would be, on every lane.

use crate::common;

use common::*;
use rdmareg_core::{PeerId, RdmaError};
use rdmareg_ucx::{Transport, UcxEngine};

const ENTRIES: usize = 1000;
const ENTRY: usize = 64;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_small_reads_in_one_batch_each_land_in_their_place() {
    for transport in [
        Transport::Tcp,
        Transport::SameHost,
        Transport::SharedMemoryNoErrorHandling,
    ] {
        let (owner, consumer) = engines(transport.clone());
        let (ob, cb) = (owner.backend(), consumer.backend());
        let src = PageBuf::filled(ENTRIES * ENTRY, pattern);
        let dst = PageBuf::zeroed(ENTRIES * ENTRY);
        let src_region = map(&ob, &src).await;
        let dst_region = map(&cb, &dst).await;
        let descriptor = describe(&src, &src_region);
        // Entry i reads source block i into destination block ENTRIES-1-i.
        let requests = (0..ENTRIES)
            .map(|i| {
                let part = descriptor
                    .slice((i * ENTRY) as u64, ENTRY as u64)
                    .expect("inside the descriptor");
                get_request(
                    OWNER,
                    &part,
                    &dst_region,
                    ((ENTRIES - 1 - i) * ENTRY) as u64,
                    None,
                )
            })
            .collect();
        let answers = cb.get_batch_into_test_memory(requests).await;
        assert_eq!(answers, vec![Ok(()); ENTRIES], "{transport:?}");
        let (got, want) = (dst.snapshot(), src.snapshot());
        for i in 0..ENTRIES {
            let j = ENTRIES - 1 - i;
            assert!(
                got[j * ENTRY..(j + 1) * ENTRY] == want[i * ENTRY..(i + 1) * ENTRY],
                "{transport:?}: block {i}"
            );
        }
        consumer.shutdown().await;
        owner.shutdown().await;
        assert_eq!(consumer.live_registrations(), Some(0));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_across_a_live_owner_and_a_gone_one_answers_each_by_its_owner() {
    let (owner, consumer) = engines(Transport::Tcp);
    let gone = UcxEngine::start(config(Transport::Tcp)).expect("second owner starts");
    const GONE: PeerId = PeerId(7);
    consumer.add_peer(GONE, gone.worker_address()).unwrap();
    let (ob, gb, cb) = (owner.backend(), gone.backend(), consumer.backend());
    let src = PageBuf::filled(4096, pattern);
    let other = PageBuf::filled(4096, |_| 0x42);
    let dst = PageBuf::zeroed(8192);
    let src_region = map(&ob, &src).await;
    let other_region = map(&gb, &other).await;
    let dst_region = map(&cb, &dst).await;
    let live = get_request(OWNER, &describe(&src, &src_region), &dst_region, 0, None);
    let mut dead = get_request(
        GONE,
        &describe(&other, &other_region),
        &dst_region,
        4096,
        None,
    );
    dead.deadline = Some(std::time::Duration::from_secs(3));
    gone.shutdown().await;
    let answers = cb.get_batch_into_test_memory(vec![live, dead]).await;
    assert_eq!(answers[0], Ok(()), "the live owner's entry");
    assert!(
        matches!(answers[1], Err(RdmaError::Backend(_) | RdmaError::Timeout)),
        "the gone owner's entry: {:?}",
        answers[1]
    );
    let got = dst.snapshot();
    assert!(got[..4096] == src.snapshot()[..]);
    assert!(
        got[4096..].iter().all(|&b| b == 0),
        "nothing of the gone owner landed"
    );
    consumer.shutdown().await;
    owner.shutdown().await;
}
