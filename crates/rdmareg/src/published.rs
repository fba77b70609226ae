//! [`PublishedRegion`]: a registered region published under a name in
//! discovery, withdrawn before it is unregistered.

use std::sync::Arc;
use std::time::Duration;

use rdmareg_discovery::{DiscoveryError, Publisher};
use rdmareg_registry::{RegionGuard, UnregisterOutcome};

use rdmareg_core::RdmaError;

/// A region published under a name in discovery.
///
/// # Contract
///
/// A descriptor never stays published after its registration is gone.
/// [`unregister`](Self::unregister) and
/// [`unregister_owned`](Self::unregister_owned) withdraw the name first
/// and unregister only once etcd took the withdrawal; otherwise the error
/// hands the region back. Dropping it withdraws, then drops the guard, on
/// the current Tokio runtime (without one the entry is left to the lease,
/// logged). [`into_guard`](Self::into_guard) keeps the registration and
/// leaves the name published: the caller's promise.
#[derive(Debug)]
pub struct PublishedRegion {
    /// `None` only once handed out or released.
    guard: Option<RegionGuard>,
    name: String,
    publisher: Arc<Publisher>,
}

/// Why a region could not be (un)published; the region comes back with it.
#[derive(Debug, thiserror::Error)]
#[error("{error}")]
pub struct PublishError<T> {
    /// What failed.
    pub error: PublishFailure,
    /// The region, untouched by the failed step.
    pub region: T,
}

/// What failed in publishing or unpublishing a region.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PublishFailure {
    /// The region has no descriptor to publish.
    #[error("the region has no descriptor: {0}")]
    Descriptor(RdmaError),
    /// etcd did not take the write.
    #[error("discovery: {0}")]
    Discovery(DiscoveryError),
}

impl PublishedRegion {
    /// Publishes `guard`'s descriptor under `name` with `publisher`.
    ///
    /// # Errors
    /// [`PublishFailure::Descriptor`] for a region without a descriptor;
    /// [`PublishFailure::Discovery`] when etcd did not take it (the queued
    /// name is withdrawn first). The guard comes back, still registered.
    pub async fn publish(
        publisher: Arc<Publisher>,
        name: impl Into<String>,
        guard: RegionGuard,
    ) -> Result<PublishedRegion, PublishError<RegionGuard>> {
        let name = name.into();
        let descriptor = match guard.descriptor() {
            Ok(descriptor) => descriptor,
            Err(error) => {
                return Err(PublishError {
                    error: PublishFailure::Descriptor(error),
                    region: guard,
                });
            }
        };
        if let Err(error) = publisher.publish(&name, &descriptor).await {
            if let Err(withdraw) = publisher.withdraw(&name).await {
                tracing::debug!(name, error = %withdraw, "unqueueing a name whose publish failed");
            }
            return Err(PublishError {
                error: PublishFailure::Discovery(error),
                region: guard,
            });
        }
        Ok(PublishedRegion {
            guard: Some(guard),
            name,
            publisher,
        })
    }

    /// The name it is published under.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The registered region.
    pub fn guard(&self) -> &RegionGuard {
        self.guard
            .as_ref()
            .expect("a PublishedRegion holds its guard until it is consumed")
    }

    /// Keeps the registration and forgets the publication, without
    /// withdrawing it (see the [contract](Self)).
    pub fn into_guard(mut self) -> RegionGuard {
        self.guard
            .take()
            .expect("a PublishedRegion holds its guard until it is consumed")
    }

    /// Withdraws the name; on success, the guard for the caller to release.
    async fn withdraw(mut self) -> Result<RegionGuard, PublishError<PublishedRegion>> {
        match self.publisher.withdraw(&self.name).await {
            Ok(()) => Ok(self
                .guard
                .take()
                .expect("a PublishedRegion holds its guard until it is consumed")),
            Err(error) => Err(PublishError {
                error: PublishFailure::Discovery(error),
                region: self,
            }),
        }
    }

    /// Withdraws the name, then unregisters the region.
    ///
    /// # Errors
    /// A failed withdrawal, with the region back and still registered; else
    /// [`RegionGuard::unregister`]'s error, after the name was withdrawn.
    pub async fn unregister(
        self,
        timeout: Duration,
    ) -> Result<Result<UnregisterOutcome, RdmaError>, PublishError<PublishedRegion>> {
        let guard = self.withdraw().await?;
        Ok(guard.unregister(timeout).await)
    }

    /// Withdraws the name, then unregisters the owned region and hands its
    /// buffer back.
    ///
    /// # Errors
    /// As [`unregister`](Self::unregister).
    #[allow(clippy::type_complexity)]
    pub async fn unregister_owned(
        self,
        drain_timeout: Duration,
    ) -> Result<
        Result<(Box<[u8]>, UnregisterOutcome), rdmareg_registry::UnregisterOwnedError>,
        PublishError<PublishedRegion>,
    > {
        let guard = self.withdraw().await?;
        Ok(guard.unregister_owned(drain_timeout).await)
    }
}

impl Drop for PublishedRegion {
    fn drop(&mut self) {
        let Some(guard) = self.guard.take() else {
            return;
        };
        let name = std::mem::take(&mut self.name);
        match tokio::runtime::Handle::try_current() {
            Ok(handle) => {
                let publisher = Arc::clone(&self.publisher);
                handle.spawn(async move {
                    if let Err(error) = publisher.withdraw(&name).await {
                        tracing::warn!(name, %error, "a dropped published region could not be withdrawn; its entry ends with the lease");
                    }
                    drop(guard);
                });
            }
            Err(_) => {
                tracing::warn!(
                    name,
                    "a published region dropped outside a Tokio runtime: unregistered without withdrawing; its entry ends with the lease"
                );
                drop(guard);
            }
        }
    }
}
