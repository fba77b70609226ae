//! Safe code against the facade's memory promises: what a described pool
//! buffer's owner can do to the bytes a peer is reading.
//!
//! `PinnedBuf::describe` lends the buffer's bytes to peers' reads for as long
//! as the buffer lives, and `PinnedBuf` still hands out `&mut [u8]`
//! (`DerefMut`) meanwhile. The owner's engine reads those bytes on its
//! progress thread (UCX copies or sends them) while safe code may be writing
//! them through that `&mut`: two threads, one writing and one reading the
//! same bytes with no ordering between them, which the Rust memory model
//! calls a data race. The test below makes it visible as a torn read.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use rdmareg::{Config, PeerId, Rdma, RdmaConfig, Transport};

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

/// While safe code on the owner keeps rewriting a described pool buffer
/// through `DerefMut` (all 0x11, then all 0x22, ...), every read a peer
/// makes of it should see one of the two fills whole. On main the owner's
/// engine reads the bytes while they are being written, and reads come
/// back torn (part 0x11, part 0x22): the `&mut` safe code holds is not the
/// only access to those bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "known defect: a described PinnedBuf still derefs mutably, so safe code writes bytes \
            the owner's engine is reading for a peer (a data race; reads come back torn)"]
async fn safe_writes_to_a_described_pool_buffer_never_race_a_peers_read_of_it() {
    let owner = Rdma::start(config()).expect("owner starts");
    let consumer = Rdma::start(config()).expect("consumer starts");
    consumer
        .add_peer(OWNER, owner.worker_address())
        .expect("peer");
    let mut source = owner.registry().alloc_pinned(LEN).await.expect("alloc");
    source.fill(0x11);
    let descriptor = source.describe().await.expect("described");
    let stop = Arc::new(AtomicBool::new(false));
    let writer = std::thread::spawn({
        let stop = Arc::clone(&stop);
        move || {
            let mut value = 0x11u8;
            while !stop.load(Ordering::Relaxed) {
                value ^= 0x33;
                source.fill(value);
            }
            source
        }
    });
    let mut dest = consumer.registry().alloc_pinned(LEN).await.expect("alloc");
    let mut torn = 0;
    let mut reads = 0;
    for _ in 0..40 {
        if consumer
            .registry()
            .get_into(OWNER, &descriptor, &mut dest, 0)
            .await
            .is_ok()
        {
            reads += 1;
            if !dest.iter().all(|&b| b == dest[0]) {
                torn += 1;
            }
        }
    }
    stop.store(true, Ordering::Relaxed);
    let source = writer.join().expect("writer");
    drop(source);
    drop(dest);
    let owner_summary = owner.shutdown().await;
    let consumer_summary = consumer.shutdown().await;
    assert!(reads > 0, "no read succeeded");
    assert!(owner_summary.is_clean() && consumer_summary.is_clean());
    assert_eq!(torn, 0, "{torn} of {reads} reads were torn");
}
