//! rdmareg: register memory for RDMA and move bytes with one-sided GETs over
//! UCX, with a lifecycle that makes "registered" and "safe to free" exact.
//!
//! This crate is the one dependency a service needs. [`Rdma::start`] starts
//! a UCX engine and a registry over it; [`Rdma`] derefs to the
//! [`RdmaRegistry`], so registering, describing and GETting are the
//! registry's own methods; [`Rdma::shutdown`] runs the ordered shutdown and
//! returns a [`ShutdownSummary`] of what it did.
//!
//! # Call order
//!
//! 1. [`Rdma::start`] with a [`Config`] (inside a Tokio runtime).
//! 2. Register ([`RdmaRegistry::register_owned`], `register_external`) or
//!    allocate ([`RdmaRegistry::alloc_pinned`]); describe
//!    ([`RegionGuard::descriptor`], or [`PinnedBuf::describe`] for a pool
//!    buffer).
//! 3. Hand the peer this side's address and the descriptors:
//!    [`Rdma::offer`] over any Tokio byte stream, [`Rdma::accept`] on the
//!    other side (which adds the peer); or by hand,
//!    [`Rdma::worker_address`] out, [`Rdma::add_peer`] in, and
//!    [`Descriptor::encode`] over your own channel.
//! 4. GET a peer's descriptor into a pinned buffer ([`RdmaRegistry::get`]).
//! 5. Release ([`RegionGuard::unregister_owned`], or drop the guard).
//! 6. [`Rdma::shutdown`].
//!
//! # Crate by crate
//!
//! The root holds what a service calls: [`Rdma`] and its [`Config`], the
//! registry's guards and buffers, [`Descriptor`], [`RdmaError`], and one
//! outcome type per kind of release ([`UnregisterOutcome`] with
//! [`StillRunning`] for a region, [`ShutdownSummary`] for the whole).
//! The layers stay public for services that want only part of this: the
//! value types and wire descriptor ([`core`]), the backend seam with its
//! loopback backend and conformance kit ([`backend`]), the registry
//! ([`registry`]) and the UCX engine ([`ucx`]). The ordering that
//! [`Rdma::shutdown`] performs is theirs too: [`RdmaRegistry::shutdown`],
//! then [`UcxEngine::shutdown`](ucx::UcxEngine::shutdown), then
//! [`SweptRegistry::finish_after_backend_teardown`](registry::SweptRegistry::finish_after_backend_teardown).
//!
//! # Going around the registry
//!
//! [`Rdma::engine`] hands out the engine, and its
//! [`backend`](ucx::UcxEngine::backend) is the seam the registry sits on. Its
//! [`map`](backend::RdmaBackend::map), [`get`](backend::RdmaBackend::get) and
//! [`get_batch`](backend::RdmaBackend::get_batch) make the transport write memory
//! named by an address or a region id, so they are `unsafe` to call: the
//! caller promises what each method's `# Safety` section asks (the memory is
//! its own, untouched until the call completes, freed only after the
//! unmap). Safe code cannot reach them:
//!
//! ```compile_fail,E0133
//! # async fn sketch(rdma: &rdmareg::Rdma) {
//! use rdmareg::backend::RdmaBackend;
//! let owned = vec![0u8; 4096];
//! let backend = rdma.engine().backend();
//! let _ = backend.map(owned.as_ptr() as usize, owned.len()).await;
//! # }
//! ```
//!
//! ```compile_fail,E0133
//! # async fn sketch(rdma: &rdmareg::Rdma, get: rdmareg::core::BackendGet) {
//! use rdmareg::backend::RdmaBackend;
//! // A region id is a number; a guessed one may name a pool buffer that
//! // safe code holds.
//! let _ = rdma.engine().backend().get(get).await;
//! # }
//! ```
//!
//! The same calls compile only inside `unsafe`:
//!
//! ```
//! # async fn sketch(rdma: &rdmareg::Rdma, get: rdmareg::core::BackendGet) {
//! use rdmareg::backend::RdmaBackend;
//! let backend = rdma.engine().backend();
//! // SAFETY: a sketch that is only compiled; a real caller names a
//! // destination it registered itself and leaves it untouched until the
//! // GET completes.
//! let _ = unsafe { backend.get(get) }.await;
//! # }
//! ```
//!
//! # Lending a pool buffer
//!
//! A pool buffer's bytes are lent to peers' reads by
//! [`PinnedBuf::describe`], which consumes the buffer and returns a
//! [`DescribedBuf`]: it hands out descriptors and derefs to `&[u8]` only,
//! since the engine may read the bytes for a peer at any moment. Writing
//! them again takes [`DescribedBuf::withdraw`], which kills the descriptors
//! and waits for the reads being served before it gives back the writable
//! buffer:
//!
//! ```compile_fail,E0596
//! # async fn sketch(rdma: &rdmareg::Rdma) -> Result<(), rdmareg::RdmaError> {
//! let mut buf = rdma.alloc_pinned(4096).await?;
//! buf.fill(1); // a `PinnedBuf` is writable
//! let mut lent = buf.describe().await?;
//! lent.fill(2); // a `DescribedBuf` is not
//! # Ok(())
//! # }
//! ```
//!
//! ```
//! # async fn sketch(rdma: &rdmareg::Rdma) -> Result<(), rdmareg::RdmaError> {
//! let mut buf = rdma.alloc_pinned(4096).await?;
//! buf.fill(1);
//! let lent = buf.describe().await?;
//! let _wire = lent.descriptor().encode(); // send it to a peer
//! let mut buf = lent.withdraw().await?; // the descriptor reads no more
//! buf.fill(2);
//! # Ok(())
//! # }
//! ```
//!
//! # Discovery
//!
//! With the `discovery` feature, the `discovery` module publishes worker addresses
//! and named descriptors on etcd under leases, and `PublishedRegion` ties a
//! name to a registration so the name is withdrawn before the region is
//! unregistered.
//!
//! # Metrics
//!
//! The registry counts what it does ([`RdmaRegistry::metrics`]: registered
//! bytes, regions, pool use, GETs, bytes moved, errors by kind, a GET
//! latency histogram). With the `metrics` feature, `rdmareg::metrics`
//! exports them in the Prometheus text format and serves them over HTTP
//! (`Rdma::serve_metrics`).

