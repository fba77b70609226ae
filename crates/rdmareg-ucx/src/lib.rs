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
//! // freed only after the unmap below answered `Ok`.
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
//! - One OS thread (`progress`) owns the UCP context, one single-threaded
//!   worker, endpoints and memory handles. Raw handles never leave it.
//! - Submitters reach it through the engine kit's bounded command ring and
//!   unbounded control lane ([`rdmareg_engine::lanes`]), and are answered on
//!   one-shot channels. They wake it (the kit's doorbell) only when it
//!   sleeps; while it spins, submitting is a queue push.
//! - [`UcxBackend`] is the kit's backend front, with its cancellation rules,
//!   plus same-host reads copied on the caller's thread.
//!
//! # Safety model: owners serve every read themselves
//!
//! UCX's one-sided GET and PUT are *emulated* on every lane without
//! remote-access hardware (tcp, and the messaging side of shared memory):
//! the target's own progress serves them from whatever raw address the
//! request names, with no key check and no bounds, and `ucp_mem_unmap` does
//! not stop a read already streaming. Any peer able to reach a worker whose
//! context has `UCP_FEATURE_RMA` can read or write any byte of the process.
//! So:
//!
//! - **No worker a peer outside the host's same-user trust domain can reach
//!   has `UCP_FEATURE_RMA`.** The serving context has active messages and
//!   wake-up only, so UCX installs none of the emulation handlers there: a
//!   crafted PUT or GET request aimed at it is dropped (see the `raw_peer`
//!   tests). The same-host direct-read lane (below) is the one context with
//!   RMA, on transports only same-user processes of the host can reach.
//! - **A read is a request the owner checks** ([`read_protocol`]): the
//!   descriptor's key names a registration (an id never reused) and carries
//!   its 16-byte random capability; the owner's engine serves only a live,
//!   not-unmapping registration, a matching capability, and a range inside
//!   the mapped pointer and length. Everything else is refused, typed, with
//!   no byte sent: a forged address gets `OutOfRange`, a stale or foreign
//!   key `RegionNotFound`.
//! - **Served bytes are leased:** an unmap waits until UCX finished sending
//!   every reply that reads from the region, so when `unmap` answers `Ok`
//!   nothing reads the memory any more and the caller may free it.
//! - **An answer means UCX has let go:** a read is answered only after UCX
//!   released its destination, so safe code never holds a `&mut` to bytes
//!   UCX may still write.
//!
//! **Not covered:** UCX's tcp transport itself (UCT) copies the payload of
//! a transport-level "PUT request" frame to whatever address the frame
//! names, for any connected socket and regardless of UCP features; a peer
//! using libuct directly against this engine's tcp port can write any byte
//! of the process. Keep tcp ports on trusted networks (see
//! `docs/safety.md`).
//!
//! Large replies travel by rendezvous straight into the destination; on
//! same-host lanes UCX pulls them with cma, so bulk data still moves with
//! one copy. Over tcp, a read longer than one reply fragment and short of
//! UCX's rendezvous is asked in pieces that each come back in one fragment
//! ([`UcxEngine::reads_asked_in_chunks`]), so it too is copied once; a
//! list's reads of 16 to 32 KiB are asked in two pieces that travel with
//! the list's small reads, one request for up to 256 KiB of them.
//!
//! # Lanes
//!
//! - **Served** (every engine): the owner checks each read, as above. What
//!   bounds a peer is the owner's check.
//! - **Same-host direct** (open by default on [`Transport::Auto`],
//!   [`Transport::SameHost`] and [`Transport::SharedMemoryNoErrorHandling`];
//!   [`UcxConfig::with_same_host_direct_reads`] decides otherwise): a second
//!   context with RMA on `posix,cma` only, which only processes of the same
//!   host and user can reach — the same processes that can read this one
//!   with `process_vm_readv` anyway. Its address travels beside the serving
//!   one in an [`EngineAddress`], and the owner's keys carry both lanes
//!   ([`read_protocol::SameHostKey`]). A consumer that reaches the owner's
//!   direct lane reads one-sided: one kernel copy, no request, no owner
//!   wake-up — for a whole batch, one vectored `process_vm_readv` when the
//!   owner's address names its process
//!   ([`ProcessIdentity`]); and once the engine has checked an owner, a
//!   small read from it is copied on the caller's own thread, inside
//!   `get`, without waking the progress thread
//!   ([`UcxConfig::caller_copy_limit`]). The owner does
//!   not check each read there: the consumer's engine checks the key's
//!   mapped range, and the owner's release table before and after each
//!   copy, so a stale descriptor reads `RegionNotFound`, never the
//!   memory's current bytes. Every copy first reads a random token the
//!   owner published, in the same system call: once the owner has exited
//!   or replaced its program, its same-host reads fail rather than read
//!   another program under its pid.
//!   A consumer that cannot reach it, or the owner's release table, reads
//!   through the owner.
//!   See `docs/safety.md` for the trust domain, lane by lane.
//!
//! Bytes from peers are validated before UCX or the engine acts on them:
//! keys are decoded by the engine ([`read_protocol`]), and worker addresses
//! are checked against the worker-address layout of the running UCX
//! ([`worker_address`]) by [`UcxEngine::add_peer`] — UCX aborts the process
//! on some malformed ones and reads past the end of others. The [`packed_key`] module
//! validates UCX's own packed-key format, which same-host keys carry for
//! the direct lane; it is checked before UCX unpacks it.
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
