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
//! let mut buffer = vec![0u8; 4096];
//! let region = backend.map(buffer.as_mut_ptr() as usize, buffer.len()).await?;
//! // ... hand `region.packed_key` and the address to a peer, or GET into it ...
//! backend.unmap(region.backend_region_id).await?;
//! engine.shutdown().await;
//! assert_eq!(engine.live_registrations(), 0);
//! # Ok(()) }
//! ```
//!
//! # Architecture
//!
//! - One OS thread (`progress`) owns the UCP context, one single-threaded
//!   worker, endpoints, memory handles and unpacked remote keys. Raw handles
//!   never leave it.
//! - Submitters reach it through a bounded command ring and an unbounded
//!   control lane (`command`), and are answered on one-shot channels. They
//!   wake it (`doorbell`) only when it sleeps; while it spins, submitting is
//!   a queue push.
//! - [`UcxBackend`] adds cancellation safety on the submitting side.
//!
//! # Safety model
//!
//! Registered memory is remotely readable and writable by whoever holds its
//! key: UCP enforces no protection. On tcp and shared memory it is worse: the
//! packed key is 9 bytes that **bound nothing**, so any peer that holds this
//! engine's worker address and can create an endpoint can read any address
//! of the process. The trust boundary is therefore who receives
//! [`UcxEngine::worker_address`]. rdmareg's own bounds checks (a GET's
//! destination must lie inside the pointer and length that were mapped)
//! protect the consumer from naming bytes it should not — never the owner
//! from a hostile peer.
//!
//! Keys from the wire are untrusted bytes: `ucp_ep_rkey_unpack` takes no
//! length, so every key is validated against the packed-key layout of the
//! running UCX ([`packed_key`]) before UCX sees it, and a UCX version whose
//! layout is unknown gets every key refused. Peer worker addresses are
//! untrusted bytes for the same reason (UCX aborts the process on some
//! malformed ones and reads past the end of others): [`UcxEngine::add_peer`]
//! validates each against the worker-address layout of the running UCX
//! ([`worker_address`]) before UCX sees it. A well-formed address still
//! grants its holder what the rule above says.
//!
//! # Software-emulated GET: a paused or vanishing consumer can abort the owner
//!
//! On transports without remote-read hardware (tcp), a GET is served by the
//! *owner's* UCX progress, which sends the bytes back over the connection.
//! UCX (1.22, and upstream at the time of writing) treats a send that fails
//! while it is still answering as fatal: it aborts the owner's process
//! (`ucp_request.inl`, "Fatal: unexpected error: Endpoint timeout") instead
//! of dropping the reply. That happens whenever the consumer's connection is
//! reset while the owner is answering, or before the owner has read the
//! request — for instance a consumer that gives up on a stopped owner
//! (debugger, cgroup freezer, long stall) and exits before the owner resumes.
//!
//! This engine never causes it by itself where it can help it: teardown lets
//! GETs in flight finish before closing connections, and after giving up on
//! GETs (deadline, peer removed or re-added) it keeps the worker up while
//! their replies still arrive (both bounded by
//! [`UcxConfig::teardown_timeout`]). What a consumer side cannot prevent is
//! an owner resuming after its consumer is already gone, or a consumer
//! crashing mid-GET. Where that matters, prefer transports that read
//! without the owner: RDMA hardware, or [`Transport::SameHost`] (cma).
//!
//! # Errors
//!
//! UCX failures surface as [`RdmaError::Backend`] with UCX's status text in
//! the message. A GET to a peer never added is [`RdmaError::NotConfigured`];
//! past its deadline it is [`RdmaError::Timeout`]; a malformed key is
//! [`RdmaError::InvalidKey`]; a malformed peer worker address is
//! [`RdmaError::InvalidWorkerAddress`]; a destination outside the mapped range is
//! [`RdmaError::OutOfRange`]; after teardown began everything is
//! [`RdmaError::ShuttingDown`].
//!
//! [`RdmaBackend`]: rdmareg_backend::RdmaBackend
//! [`RdmaError::Backend`]: rdmareg_core::RdmaError::Backend
//! [`RdmaError::NotConfigured`]: rdmareg_core::RdmaError::NotConfigured
//! [`RdmaError::Timeout`]: rdmareg_core::RdmaError::Timeout
//! [`RdmaError::InvalidKey`]: rdmareg_core::RdmaError::InvalidKey
//! [`RdmaError::InvalidWorkerAddress`]: rdmareg_core::RdmaError::InvalidWorkerAddress
//! [`RdmaError::OutOfRange`]: rdmareg_core::RdmaError::OutOfRange
//! [`RdmaError::ShuttingDown`]: rdmareg_core::RdmaError::ShuttingDown

mod backend;
mod command;
mod config;
mod doorbell;
mod engine;
pub mod packed_key;
mod progress;
mod status;
pub mod worker_address;

pub use backend::UcxBackend;
pub use config::{Transport, UcxConfig};
pub use engine::UcxEngine;
