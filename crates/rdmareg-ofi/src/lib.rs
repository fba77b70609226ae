//! A libfabric (OFI) backend for rdmareg: [`OfiEngine`] runs one progress
//! thread that owns every fabric object, and [`OfiBackend`] implements
//! [`RdmaBackend`](rdmareg_backend::RdmaBackend) over it.
//!
//! # Quickstart
//!
//! ```no_run
//! use rdmareg_backend::RdmaBackend;
//! use rdmareg_core::PeerId;
//! use rdmareg_ofi::{OfiConfig, OfiEngine, Provider};
//!
//! # fn main() -> Result<(), rdmareg_core::RdmaError> {
//! let owner = OfiEngine::start(OfiConfig::new(Provider::Tcp).with_domain("lo"))?;
//! let consumer = OfiEngine::start(OfiConfig::new(Provider::Tcp).with_domain("lo"))?;
//! consumer.add_peer(PeerId(1), owner.fabric_address())?;
//! let backend = consumer.backend();
//! assert_eq!(backend.key(), "ofi");
//! # Ok(())
//! # }
//! ```
//!
//! # What is tested here
//!
//! `tcp` (with `ofi_rxm` for reliable-datagram endpoints) and `shm`, from
//! Debian 12's libfabric 1.17 (the minimum). Both progress data only when
//! the engine reads its completion queue, so the owner's progress thread is
//! what serves reads of its memory.
//!
//! # Safety model
//!
//! - Regions are registered for `FI_READ | FI_REMOTE_READ` only: a key lets a
//!   peer read the region it names, never write it.
//! - Packed keys ([`key`]) are a versioned layout of this crate, validated in
//!   full before use; a key is used only against the peer whose fabric
//!   address it names, and only for a range inside the registration it
//!   describes.
//! - Peer fabric addresses are checked against the provider's address format
//!   before `fi_av_insert`, and handed over zero-padded.
//! - A GET is answered only once the provider let go of its destination.
//!
//! # Not safe yet
//!
//! Measured on libfabric 1.17 (`examples/close_mid_read.rs`): on both `tcp`
//! and `shm` a read already in flight keeps copying out of a region after
//! its unmap answered `Ok`, so an owner must not free a region a peer may
//! still be reading; and on `shm` a stale or forged key is not refused by
//! the owner. See `docs/ofi.md`.

mod backend;
mod config;
mod doorbell;
mod engine;
mod fabric;
pub mod key;
mod progress;
mod protocol;

pub use backend::OfiBackend;
pub use config::{OfiConfig, Provider, ReadPath};
pub use engine::OfiEngine;
