//! rdmareg: register memory for RDMA and move bytes with GETs and PUTs over
//! UCX, with a lifecycle that makes "registered" and "safe to free" exact.
//!
//! [`Rdma`] derefs to its [`RdmaRegistry`], so registering, describing,
//! GETting and PUTting are the registry's methods.
//!
//! # Call order
//!
//! 1. [`Rdma::start`] with a [`Config`] (inside a Tokio runtime).
//! 2. Register ([`RdmaRegistry::register_owned`]; for peers to write into,
//!    [`RdmaRegistry::register_owned_with`] and [`Access::Write`]) or
//!    allocate ([`RdmaRegistry::alloc_pinned`]); describe
//!    ([`RegionGuard::descriptor`], [`PinnedBuf::describe`]).
//! 3. Exchange addresses and descriptors: [`Rdma::offer`] and
//!    [`Rdma::accept`] over any Tokio byte stream, or by hand with
//!    [`Rdma::worker_address`], [`Rdma::add_peer`], [`Descriptor::encode`].
//! 4. GET a peer's descriptor into a pinned buffer ([`RdmaRegistry::get`]),
//!    PUT a pinned buffer into a writable one ([`RdmaRegistry::put`]), or
//!    post many of both as one [`TransferList`]
//!    ([`RdmaRegistry::transfer_list`], [`RdmaRegistry::post`]); tell the
//!    owner a read is done with a notice ([`RdmaRegistry::notify`], read on
//!    the owner's side from [`RdmaRegistry::notices`]).
//! 5. Release ([`RegionGuard::unregister_owned`], or drop the guard).
//! 6. [`Rdma::shutdown`], on every path, errors included: it returns a
//!    [`ShutdownSummary`]; an `Rdma` dropped without it leaks the memory
//!    still registered.
//!
//! A read between hosts is served by the owner's engine, which checks it
//! against its live registrations; between processes on one host it is
//! copied one-sided where the owner allows (`docs/safety.md`).
//!
//! UCX writes its own log lines to standard output unless the process
//! starts with `UCX_LOG_FILE=stderr` in its environment (UCX reads it as
//! it loads, before `main`); [`Config::with_ucx_setting`]`("LOG_LEVEL",
//! "fatal")` silences them instead.
//!
//! The root holds what a service calls; the layers stay public for services
//! that want only part of it: [`core`] (value types, wire descriptor),
//! [`backend`] (the seam, loopback backend, conformance kit), [`registry`]
//! and [`ucx`].
//!
//! # Going around the registry
//!
//! [`Rdma::engine`] hands out the engine, whose
//! [`backend`](ucx::UcxEngine::backend) has `unsafe`
//! [`map`](backend::RdmaBackend::map), [`get`](backend::RdmaBackend::get)
//! and [`get_batch`](backend::RdmaBackend::get_batch): they write memory
//! named by an address or region id, which safe code cannot vouch for.
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
//! // A guessed region id may name a pool buffer safe code holds.
//! let _ = rdma.engine().backend().get(get).await;
//! # }
//! ```
//!
//! # Lending a pool buffer
//!
//! [`PinnedBuf::describe`] lends a buffer to peers' reads as a
//! [`DescribedBuf`], which derefs to `&[u8]` only;
//! [`DescribedBuf::withdraw`] kills its descriptors and gives back the
//! writable buffer.
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
//! let buf = rdma.alloc_pinned(4096).await?;
//! let lent = buf.describe().await?;
//! let _wire = lent.descriptor().encode(); // send it to a peer
//! let mut buf = lent.withdraw().await?; // the descriptor reads no more
//! buf.fill(2);
//! # Ok(())
//! # }
//! ```
//!
//! With the `discovery` feature, `discovery` publishes addresses and named
//! descriptors on etcd and `PublishedRegion` withdraws a name before its
//! region; with `metrics`, `rdmareg::metrics` serves
//! [`RdmaRegistry::metrics`] in the Prometheus text format.

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

pub use rdmareg_core::{
    Access, Descriptor, DescriptorError, ErrorKind, MAX_LEASE_READERS, MAX_NOTICE_BYTES, Notice,
    NoticeDrops, NoticeSender, PeerId, RdmaError, WrittenRanges,
};
pub use rdmareg_registry::{
    DescribeError, DescribedBuf, LatencyHistogram, LeaseOutcome, LeasedDescriptor, PinnedBuf,
    RdmaConfig, RdmaRegistry, ReadersDone, RegionGuard, RegionWatch, RegisterOwnedError,
    RegistryMetrics, RegistryStats, ShutdownReport, TransferList, UnregisterOutcome,
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

/// The registry, its pool and its shutdown ordering (`rdmareg-registry`).
pub use rdmareg_registry as registry;

/// The UCX engine, its backend and configuration (`rdmareg-ucx`); its wire
/// formats are not part of the facade.
pub mod ucx {
    pub use rdmareg_ucx::{
        EngineAddress, EngineAddressError, ProcessIdentity, Transport, UcxBackend, UcxConfig,
        UcxEngine,
    };
}
