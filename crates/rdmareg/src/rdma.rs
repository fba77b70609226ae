//! [`Rdma`]: an engine and a registry, started together and shut down in
//! order.

use std::ops::Deref;
use std::sync::Arc;
use std::time::Instant;

use rdmareg_backend::RdmaBackend;
use rdmareg_core::{PeerId, RdmaError};
use rdmareg_registry::{ConfigError, RdmaRegistry};
use rdmareg_ucx::UcxEngine;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::runtime::Handle;

use crate::config::Config;
use crate::offer::{Offer, OfferError, OfferedRegion};
use crate::summary::ShutdownSummary;

/// Why [`Rdma::start`] could not start.
#[derive(thiserror::Error, Debug)]
#[non_exhaustive]
pub enum StartError {
    /// Called outside a Tokio runtime, which the registry spawns work on.
    #[error(
        "Rdma::start must be called from inside a Tokio runtime (with its time driver enabled)"
    )]
    NoRuntime,
    /// The registry configuration was refused; nothing was started.
    #[error("invalid registry configuration: {0}")]
    Config(#[from] ConfigError),
    /// The UCX engine did not start (its message carries UCX's status).
    #[error("the UCX engine did not start: {0}")]
    Engine(#[from] RdmaError),
}

/// A UCX engine and the registry over it; derefs to [`RdmaRegistry`].
///
/// Finish with [`shutdown`](Self::shutdown), on every path, errors
/// included. Dropping it instead tears the engine down (blocking, bounded)
/// without the registry's sweep: memory still registered then stays
/// allocated for good (leaked, never freed, since the registry saw no
/// confirmed unmap), and the drop logs a warning naming how much (none
/// when nothing was registered).
#[derive(Debug)]
pub struct Rdma {
    engine: UcxEngine,
    registry: RdmaRegistry,
    /// How far [`shutdown`](Self::shutdown) got.
    shutdown: ShutdownProgress,
}

/// How far [`Rdma::shutdown`] got, for the drop's warning.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ShutdownProgress {
    NotCalled,
    Cancelled,
    Finished,
}

impl Rdma {
    /// Starts a UCX engine and a registry over it, on the current Tokio
    /// runtime; the registry's GET deadline is the engine's default too.
    ///
    /// # Errors
    /// [`StartError::NoRuntime`] outside a runtime; [`StartError::Config`]
    /// for a configuration [`RdmaConfig::validate`](rdmareg_registry::RdmaConfig::validate)
    /// refuses (before the engine starts); [`StartError::Engine`].
    pub fn start(config: Config) -> Result<Rdma, StartError> {
        let handle = Handle::try_current().map_err(|_| StartError::NoRuntime)?;
        config.registry.validate()?;
        let ucx = config
            .ucx
            .with_default_get_deadline(config.registry.get_deadline);
        let engine = UcxEngine::start(ucx)?;
        let backend: Arc<dyn RdmaBackend> = engine.backend();
        let registry = RdmaRegistry::new(backend, config.registry, handle)?;
        tracing::debug!(version = ?engine.ucx_version(), "rdmareg started");
        Ok(Rdma {
            engine,
            registry,
            shutdown: ShutdownProgress::NotCalled,
        })
    }

    /// This side's address, for peers' [`add_peer`](Self::add_peer).
    pub fn worker_address(&self) -> bytes::Bytes {
        self.engine.worker_address()
    }

    /// Records how to reach `peer` from its [`worker_address`](Self::worker_address).
    ///
    /// # Errors
    /// As [`UcxEngine::add_peer`].
    pub fn add_peer(&self, peer: PeerId, address: bytes::Bytes) -> Result<(), RdmaError> {
        self.engine.add_peer(peer, address)
    }

    /// As [`add_peer`](Self::add_peer), but every read from `peer` is
    /// served and checked by its owner's engine, never read directly on one
    /// host: for peers trusted with the network, not this host's memory.
    ///
    /// # Errors
    /// As [`UcxEngine::add_peer_served_only`].
    pub fn add_peer_served_only(
        &self,
        peer: PeerId,
        address: bytes::Bytes,
    ) -> Result<(), RdmaError> {
        self.engine.add_peer_served_only(peer, address)
    }

    /// Forgets `peer`; GETs in flight to it fail.
    ///
    /// # Errors
    /// As [`UcxEngine::remove_peer`].
    pub fn remove_peer(&self, peer: PeerId) -> Result<(), RdmaError> {
        self.engine.remove_peer(peer)
    }

    /// Writes this side's [`worker_address`](Self::worker_address) and
    /// `regions` (descriptors, or `(label, descriptor)` pairs) to `stream`
    /// as one [`Offer`], for the peer's [`accept`](Self::accept).
    ///
    /// # Errors
    /// As [`Offer::write_to`].
    ///
    /// # Cancel safety
    /// Dropping the future may leave part of the offer written.
    pub async fn offer<W, I>(&self, stream: &mut W, regions: I) -> Result<(), OfferError>
    where
        W: AsyncWrite + Unpin + ?Sized,
        I: IntoIterator,
        I::Item: Into<OfferedRegion>,
    {
        Offer::new(self.worker_address(), regions)
            .write_to(stream)
            .await
    }