#![forbid(unsafe_code)]
#![cfg_attr(docsrs, feature(doc_cfg))]

mod config;
#[cfg(feature = "metrics")]
pub mod metrics;
pub mod offer;
#[cfg(feature = "discovery")]
mod published;
mod rdma;
mod summary;

pub use config::Config;
pub use offer::{Offer, OfferError, OfferedRegion};
pub use rdma::{Rdma, StartError};
pub use summary::ShutdownSummary;

#[cfg(feature = "discovery")]
pub use published::{PublishError, PublishFailure, PublishedRegion};
/// Peers and named descriptors on etcd (`rdmareg-discovery`, feature
/// `discovery`).
#[cfg(feature = "discovery")]
pub use rdmareg_discovery as discovery;

pub use rdmareg_core::{Descriptor, DescriptorError, ErrorKind, PeerId, RdmaError};
pub use rdmareg_registry::{
    DescribeError, DescribedBuf, LatencyHistogram, PinnedBuf, RdmaRegistry, RegionGuard,
    RegisterOwnedError, RegistryMetrics, StillRunning, TransferList, UnregisterOutcome,
    UnregisterOwnedError, WithdrawError,
};
pub use rdmareg_ucx::Transport;

/// The byte buffer type of descriptors' packed keys and transfer lists.
pub use bytes::Bytes;

/// The value types, errors and wire descriptor (`rdmareg-core`).
pub use rdmareg_core as core;

/// The backend seam, the loopback backend and the conformance kit
/// (`rdmareg-backend`).
pub use rdmareg_backend as backend;

/// The registry, its pool, its configuration and its shutdown ordering
/// (`rdmareg-registry`).
pub use rdmareg_registry as registry;

/// The UCX progress-thread engine, its backend and its configuration
/// (`rdmareg-ucx`). The engine's wire formats are not part of the facade;
/// a crate that parses them depends on `rdmareg-ucx` itself.
pub mod ucx {
    pub use rdmareg_ucx::{
        EngineAddress, EngineAddressError, ProcessIdentity, Transport, UcxBackend, UcxConfig,
        UcxEngine,
    };
}
