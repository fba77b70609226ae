//! An owner and a consumer engine with a [`pattern`](super::pattern)
//! source mapped on the owner: what the tests of reads under attack read
//! from, and how they end (the owner's replies settled, the source
//! unmapped, both engines shut down with nothing registered).

#![allow(dead_code)] // Each test binary uses its own subset.

use std::sync::Arc;
use std::time::{Duration, Instant};

use rdmareg_backend::RdmaBackend;
use rdmareg_core::{BackendRegion, Descriptor};
use rdmareg_ucx::{UcxBackend, UcxEngine};

use super::{PageBuf, describe, map, pattern};

/// The length of a [`Scene`]'s source.
pub const SOURCE_LEN: usize = 1024 * 1024;

/// Which engine of an owner and a consumer goes away mid-read.
#[derive(Debug, Clone, Copy)]
pub enum Gone {
    Consumer,
    Owner,
}

/// Waits up to 5 s for the owner to see its last reply sends complete.
pub async fn owner_settles(owner: &UcxEngine, what: &str) {
    let until = Instant::now() + Duration::from_secs(5);
    while owner.served_replies_in_flight() != 0 && Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert_eq!(
        owner.served_replies_in_flight(),
        0,
        "{what}: replies left in flight"
    );
}

/// Unmaps the owner's source region mid-stream (it must answer `Ok`),
/// checks no reply is in flight once the unmap confirmed, zeroes the
/// source the moment it did and tells the readers (`unmapped`).
pub async fn unmap_and_zero_source(
    owner: &UcxEngine,
    source_region: u64,
    src: &PageBuf,
    unmapped: &std::sync::atomic::AtomicBool,
    what: &str,
) {
    assert_eq!(owner.backend().unmap(source_region).await, Ok(()));
    assert_eq!(
        owner.served_replies_in_flight(),
        0,
        "{what}: the unmap confirmed with replies in flight"
    );
    src.fill(0);
    unmapped.store(true, std::sync::atomic::Ordering::Release);
}

/// Shuts both engines down and checks neither holds a registration.
pub async fn shut_down_clean(owner: UcxEngine, consumer: UcxEngine, what: &str) {
    consumer.shutdown().await;
    owner.shutdown().await;
    assert_eq!(consumer.live_registrations(), Some(0), "{what}: consumer");
    assert_eq!(owner.live_registrations(), Some(0), "{what}: owner");
}

/// An owner and a consumer engine with a [`SOURCE_LEN`]-byte
/// [`pattern`](super::pattern) source mapped on the owner.
///
/// The source buffer lives as long as the scene and is freed only after
/// both engines shut down, so it outlives its registration whether the
/// owner unmapped it or the shutdown ended it.
pub struct Scene {
    pub owner: UcxEngine,
    pub consumer: UcxEngine,
    /// The owner's backend.
    pub ob: Arc<UcxBackend>,
    /// The consumer's backend.
    pub cb: Arc<UcxBackend>,
    pub src: PageBuf,
    /// The source's bytes when it was mapped.
    pub want: Vec<u8>,
    pub src_region: BackendRegion,
    /// What the owner would send for the source.
    pub source: Descriptor,
}

impl Scene {
    /// Maps a fresh source on the owner of `engines`, an (owner, consumer)
    /// pair whose consumer knows the owner as [`OWNER`](super::OWNER).
    pub async fn new(engines: (UcxEngine, UcxEngine)) -> Scene {
        let (owner, consumer) = engines;
        let (ob, cb) = (owner.backend(), consumer.backend());
        let src = PageBuf::filled(SOURCE_LEN, pattern);
        let want = src.snapshot();
        let src_region = map(&ob, &src).await;
        let source = describe(&src, &src_region);
        Scene {
            owner,
            consumer,
            ob,
            cb,
            src,
            want,
            src_region,
            source,
        }
    }

    /// The usual end: waits for the owner's replies to settle (see
    /// [`owner_settles`]), checks the owner's unmap of the source answers
    /// `Ok`, then [`Scene::shut_down`].
    pub async fn end(self, what: &str) {
        owner_settles(&self.owner, what).await;
        assert_eq!(
            self.ob.unmap(self.src_region.backend_region_id).await,
            Ok(())
        );
        self.shut_down(what).await;
    }

    /// Shuts both engines down and checks neither holds a registration
    /// (see [`shut_down_clean`]); only then frees the source buffer.
    pub async fn shut_down(self, what: &str) {
        shut_down_clean(self.owner, self.consumer, what).await;
        drop(self.src);
    }
}