    /// Reads a peer's [`offer`](Self::offer) from `stream`, adds it as
    /// `peer` ([`add_peer`](Self::add_peer), with the same trust) and
    /// returns its descriptors, ready to GET. For a peer trusted with the
    /// network only, use [`accept_served_only`](Self::accept_served_only).
    ///
    /// # Errors
    /// As [`Offer::read_from`], or [`OfferError::AddPeer`].
    ///
    /// # Cancel safety
    /// The peer is added only once the whole offer is read; a dropped
    /// future adds nothing but loses what was read.
    pub async fn accept<R>(&self, stream: &mut R, peer: PeerId) -> Result<Offer, OfferError>
    where
        R: AsyncRead + Unpin + ?Sized,
    {
        let offer = Offer::read_from(stream).await?;
        self.add_peer(peer, offer.worker_address().clone())
            .map_err(OfferError::AddPeer)?;
        Ok(offer)
    }

    /// As [`accept`](Self::accept), but adds the peer with
    /// [`add_peer_served_only`](Self::add_peer_served_only).
    ///
    /// # Errors
    /// As [`accept`](Self::accept).
    ///
    /// # Cancel safety
    /// As [`accept`](Self::accept).
    pub async fn accept_served_only<R>(
        &self,
        stream: &mut R,
        peer: PeerId,
    ) -> Result<Offer, OfferError>
    where
        R: AsyncRead + Unpin + ?Sized,
    {
        let offer = Offer::read_from(stream).await?;
        self.add_peer_served_only(peer, offer.worker_address().clone())
            .map_err(OfferError::AddPeer)?;
        Ok(offer)
    }

    /// The registry (also reachable through `Deref`).
    pub fn registry(&self) -> &RdmaRegistry {
        &self.registry
    }

    /// The engine.
    pub fn engine(&self) -> &UcxEngine {
        &self.engine
    }

    /// Serve this side's registry metrics at `GET /metrics` on `addr` (port
    /// 0 picks one: see [`MetricsServer::local_addr`](crate::metrics::MetricsServer::local_addr)).
    /// The server stops when dropped.
    ///
    /// # Errors
    /// The bind's I/O error.
    #[cfg(feature = "metrics")]
    pub async fn serve_metrics(
        &self,
        addr: std::net::SocketAddr,
    ) -> std::io::Result<crate::metrics::MetricsServer> {
        crate::metrics::MetricsServer::serve_registry(addr, &self.registry).await
    }

    /// The ordered shutdown in one call: the registry's sweep (bounded by
    /// [`RdmaConfig::shutdown_budget`](rdmareg_registry::RdmaConfig::shutdown_budget)),
    /// the engine's teardown, then the release of what the sweep could not
    /// confirm, only if the engine then reports nothing registered.
    ///
    /// # Cancel safety
    /// Dropped mid-way, the registry stays closed and a begun teardown runs
    /// on; survivors follow [`SweptRegistry`](rdmareg_registry::SweptRegistry)'s
    /// drop rule, and memory still registered is leaked (logged as a
    /// warning).
    pub async fn shutdown(mut self) -> ShutdownSummary {
        // Left so if the future is dropped before its end.
        self.shutdown = ShutdownProgress::Cancelled;
        let started = Instant::now();
        let before = self.registry.stats();
        let budget = self.registry.config().shutdown_budget;
        let swept = self.registry.shutdown(budget).await;
        let sweep_time = started.elapsed();
        let teardown_started = Instant::now();
        self.engine.shutdown().await;
        let teardown_time = teardown_started.elapsed();
        let report = swept.finish_after_backend_teardown();
        let after = self.registry.stats();
        let summary = ShutdownSummary::new(
            report,
            &before,
            &after,
            [sweep_time, teardown_time, started.elapsed()],
        );
        if summary.is_clean() {
            tracing::info!(?summary, "rdmareg shut down");
        } else {
            tracing::warn!(?summary, "rdmareg shut down uncleanly");
        }
        self.shutdown = ShutdownProgress::Finished;
        summary
    }
}

impl Drop for Rdma {
    fn drop(&mut self) {
        let how = match self.shutdown {
            ShutdownProgress::Finished => return,
            ShutdownProgress::Cancelled => "Rdma::shutdown was dropped before it finished",
            ShutdownProgress::NotCalled => {
                "Rdma dropped without shutdown() (call it on every path)"
            }
        };
        let registered_bytes = self.registry.stats().registered_bytes;
        if registered_bytes > 0 {
            tracing::warn!(
                registered_bytes,
                "{how}: the engine is torn down now, and the memory still registered is \
                 leaked, not freed"
            );
        }
    }
}

impl Deref for Rdma {
    type Target = RdmaRegistry;

    fn deref(&self) -> &RdmaRegistry {
        &self.registry
    }
}
