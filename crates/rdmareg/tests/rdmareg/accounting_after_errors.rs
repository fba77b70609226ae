//! Every refused call leaves the books as they were: over real UCX engines
//! (tcp on the loopback interface), a run of bad requests — empty, too
//! large, foreign, stale, to an unknown peer, cut short by cancellation —
//! changes neither the registered bytes nor the live counts, and the
//! shutdown afterwards is clean.

use std::time::Duration;

use rdmareg::registry::RdmaConfig;
use rdmareg::{Config, PeerId, Rdma, RdmaError, Transport};

fn config(budget: u64) -> Config {
    Config::new()
        .with_transport(Transport::Tcp)
        .with_net_devices("lo")
        .with_get_deadline(Duration::from_secs(5))
        .with_registry(
            RdmaConfig::default()
                .with_budget_bytes(budget)
                .with_shutdown_budget(Duration::from_secs(5)),
        )
}

const OWNER: PeerId = PeerId(1);

/// The figures that must not move when a call is refused.
fn books(rdma: &Rdma) -> (u64, usize, usize, usize, u64) {
    let s = rdma.stats();
    (
        s.registered_bytes,
        s.live_regions,
        s.live_allocations,
        s.transfers_in_flight,
        s.leaked_bytes,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_and_cancelled_calls_leave_the_budget_and_counts_where_they_were() {
    let owner = Rdma::start(config(64 << 20)).expect("owner starts");
    let consumer = Rdma::start(config(64 << 20)).expect("consumer starts");
    consumer
        .add_peer(OWNER, owner.worker_address())
        .expect("peer");
    let source = owner
        .register_owned(vec![7u8; 64 * 1024].into_boxed_slice())
        .await
        .expect("registers");
    let descriptor = source.descriptor().expect("descriptor");
    let mut dst = consumer.alloc_pinned(64 * 1024).await.expect("allocates");
    consumer
        .get(OWNER, &descriptor, &mut dst)
        .await
        .expect("an honest read");
    let (owner_before, consumer_before) = (books(&owner), books(&consumer));

    // Refusals before anything is registered or submitted.
    let empty = owner.register_owned(Vec::new().into_boxed_slice()).await;
    assert!(matches!(empty, Err(ref e) if e.error == RdmaError::OutOfRange));
    let huge = owner
        .register_owned(vec![0u8; 65 << 20].into_boxed_slice())
        .await;
    assert!(matches!(
        huge,
        Err(ref e) if matches!(e.error, RdmaError::BudgetExceeded { .. })
    ));
    assert_eq!(
        consumer.alloc_pinned(0).await.err(),
        Some(RdmaError::OutOfRange)
    );
    let too_long = descriptor.slice(0, 64 * 1024).expect("slice");
    assert_eq!(
        consumer.get_into(OWNER, &too_long, &mut dst, 1).await,
        Err(RdmaError::DestinationTooSmall {
            needed: 64 * 1024 + 1,
            available: 64 * 1024,
        })
    );
    assert_eq!(
        consumer.get(PeerId(99), &descriptor, &mut dst).await,
        Err(RdmaError::NotConfigured)
    );
    let list = {
        let mut list = consumer.transfer_list(OWNER);
        list.push(&descriptor, 3, 0).expect("push");
        list
    };
    assert_eq!(
        consumer
            .post(&list, std::slice::from_mut(&mut dst))
            .await
            .err(),
        Some(RdmaError::MissingBuffers {
            needed: 4,
            given: 1
        })
    );

    // A read of a region that was unregistered: refused by the owner.
    let gone = owner
        .register_owned(vec![9u8; 4096].into_boxed_slice())
        .await
        .expect("registers");
    let stale = gone.descriptor().expect("descriptor");
    gone.unregister_owned(Duration::from_secs(5))
        .await
        .expect("unregisters");
    assert_eq!(
        consumer.get(OWNER, &stale, &mut dst).await,
        Err(RdmaError::RegionNotFound)
    );

    // A read cancelled mid-flight: its buffer is surrendered, and its slot
    // comes back when the transfer is over.
    let mut cancelled = consumer.alloc_pinned(64 * 1024).await.expect("allocates");
    let get = consumer.get(OWNER, &descriptor, &mut cancelled);
    let _ = tokio::time::timeout(Duration::from_micros(1), get).await;
    drop(cancelled);
    for _ in 0..200 {
        if books(&consumer) == consumer_before {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    let (owner_after, consumer_after) = (books(&owner), books(&consumer));
    drop(dst);
    drop(source);
    let (owner_summary, consumer_summary) = (owner.shutdown().await, consumer.shutdown().await);
    assert_eq!(
        owner_after, owner_before,
        "owner: (registered bytes, regions, allocations, transfers, leaked)"
    );
    assert_eq!(
        consumer_after, consumer_before,
        "consumer: (registered bytes, regions, allocations, transfers, leaked)"
    );
    assert!(owner_summary.is_clean(), "{owner_summary:?}");
    assert!(consumer_summary.is_clean(), "{consumer_summary:?}");
}
