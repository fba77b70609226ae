//! rdmareg's registry: register memory for RDMA, hand out descriptors, pull
//! remote bytes into pinned buffers, and release all of it in an order that
//! never frees memory a NIC may still touch.
//!
//! - [`RdmaRegistry`] — the entry point; its docs give the call order.
//! - [`RegionGuard`] / [`RegionWatch`] — one registered region: the owner's
//!   handle (unregister, descriptors) and clonable observers (the release
//!   latch, reading under a lease).
//! - [`PinnedBuf`] — a buffer from the pinned pool, the destination of GETs.
//! - [`RdmaConfig`] / [`PoolConfig`] — budget, pool shape, time budgets.
//! - [`RegistryStats`] / [`RegistryMetrics`] — what the registry holds now,
//!   and cumulative counters with a GET-latency histogram.
//! - [`SweptRegistry`] — what [`RdmaRegistry::shutdown`] returns; the only
//!   way to release what the sweep could not.
//!
//! The registry speaks to an RDMA provider only through
//! [`rdmareg_backend::RdmaBackend`]; nothing here knows which one it is.
//!
//! # Runtime
//!
//! The registry runs on Tokio. Its background work (deregistering dropped
//! guards, unmapping freed dedicated arenas, carrying GETs to completion) is
//! spawned on the [`Handle`](tokio::runtime::Handle) given to
//! [`RdmaRegistry::new`], which therefore works from any thread. That
//! runtime, and any runtime that polls the registry's futures, must have its
//! time driver enabled (`enable_time` or `enable_all`): drains and shutdown
//! are bounded by timers.
//!
//! # Safety model
//!
//! What a peer holding a descriptor can do is up to the backend: with
//! `rdmareg-ucx` the owner serves each read itself and refuses anything
//! outside a live registration; with raw RDMA hardware keys (which the
//! loopback backend imitates) a key holder can read *and write* the
//! registered range. Either way descriptors go only to peers the service
//! trusts, and the registry treats registered memory as writable by them. A descriptor never grants more
//! than it describes: a pool buffer is described through a registration of
//! its own ([`PinnedBuf::describe`]), never through its arena's key. No
//! `&`/`&mut` reference to a
//! registered region is ever created by this crate; [`PinnedBuf`] lends
//! `&mut [u8]` only while no transfer owns its memory.

#![deny(unsafe_op_in_unsafe_fn)]

mod budget;
mod config;
mod gate;
mod latch;
mod mapping;
mod metrics;
mod pool;
mod region;
mod registry;
mod shutdown;
mod stats;
mod transfer;
mod transfer_list;

pub use config::{ConfigError, GRANULE, PoolConfig, RdmaConfig};
pub use metrics::{GET_LATENCY_BUCKETS, LatencyHistogram, RegistryMetrics};
pub use pool::{DescribeError, DescribedBuf, PinnedBuf, WithdrawError};
pub use region::{
    RegionGuard, RegionView, RegionWatch, StillRunning, UnregisterOutcome, UnregisterOwnedError,
};
pub use registry::{RdmaRegistry, RegisterOwnedError};
pub use shutdown::{ShutdownReport, Survivors, SweptRegistry, TeardownVerdict};
pub use stats::RegistryStats;
pub use transfer_list::TransferList;

pub use rdmareg_core::{Descriptor, DescriptorError, ErrorKind, PageRange, PeerId, RdmaError};
