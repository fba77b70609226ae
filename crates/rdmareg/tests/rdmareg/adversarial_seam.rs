//! Safe code against the facade's memory promises: what the owner of a
//! buffer lent to peers' reads can do to the bytes a peer is reading.
//!
//! The owner's engine reads a lent buffer's bytes on its progress thread
//! whenever a peer asks. Safe code writing them meanwhile would be a data
//! race; the API makes that impossible: `PinnedBuf::describe` consumes the
//! buffer and answers a read-only `DescribedBuf`, and the writable buffer
//! comes back only from `withdraw`, after the key is dead and the reads
//! being served are done.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rdmareg::registry::RdmaConfig;
use rdmareg::{Config, PeerId, Rdma, RdmaError, Transport};

fn config() -> Config {
    Config::new()
        .with_transport(Transport::Tcp)
        .with_net_devices("lo")
        .with_registry(
            RdmaConfig::default()
                .with_budget_bytes(256 << 20)
                .with_shutdown_budget(Duration::from_secs(5)),
        )
}

const OWNER: PeerId = PeerId(7);
const LEN: usize = 1 << 20;

/// The owner keeps rewriting a buffer it lends to a peer (all 0x11, then all
/// 0x22, ...). Safe code can only write it after withdrawing it, which kills
/// its descriptors before handing back `&mut`; so each of the peer's reads
/// either sees one fill whole or is refused with a typed error, never a
/// torn mix. (A `DescribedBuf` has no `DerefMut`: writing it while described
/// does not compile, see the `DescribedBuf` docs.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lent_buffer_is_rewritten_only_after_withdrawal_so_no_peer_read_is_torn() {
    let owner = Rdma::start(config()).expect("owner starts");
    let consumer = Rdma::start(config()).expect("consumer starts");
    consumer
        .add_peer(OWNER, owner.worker_address())
        .expect("peer");
    let mut source = owner.registry().alloc_pinned(LEN).await.expect("alloc");
    source.fill(0x11);
    let lent = source.describe().await.expect("described");
    let current = Arc::new(Mutex::new(lent.descriptor()));
    let stop = Arc::new(AtomicBool::new(false));
    let rewrites = Arc::new(AtomicUsize::new(0));
    let writer = tokio::spawn({
        let (stop, current, rewrites) = (
            Arc::clone(&stop),
            Arc::clone(&current),
            Arc::clone(&rewrites),
        );
        async move {
            let mut lent = lent;
            let mut value = 0x11u8;
            while !stop.load(Ordering::Relaxed) {
                let mut writable = lent.withdraw().await.expect("withdrawn");
                value ^= 0x33;
                writable.fill(value);
                lent = writable.describe().await.expect("described again");
                *current.lock().unwrap() = lent.descriptor();
                rewrites.fetch_add(1, Ordering::Relaxed);
                // Lent for a moment, so that some reads land whole and some
                // meet a withdrawal.
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            lent
        }
    });
    let mut dest = consumer.registry().alloc_pinned(LEN).await.expect("alloc");
    let (mut torn, mut reads, mut refused) = (0, 0, 0);
    for _ in 0..200 {
        let descriptor = current.lock().unwrap().clone();
        match consumer
            .registry()
            .get_into(OWNER, &descriptor, &mut dest, 0)
            .await
        {
            Ok(()) => {
                reads += 1;
                if !dest.iter().all(|&b| b == dest[0]) {
                    torn += 1;
                }
            }
            Err(RdmaError::RegionNotFound) => refused += 1,
            Err(other) => panic!("a withdrawn descriptor's read answered {other}"),
        }
    }
    stop.store(true, Ordering::Relaxed);
    let lent = writer.await.expect("writer");
    drop(lent);
    drop(dest);
    let owner_summary = owner.shutdown().await;
    let consumer_summary = consumer.shutdown().await;
    eprintln!(
        "{reads} reads whole, {refused} refused as withdrawn, {} rewrites",
        rewrites.load(Ordering::Relaxed)
    );
    assert!(reads > 0, "no read succeeded");
    assert!(
        rewrites.load(Ordering::Relaxed) > 0,
        "the owner never rewrote the buffer"
    );
    assert!(owner_summary.is_clean() && consumer_summary.is_clean());
    assert_eq!(torn, 0, "{torn} of {reads} reads were torn");
}
