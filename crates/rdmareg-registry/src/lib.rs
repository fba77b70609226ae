//! rdmareg's registry: register memory for RDMA, hand out descriptors, pull
//! remote bytes into pinned buffers, and release all of it in an order that
//! never frees memory a NIC may still touch.
//!
//! [`RdmaRegistry`] is the entry point (its docs give the call order);
//! [`RegionGuard`] and [`RegionWatch`] hold one registered region;
//! [`PinnedBuf`] is a GET destination from the pinned pool; [`SweptRegistry`]
//! finishes shutdown. The provider is reached only through
//! [`rdmareg_backend::RdmaBackend`].
//!
//! Background work is spawned on the [`Handle`](tokio::runtime::Handle)
//! given to [`RdmaRegistry::new`]; that runtime, and any that polls the
//! registry's futures, needs its time driver (`enable_time`).
//!
//! Descriptors go only to trusted peers: depending on the backend a key
//! holder may read and write the range. This crate never creates a
//! reference into a registered region, and [`PinnedBuf`] lends `&mut [u8]`
//! only while no transfer owns its memory. See `docs/safety.md`.

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
    LeaseOutcome, LeasedDescriptor, ReadersDone, RegionGuard, RegionView, RegionWatch,
    UnregisterOutcome, UnregisterOwnedError,
};
pub use registry::{RdmaRegistry, RegisterOwnedError};
pub use shutdown::{ShutdownReport, SweptRegistry};
pub use stats::RegistryStats;
pub use transfer_list::TransferList;

pub use rdmareg_core::{
    Access, Descriptor, DescriptorError, ErrorKind, MAX_LEASE_READERS, MAX_NOTICE_BYTES, Notice,
    NoticeDrops, NoticeSender, PageRange, PeerId, RdmaError, WrittenRanges,
};
