//! Descriptor leases on a registered region: a descriptor handed out with
//! an expiry and a number of readers, and the owner's wait for them.
//!
//! [`RegionGuard::lease`] asks the backend for a lease key and returns a
//! [`LeasedDescriptor`]; each reader reads with it and then calls
//! `Registry::release_lease`. [`RegionGuard::readers_done`] resolves
//! once every lease handed out so far ended: released by as many readers
//! as it allowed, or expired. A lease cannot outlive its expiry, so the
//! wait is bounded even when a reader vanishes or its release is lost
//! (releases, like notices, are not acknowledged).
//!
//! Ending a lease stops new reads under it; a read the owner admitted
//! just before still runs, and the unmap waits for it as for any read
//! (contract point 4), so [`RegionGuard::unregister_after_readers`] is
//! safe to call the moment the readers are done.

use std::future::Future;
use std::time::{Duration, Instant};

use futures::FutureExt;
use futures::future::{BoxFuture, Shared};
use parking_lot::Mutex;
use rdmareg_core::{Descriptor, LeaseEnd, LeaseTerms, RdmaError};

use super::{RegionGuard, UnregisterOutcome};

/// A descriptor of a whole region handed out under a lease: reads with it
/// fail [`RdmaError::LeaseExpired`] once the lease ended. Cut a range with
/// [`Descriptor::slice`]; the lease covers every range.
#[derive(Clone)]
pub struct LeasedDescriptor {
    descriptor: Descriptor,
    terms: LeaseTerms,
    end: LeaseWait,
}

impl std::fmt::Debug for LeasedDescriptor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LeasedDescriptor")
            .field("descriptor", &self.descriptor)
            .field("terms", &self.terms)
            .finish_non_exhaustive()
    }
}

impl LeasedDescriptor {
    /// The descriptor to hand to the readers.
    pub fn descriptor(&self) -> &Descriptor {
        &self.descriptor
    }

    /// When the lease stops serving reads, whatever its readers did.
    pub fn expires_at(&self) -> Instant {
        self.terms.expires_at
    }

    /// How many distinct readers' releases end the lease.
    pub fn readers(&self) -> u32 {
        self.terms.readers
    }

    /// Resolves when the lease ended, saying how.
    ///
    /// # Cancel safety
    /// Cancel-safe: it only observes.
    pub fn ended(&self) -> impl Future<Output = LeaseOutcome> + Send + 'static {
        self.end.clone().wait()
    }
}

/// How one lease ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum LeaseOutcome {
    /// As many readers as it allowed released it.
    Released,
    /// Its expiry came first.
    Expired,
    /// The backend ended it before either: the region was unmapped or the
    /// engine stopped.
    Withdrawn,
}

/// How the leases of a region ended, counted by outcome.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ReadersDone {
    /// Leases every reader released.
    pub released: usize,
    /// Leases that expired first.
    pub expired: usize,
    /// Leases the backend ended first (unmap, teardown).
    pub withdrawn: usize,
}

/// The time leases are judged by: tokio's clock, which is the system's
/// except in tests that pause it.
fn now() -> Instant {
    tokio::time::Instant::now().into_std()
}

/// One lease's end, shared by everyone who waits for it.
#[derive(Clone)]
struct LeaseWait {
    released: Shared<BoxFuture<'static, LeaseEnd>>,
    expires_at: Instant,
}

impl LeaseWait {
    async fn wait(self) -> LeaseOutcome {
        let expiry = tokio::time::sleep_until(self.expires_at.into());
        tokio::select! {
            biased;
            end = self.released => match end {
                LeaseEnd::Released => LeaseOutcome::Released,
                LeaseEnd::Withdrawn if now() >= self.expires_at => LeaseOutcome::Expired,
                LeaseEnd::Withdrawn => LeaseOutcome::Withdrawn,
            },
            () = expiry => LeaseOutcome::Expired,
        }
    }

    /// Whether the lease ended: expired, or its backend's future resolved
    /// (polled here, since nobody else may ever poll it).
    fn has_ended(&self, now: Instant) -> bool {
        now >= self.expires_at || self.released.clone().now_or_never().is_some()
    }
}

/// The leases a region handed out, until they ended.
#[derive(Default)]
pub(crate) struct RegionLeaseList {
    leases: Mutex<Vec<LeaseWait>>,
}

