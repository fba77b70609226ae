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
//! `tcp` (with `ofi_rxm`) and `shm` from libfabric 1.17 are tested here,
//! including the workspace's registry scenarios (`tests/tests/ofi`). Both
//! progress only when the engine reads its completion queue, so the owner's
//! progress thread is what serves reads of its memory. Two `shm` engines of
//! one process share endpoint regions, so teardown may park an endpoint
//! instead of closing it (`docs/ofi.md`).
//!
//! # Safety model
//!
//! - **Owner-served reads** ([`ReadPath::OwnerServed`], the default on `tcp`
//!   and `shm`): the consumer posts a tagged receive into its destination
//!   and sends a request; the owner checks the key's never-reused region
//!   id, random capability and range against its live registrations, then
//!   sends the bytes under a read lease, or a zero-length refusal. An unmap
//!   returns only once every lease on the region ended, so the region may
//!   be freed once its unmap returned `Ok` (`tests/ofi/owner_served.rs`,
//!   `examples/close_mid_read.rs`). Registrations grant `FI_SEND | FI_RECV`
//!   and no remote access.
//! - **Batched lists**: a batch's small reads of one owner go as one list
//!   request (see [`protocol`]); the owner checks every entry as a single
//!   read and copies the served ones into one reply in one loop turn, and
//!   the consumer writes an entry only if the reply's length adds up. Each
//!   entry has its own result.
//! - **Descriptor leases** (`RdmaBackend::lease`, contract point 11): a
//!   lease key is an owner-served key with the lease's capability and a
//!   flag of its own ([`key`], "Lease keys"), on either read path, so the
//!   owner's engine judges every read under it (by the engine kit's owner,
//!   at the time it serves it) and refuses it
//!   [`LeaseExpired`](rdmareg_core::RdmaError::LeaseExpired) once the lease
//!   ended. A one-sided engine posts request receives with its first
//!   lease for that. A reader's release is a message of its notice series,
//!   counted by the owner once per reader.
//! - Packed keys ([`key`]) and peer fabric addresses are validated in full
//!   before libfabric sees them; a key is used only against the peer whose
//!   address it names, for a range inside its registration.
//! - A GET completes only once the provider let go of its destination; a
//!   receive cancelled at its deadline is followed by one into scratch
//!   memory, so the owner's late reply ends its lease.
//!
//! # Signals
//!
//! libfabric's PSM libraries install SIGINT and SIGTERM handlers that end
//! the process when the program loads, before `main`. A program that links
//! this crate and shuts down in order on those signals calls
//! [`restore_default_termination_signals`] first in `main`. The `shm`
//! provider's own handlers, installed as a process opens its first
//! endpoint, the engine undoes itself.
//!
//! # Not covered
//!
//! - [`ReadPath::OneSided`] (`fi_read`, the default for
//!   [`Provider::Named`]) is for providers with hardware RMA and is untested
//!   here; on `tcp` and `shm` it does not stop reads in flight when a
//!   region is unmapped (`docs/ofi.md`, "The one-sided path"). Only its
//!   lease reads, which are owner-served, are tested over `tcp` and `shm`
//!   (`tests/ofi/leases_on_the_one_sided_path.rs`).
//! - On `shm` a killed owner is not detected: its read ends by itself or at
//!   its deadline. Over `tcp` a peer no message can be sent to for
//!   [`OfiConfig::unreachable_after`] is declared unreachable and its reads
//!   fail with [`RdmaError::Backend`](rdmareg_core::RdmaError::Backend).

#[cfg(test)]
mod adversarial_peers;
mod backend;
mod config;
mod engine;
mod fabric;
pub mod key;
mod progress;
pub mod protocol;
mod signals;

pub use backend::{OfiBackend, OfiDriver};
pub use config::{OfiConfig, Provider, ReadPath};
pub use engine::OfiEngine;
pub use signals::restore_default_termination_signals;
