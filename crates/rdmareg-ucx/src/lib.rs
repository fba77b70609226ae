//! The UCX side of rdmareg's backend seam: a progress-thread engine that owns
//! every UCX object, and [`UcxBackend`], its [`RdmaBackend`] implementation.
//!
//! ```no_run
//! # async fn demo() -> Result<(), rdmareg_core::RdmaError> {
//! use rdmareg_backend::RdmaBackend;
//! use rdmareg_ucx::{Transport, UcxConfig, UcxEngine};
//!
//! let engine = UcxEngine::start(UcxConfig::default().with_transport(Transport::SameHost))?;
//! // Exchange `engine.worker_address()` with peers out of band, then:
//! // engine.add_peer(peer_id, peer_address)?;
//! let backend = engine.backend();
//! // Memory reached only through its raw pointer while it is registered
//! // (the seam's `map` and `get` are `unsafe`: see `RdmaBackend`).
//! let buffer: *mut [u8] = Box::into_raw(vec![0u8; 4096].into_boxed_slice());
//! // SAFETY: `buffer` is this function's, untouched while registered, and
//! // freed only after the unmap below returned `Ok`.
//! let region = unsafe { backend.map(buffer.cast::<u8>() as usize, buffer.len()) }.await?;
//! // ... hand `region.packed_key` and the address to a peer, or GET into it ...
//! backend.unmap(region.backend_region_id).await?;
//! // SAFETY: made by `Box::into_raw` above; nothing registers it any more.
//! drop(unsafe { Box::from_raw(buffer) });
//! engine.shutdown().await;
//! assert_eq!(engine.live_registrations(), Some(0));
//! # Ok(()) }
//! ```
//!
//! # Architecture
//!
//! - One OS thread (`progress`) owns the UCP context, its single-threaded
//!   worker, endpoints and memory handles. Raw handles never leave it.
//! - Submitters reach it through the engine kit's command ring and control
//!   lane ([`rdmareg_engine::lanes`]) and get their results on one-shot
//!   channels; they ring the kit's doorbell only when it sleeps.
//! - [`UcxBackend`] is the kit's backend front, plus same-host reads copied
//!   on the caller's thread.
//!
//! # Safety model: owners serve every read themselves
//!
//! UCX emulates one-sided GET and PUT on lanes without remote-access
//! hardware, serving any raw address a request names, so **no worker a peer
//! outside the host's same-user trust domain can reach has
//! `UCP_FEATURE_RMA`** (see the `raw_peer` tests). Instead:
//!
//! - **A read is a request the owner checks** ([`read_protocol`]): the key
//!   names a never-reused registration and carries its random capability;
//!   anything but a live registration, matching capability and in-range
//!   read is refused, typed, with no byte sent.
//! - **Served bytes are leased:** when `unmap` returns `Ok` nothing reads
//!   the memory any more and the caller may free it.
//! - **A GET completes only after UCX lets go** of its destination, so
//!   safe code never holds a `&mut` to bytes UCX may still write.
//!
//! **Not covered:** UCX's tcp transport copies a transport-level "PUT
//! request" frame to any address it names; keep tcp ports on trusted
//! networks. The whole trust model, lane by lane, is in `docs/safety.md`.
//!
//! Large replies travel by rendezvous straight into the destination. Over
//! tcp, a read longer than one reply fragment and short of UCX's rendezvous
//! is asked in chunks ([`UcxEngine::reads_asked_in_chunks`];
//! `docs/operations.md`, "Chunked reads over tcp").
//!
//! # Lanes
//!
//! - **Served** (every engine): the owner checks each read, as above.
//! - **Same-host direct** (open by default on [`Transport::Auto`],
//!   [`Transport::SameHost`] and [`Transport::SharedMemoryNoErrorHandling`];
//!   see [`UcxConfig::with_same_host_direct_reads`]): a second context with
//!   RMA on `posix,cma` only, reachable only by processes of the same host
//!   and user. Its address travels in an [`EngineAddress`] and keys carry
//!   both lanes ([`read_protocol::SameHostKey`]). A consumer that reaches it
//!   copies with `process_vm_readv`, no owner wake-up, small reads on the
//!   caller's own thread ([`UcxConfig::caller_copy_limit`]); it checks the
//!   owner's release table before and after each copy and the owner's
//!   [`ProcessIdentity`] token in the same call. A PUT to a writable
//!   registration is a `process_vm_writev` under a lock on its release
//!   slot that the owner's unmap waits for. Otherwise it reads and writes
//!   through the owner.
//!
//! Bytes from peers are validated before UCX sees them: keys by
//! [`read_protocol`] and [`packed_key`], worker addresses by
//! [`worker_address`] in [`UcxEngine::add_peer`] (UCX aborts on some
//! malformed ones).
//!
//! # Errors
//!
//! UCX failures surface as [`RdmaError::Backend`] with UCX's status text in
//! the message. A GET to a peer never added is [`RdmaError::NotConfigured`];
//! past its deadline it is [`RdmaError::Timeout`]; a malformed key is
//! [`RdmaError::InvalidKey`]; a destination outside its mapped range, or a
//! source the owner finds outside its registration, is
//! [`RdmaError::OutOfRange`]; a key the owner does not recognise
//! (deregistered, stale, forged) is [`RdmaError::RegionNotFound`]; after
//! teardown began everything is [`RdmaError::ShuttingDown`].
//!
//! [`RdmaError::RegionNotFound`]: rdmareg_core::RdmaError::RegionNotFound
//! [`RdmaBackend`]: rdmareg_backend::RdmaBackend
//! [`RdmaError::Backend`]: rdmareg_core::RdmaError::Backend
//! [`RdmaError::NotConfigured`]: rdmareg_core::RdmaError::NotConfigured
//! [`RdmaError::Timeout`]: rdmareg_core::RdmaError::Timeout
//! [`RdmaError::InvalidKey`]: rdmareg_core::RdmaError::InvalidKey
//! [`RdmaError::InvalidWorkerAddress`]: rdmareg_core::RdmaError::InvalidWorkerAddress
//! [`RdmaError::OutOfRange`]: rdmareg_core::RdmaError::OutOfRange
//! [`RdmaError::ShuttingDown`]: rdmareg_core::RdmaError::ShuttingDown

mod affinity;
mod backend;
pub mod build_info;
mod caller_copies;
mod command;
mod config;
mod engine;
pub mod engine_address;
mod owner_process;
pub mod packed_key;
mod progress;
pub mod read_list;
pub mod read_protocol;
mod release_table;
mod status;
pub mod worker_address;

pub use backend::{UcxBackend, UcxDriver};
pub use config::{Transport, UcxConfig};
pub use engine::UcxEngine;
pub use engine_address::{EngineAddress, EngineAddressError, ProcessIdentity, TableLocation};