impl std::fmt::Debug for RegionLeaseList {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegionLeaseList")
            .field("leases", &self.leases.lock().len())
            .finish()
    }
}

impl RegionGuard {
    /// Hand the region out under a lease: at most `readers` distinct
    /// readers (1 to [`MAX_LEASE_READERS`](rdmareg_core::MAX_LEASE_READERS))
    /// whose releases end it, and an expiry `ttl` from now. Each lease has
    /// its own key; the region's own [`descriptor`](Self::descriptor) is
    /// not affected.
    ///
    /// # Errors
    /// [`RdmaError::OutOfRange`] for no readers, too many, a `ttl` too
    /// long to be an instant, or one that ran out before the engine made
    /// the lease (zero, or shorter than the hand-off to the engine, which
    /// on a busy host can take milliseconds); [`RdmaError::ShuttingDown`]; [`RdmaError::RegionNotFound`]
    /// if the backend no longer holds the region;
    /// [`RdmaError::Unsupported`] for a backend without leases;
    /// [`RdmaError::InvalidDescriptor`] for a key a descriptor cannot
    /// carry (a backend defect).
    ///
    /// # Cancel safety
    /// Dropping the future may leave a lease at the backend that no one
    /// holds; it ends at its expiry.
    pub async fn lease(&self, readers: u32, ttl: Duration) -> Result<LeasedDescriptor, RdmaError> {
        let _ticket = self.inner.gate.enter().ok_or(RdmaError::ShuttingDown)?;
        let now = now();
        let expires_at = now.checked_add(ttl).ok_or(RdmaError::OutOfRange)?;
        let terms = LeaseTerms {
            readers,
            expires_at,
        };
        terms.check(now)?;
        let lease = self
            .inner
            .backend
            .lease(self.state.backend_region_id, terms)
            .await;
        self.inner.counters.outcome(&lease);
        let lease = lease?;
        let descriptor = Descriptor::new(
            &self.inner.backend_key,
            self.addr(),
            self.len() as u64,
            self.generation(),
            lease.packed_key,
        )?;
        let end = LeaseWait {
            released: lease.released.shared(),
            expires_at,
        };
        let mut leases = self.state.leases.leases.lock();
        leases.retain(|lease| !lease.has_ended(now));
        leases.push(end.clone());
        Ok(LeasedDescriptor {
            descriptor,
            terms,
            end,
        })
    }

    /// Resolves once every lease handed out so far (by
    /// [`lease`](Self::lease)) ended, with how many ended which way. A
    /// lease made while it waits is not waited for.
    ///
    /// # Cancel safety
    /// Cancel-safe: it only observes.
    pub fn readers_done(&self) -> impl Future<Output = ReadersDone> + Send + 'static {
        let leases: Vec<LeaseWait> = self.state.leases.leases.lock().clone();
        async move {
            let outcomes = futures::future::join_all(leases.into_iter().map(LeaseWait::wait)).await;
            let mut done = ReadersDone::default();
            for outcome in outcomes {
                match outcome {
                    LeaseOutcome::Released => done.released += 1,
                    LeaseOutcome::Expired => done.expired += 1,
                    LeaseOutcome::Withdrawn => done.withdrawn += 1,
                }
            }
            done
        }
    }

    /// Wait for [`readers_done`](Self::readers_done), at most `timeout`,
    /// then [`unregister`](Self::unregister) with what is left of it (at
    /// least a millisecond). Returns how the leases ended, or `None` if
    /// the timeout came first.
    ///
    /// # Errors
    /// As [`unregister`](Self::unregister).
    ///
    /// # Cancel safety
    /// Dropping the future while it waits for readers drops the guard,
    /// which deregisters in the background.
    pub async fn unregister_after_readers(
        self,
        timeout: Duration,
    ) -> Result<(Option<ReadersDone>, UnregisterOutcome), RdmaError> {
        let started = tokio::time::Instant::now();
        let done = tokio::time::timeout(timeout, self.readers_done())
            .await
            .ok();
        let left = timeout
            .saturating_sub(started.elapsed())
            .max(Duration::from_millis(1));
        let outcome = self.unregister(left).await?;
        Ok((done, outcome))
    }
}
