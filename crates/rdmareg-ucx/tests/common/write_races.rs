//! What the direct-write races share: the sentinel an unmapped target
//! holds, a bounded unmap and wait, the varying pause that puts an unmap
//! at every point of a PUT, and a task posting one batch of PUTs in a
//! loop while a registration goes away under it.

#![allow(dead_code)] // Each test binary uses its own subset.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use rdmareg_backend::RdmaBackend;
use rdmareg_core::{BackendPut, BackendRegion, RdmaError};
use rdmareg_ucx::UcxBackend;

/// What the memory holds once its unmap answered.
pub const SENTINEL: u8 = 0x3C;

/// The longest an unmap may take while no writer is stopped.
pub const UNMAP_BOUND: Duration = Duration::from_secs(5);

/// Yields until `done` holds; fails the test if it does not within the
/// unmap bound (a task that panicked never makes it hold).
pub async fn until(done: impl Fn() -> bool, what: &str) {
    let deadline = Instant::now() + UNMAP_BOUND;
    while !done() {
        assert!(Instant::now() < deadline, "waited in vain for {what}");
        tokio::task::yield_now().await;
    }
}

/// A short, varying pause before the unmap, so that it lands at every
/// point of a PUT: before its lock, during its copy, after it.
pub async fn pause_for(iteration: usize) {
    match iteration % 4 {
        0 => tokio::task::yield_now().await,
        1 => tokio::time::sleep(Duration::from_micros(50)).await,
        2 => tokio::time::sleep(Duration::from_micros(300)).await,
        _ => {
            let spin_until = Instant::now() + Duration::from_micros(20 * (iteration % 7) as u64);
            while Instant::now() < spin_until {
                std::hint::spin_loop();
            }
        }
    }
}

/// Unmaps `region` on `owner`, bounded: no writer is stopped, so the
/// unmap must answer.
pub async fn unmap_bounded(owner: &UcxBackend, region: &BackendRegion) {
    let unmap = owner.unmap(region.backend_region_id);
    let answered = tokio::time::timeout(UNMAP_BOUND, unmap)
        .await
        .expect("an unmap with no stopped writer answers");
    assert_eq!(answered, Ok(()));
}

/// A task posting `requests` as one batch in a loop until stopped. Entries
/// at odd places carry stale keys and must be refused `RegionNotFound`;
/// the others land, or are refused the same once their registration went.
pub struct BatchRace {
    stop: Arc<AtomicBool>,
    batches: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl BatchRace {
    /// Starts the loop on `writer`.
    ///
    /// # Safety
    /// Every request's source stays mapped and readable until
    /// [`stop`](Self::stop) returned.
    pub unsafe fn start(writer: &Arc<UcxBackend>, requests: Vec<BackendPut>) -> BatchRace {
        let stop = Arc::new(AtomicBool::new(false));
        let batches = Arc::new(AtomicU64::new(0));
        let task = {
            let (writer, stop, batches) =
                (Arc::clone(writer), Arc::clone(&stop), Arc::clone(&batches));
            tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    // SAFETY: `start`'s contract: the sources outlive this
                    // task, which `stop` awaits.
                    let results = unsafe { writer.put_batch(requests.clone()) }.await;
                    for (at, result) in results.iter().enumerate() {
                        if at % 2 == 1 {
                            assert_eq!(*result, Err(RdmaError::RegionNotFound), "a stale key");
                        } else {
                            assert!(
                                matches!(result, Ok(()) | Err(RdmaError::RegionNotFound)),
                                "{result:?}"
                            );
                        }
                    }
                    batches.fetch_add(1, Ordering::Relaxed);
                    tokio::task::yield_now().await;
                }
            })
        };
        BatchRace {
            stop,
            batches,
            task,
        }
    }

    /// Batches answered so far.
    pub fn batches(&self) -> u64 {
        self.batches.load(Ordering::Relaxed)
    }

    /// Waits for `more` batches past those answered now.
    pub async fn wait_for(&self, more: u64, what: &str) {
        let seen = self.batches();
        until(|| self.batches() >= seen + more, what).await;
    }

    /// Stops the loop and waits for its task, which fails the test if an
    /// answer was wrong.
    pub async fn stop(self) {
        self.stop.store(true, Ordering::Relaxed);
        self.task.await.expect("the batch task ended cleanly");
    }
}
