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
//! what serves reads of its memory. Besides this crate's own tests and the
//! conformance kit, the workspace's registry scenarios run over both
//! providers through the same test bodies as over UCX (`tests/tests/ofi`).
//!
//! Two `shm` engines in one process share more than their peers in other
//! processes do: the provider reuses a same-process endpoint's region, so
//! an engine whose teardown finds another `shm` engine of the process open
//! parks its endpoint instead of closing it (see `docs/ofi.md`).
//!
//! # Safety model
//!
//! - **Owner-served reads** ([`ReadPath::OwnerServed`], the default on `tcp`
//!   and `shm`): a consumer posts a tagged receive into its destination and
//!   sends the owner a request; the owner's engine checks the key's region
//!   id (never reused), its 16-byte random capability and the range against
//!   its live registrations, then sends the bytes under a read lease, or a
//!   zero-length refusal the consumer maps to `RegionNotFound` or
//!   `OutOfRange`. An unmap answers only once every lease on the region was
//!   released (the reply's send completed), so an owner may free a region
//!   once its unmap answered `Ok`. Registrations grant `FI_SEND | FI_RECV`
//!   and no remote access.
//! - **Gathered lists**: a batch's small reads of one owner go as one list
//!   request (up to 64 entries; see [`protocol`]); the owner checks every
//!   entry as a single read, copies the served ones into one reply within
//!   one loop turn (no lease outlives the copy), and the consumer lands an
//!   entry only once the reply's length is exactly what its statuses and
//!   the asked lengths add up to. Each entry is answered on its own.
//! - Packed keys ([`key`]) are a versioned layout of this crate, validated in
//!   full before use; a key is used only against the peer whose fabric
//!   address it names, and only for a range inside the registration it
//!   describes.
//! - Peer fabric addresses are checked against the provider's address format
//!   before `fi_av_insert`, and handed over zero-padded.
//! - A GET is answered only once the provider let go of its destination:
//!   its receive completed, or was cancelled and the cancellation reported.
//!   A receive cancelled at its deadline is followed by one into scratch
//!   memory that takes the owner's late reply, so the owner's lease ends.
//!
//! # What the tests hold
//!
//! With owner-served reads, no byte is copied from a region after its
//! unmap returned, on `tcp` and `shm`: the unmap waits for the reply in
//! flight. One-sided `fi_read` does not hold this on those providers.
//! `tests/ofi/owner_served.rs` asserts it, and that stale and forged keys are
//! refused on both providers; `examples/close_mid_read.rs` shows it on a
//! 64 MiB read.
//!
//! # Not covered
//!
//! - [`ReadPath::OneSided`] (`fi_read`, the default for
//!   [`Provider::Named`]) is for providers with hardware RMA (`verbs`,
//!   `efa`, `cxi`) and is untested here; on `tcp` and `shm` it has the
//!   defects above (see `docs/ofi.md`).
//! - On `shm` a killed owner is not detected as such: its read ends by
//!   itself or at its deadline. (Over `tcp` a probe of the engine's own
//!   finds it: a peer no message can be sent to for
//!   [`OfiConfig::unreachable_after`], 1 s by default, is declared
//!   unreachable and its reads answer
//!   [`RdmaError::Backend`](rdmareg_core::RdmaError::Backend) saying so,
//!   well before the read's own deadline.)

#[cfg(test)]
mod adversarial_peers;
mod backend;
mod config;
mod engine;
mod fabric;
pub mod key;
mod progress;
pub mod protocol;

pub use backend::{OfiBackend, OfiDriver};
pub use config::{OfiConfig, Provider, ReadPath};
pub use engine::OfiEngine;
