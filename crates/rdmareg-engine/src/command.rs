//! What submitters ask of the progress thread.
//!
//! The commands every backend's thread serves are the backend seam's
//! operations (map, unmap, GET, PUT, batches, the log of written ranges)
//! plus shutdown; what a driver needs
//! beyond them (peer changes, whose addresses only the driver can parse)
//! travels as its own type `P` in [`Command::Driver`].
//!
//! [`Command::dispatch`] hands each command to the thread's [`Handler`],
//! after the checks every driver makes the same way: a map whose caller is
//! gone is skipped, and a new region's capability is drawn before the
//! transport registers anything, so a failed draw leaves nothing to undo.

use std::ops::ControlFlow;
use std::sync::Arc;

use bytes::Bytes;
use futures::channel::oneshot;
use rdmareg_backend::BackendLease;
use rdmareg_core::{
    Access, BackendGet, BackendPut, BackendRegion, LeaseTerms, PeerId, RdmaError, WrittenRanges,
};

/// Where the thread sends one command's result.
pub type Reply<T> = oneshot::Sender<Result<T, RdmaError>>;

/// Where the thread sends a batch's results: one per request, in order.
pub type BatchReply = oneshot::Sender<Vec<Result<(), RdmaError>>>;

/// One request to the progress thread.
#[derive(Debug)]
pub enum Command<P> {
    /// Register `[ptr, ptr + len)` under the caller-minted `id`.
    Map {
        /// Minted by the submitter before pushing (see `front`).
        id: u64,
        /// First byte.
        ptr: usize,
        /// Length in bytes, at least 1.
        len: usize,
        /// What peers may do with it; only a driver with
        /// [`Driver::WRITES`](crate::backend::Driver::WRITES) is asked for
        /// more than [`Access::Read`].
        access: Access,
        /// Where the region is returned.
        reply: Reply<BackendRegion>,
    },
    /// Deregister `id` (idempotent).
    Unmap {
        /// The region.
        id: u64,
        /// `None` for the compensating unmap of a dropped map.
        reply: Option<Reply<()>>,
    },
    /// Read remote memory into a registered destination.
    Get {
        /// What to read, and where to.
        request: BackendGet,
        /// Completed only once the transport released the destination.
        reply: Reply<()>,
    },
    /// Read several ranges; one result per request, in order.
    GetBatch {
        /// The reads.
        requests: Vec<BackendGet>,
        /// Completed only once every entry's destination was released.
        reply: BatchReply,
    },
    /// A batch posted again and again (shared): completed as `GetBatch`; a
    /// driver may keep work it derived from the list for the next post of
    /// the same `Arc`.
    GetSharedBatch {
        /// The reads.
        requests: Arc<[BackendGet]>,
        /// As for `GetBatch`.
        reply: BatchReply,
    },
    /// Read, then send `notice` to the read's owner once the read
    /// completed successfully (see [`Handler::get_with_notice`]).
    GetWithNotice {
        /// What to read, and where to.
        request: BackendGet,
        /// At most [`MAX_NOTICE_BYTES`](rdmareg_core::MAX_NOTICE_BYTES),
        /// checked by the submitter.
        notice: Bytes,
        /// Completed once the read completed and, after a read that
        /// succeeded, the transport took the notice.
        reply: Reply<()>,
    },
    /// Write a registered source into a peer's registration.
    Put {
        /// What to write, and where to.
        request: BackendPut,
        /// Completed only once the transport let go of the source.
        reply: Reply<()>,
    },
    /// Write several ranges; one result per request, in order.
    PutBatch {
        /// The writes.
        requests: Vec<BackendPut>,
        /// Completed only once every entry's source was let go.
        reply: BatchReply,
    },
    /// Send a notice to a peer's engine (see [`notices`](crate::notices)).
    Notice {
        /// Whom to.
        peer: PeerId,
        /// At most [`MAX_NOTICE_BYTES`](rdmareg_core::MAX_NOTICE_BYTES),
        /// checked by the submitter.
        notice: Bytes,
        /// Completed once the transport took the message.
        reply: Reply<()>,
    },
    /// Hand the region `region` out under a descriptor lease.
    Lease {
        /// The region.
        region: u64,
        /// Checked by the submitter.
        terms: LeaseTerms,
        /// Where the lease is returned.
        reply: Reply<BackendLease>,
    },
    /// Release the lease whose key is `packed_key` at its owner `peer`.
    ReleaseLease {
        /// The lease's owner.
        peer: PeerId,
        /// The lease's key, as its descriptor carries it. Untrusted bytes.
        packed_key: Bytes,
        /// Completed once the transport took the message.
        reply: Reply<()>,
    },
    /// Take the log of the ranges served writes filled in the local
    /// region `region` (see [`Handler::take_written`]).
    TakeWritten {
        /// The region.
        region: u64,
        /// Where the ranges are returned.
        reply: Reply<WrittenRanges>,
    },
    /// A command only the driver understands.
    Driver(P),
    /// Tear down; `reply` fires once the thread has released everything.
    Shutdown {
        /// Fired last.
        reply: oneshot::Sender<()>,
    },
}

/// A region to register, as [`Command::dispatch`] passes it on.
#[derive(Debug, Clone, Copy)]
pub struct NewRegion {
    /// Minted by the submitter (see `front`).
    pub id: u64,
    /// First byte; not null.
    pub ptr: usize,
    /// Length in bytes; at least 1, and `ptr + len` does not overflow.
    pub len: usize,
    /// What peers may do with it.
    pub access: Access,
    /// Sixteen random bytes a served read must present (see
    /// [`served`](crate::served)).
    pub capability: [u8; 16],
}

/// How a driver's progress thread registers and deregisters memory.
pub trait Registrations {
    /// Registers `region`. The caller is still waiting for the result.
    fn map_region(&mut self, region: NewRegion, reply: Reply<BackendRegion>);

    /// Deregisters `id` (idempotent); `reply` is `None` for the
    /// compensating unmap of a dropped map.
    fn unmap_region(&mut self, id: u64, reply: Option<Reply<()>>);
}

/// What a driver's progress thread does with each command; maps and
/// unmaps go to its [`Registrations`].
pub trait Handler: Registrations {
    /// The driver's own commands ([`Command::Driver`]).
    type DriverCommand;

    /// Starts one read.
    fn get(&mut self, request: BackendGet, reply: Reply<()>);

    /// Starts a batch of reads.
    fn get_batch(&mut self, requests: Vec<BackendGet>, reply: BatchReply);

    /// Starts a shared batch; by default as [`get_batch`](Self::get_batch)
    /// of a copy of the list.
    fn get_shared_batch(&mut self, requests: Arc<[BackendGet]>, reply: BatchReply) {
        self.get_batch(requests.to_vec(), reply);
    }

    /// Starts a read whose `notice` the thread sends to the read's owner
    /// once the read completed successfully, and only then completes
    /// `reply` (with the notice's error if it could not be sent); after a
    /// failed read the notice is dropped and `reply` gets the read's error.
    /// Reached only for a driver that declares
    /// [`Driver::SENDS_NOTICES_AFTER_READS`](crate::backend::Driver::SENDS_NOTICES_AFTER_READS);
    /// by default refused as unsupported.
    fn get_with_notice(&mut self, request: BackendGet, notice: Bytes, reply: Reply<()>) {
        let _ = (request, notice);
        let _ = reply.send(Err(RdmaError::Unsupported {
            operation: "notices sent by the thread after reads",
        }));
    }

    /// Starts one write. Reached only for a driver that declares
    /// [`Driver::WRITES`](crate::backend::Driver::WRITES); by default
    /// refused as unsupported.
    fn put(&mut self, request: BackendPut, reply: Reply<()>) {
        let _ = request;
        let _ = reply.send(Err(unsupported_writes()));
    }

    /// Starts a batch of writes; by default refused as unsupported, entry
    /// by entry.
    fn put_batch(&mut self, requests: Vec<BackendPut>, reply: BatchReply) {
        let _ = reply.send(vec![Err(unsupported_writes()); requests.len()]);
    }

    /// Sends `notice` to `peer`; by default refuses it as unsupported.
    fn send_notice(&mut self, peer: PeerId, notice: Bytes, reply: Reply<()>) {
        let _ = (peer, notice);
        let _ = reply.send(Err(RdmaError::Unsupported {
            operation: "notices",
        }));
    }

    /// Hands `region` out under a descriptor lease with `capability` (16
    /// random bytes [`Command::dispatch`] drew) and `terms`; by default
    /// refuses it as unsupported.
    fn lease(
        &mut self,
        region: u64,
        capability: [u8; 16],
        terms: LeaseTerms,
        reply: Reply<BackendLease>,
    ) {
        let _ = (region, capability, terms);
        let _ = reply.send(Err(unsupported_leases()));
    }

    /// Sends the release of the lease whose key is `packed_key` to `peer`;
    /// by default refuses it as unsupported.
    fn release_lease(&mut self, peer: PeerId, packed_key: Bytes, reply: Reply<()>) {
        let _ = (peer, packed_key);
        let _ = reply.send(Err(unsupported_leases()));
    }

    /// Answers the ranges served writes filled in `region` since the last
    /// take, as the owner's [`Owner::take_written`](crate::served::Owner::take_written)
    /// gives them (`RegionNotFound` for a region it does not hold). Reached
    /// only for a driver that declares
    /// [`Driver::WRITES`](crate::backend::Driver::WRITES); by default
    /// refused as unsupported.
    fn take_written(&mut self, region: u64, reply: Reply<WrittenRanges>) {
        let _ = region;
        let _ = reply.send(Err(unsupported_writes()));
    }

    /// Does a command only the driver understands.
    fn driver_command(&mut self, command: Self::DriverCommand);

    /// Called after each command but a shutdown; by default nothing.
    fn command_done(&mut self) {}

    /// Takes the reply of a shutdown; the thread stops serving commands
    /// after this one and fires `reply` once it has released everything.
    fn shutdown_requested(&mut self, reply: oneshot::Sender<()>);
}

impl<P> Command<P> {
    /// Hands the command to `handler`. Breaks after a shutdown.
    pub fn dispatch<H: Handler<DriverCommand = P>>(self, handler: &mut H) -> ControlFlow<()> {
        match self {
            Command::Map {
                id,
                ptr,
                len,
                access,
                reply,
            } => {
                if reply.is_canceled() {
                    // The caller is gone, and its compensating unmap may
                    // already have found nothing: register nothing.
                    return ControlFlow::Continue(());
                }
                match new_region(id, ptr, len, access) {
                    Ok(region) => handler.map_region(region, reply),
                    Err(err) => {
                        let _ = reply.send(Err(err));
                    }
                }
            }
            Command::Unmap { id, reply } => handler.unmap_region(id, reply),
            Command::Get { request, reply } => handler.get(request, reply),
            Command::GetBatch { requests, reply } => handler.get_batch(requests, reply),
            Command::GetSharedBatch { requests, reply } => {
                handler.get_shared_batch(requests, reply);
            }
            Command::Put { request, reply } => handler.put(request, reply),
            Command::PutBatch { requests, reply } => handler.put_batch(requests, reply),
            Command::Notice {
                peer,
                notice,
                reply,
            } => handler.send_notice(peer, notice, reply),
            Command::GetWithNotice {
                request,
                notice,
                reply,
            } => handler.get_with_notice(request, notice, reply),
            Command::Lease {
                region,
                terms,
                reply,
            } => match draw_capability() {
                Ok(capability) => handler.lease(region, capability, terms, reply),
                Err(err) => {
                    let _ = reply.send(Err(err));
                }
            },
            Command::ReleaseLease {
                peer,
                packed_key,
                reply,
            } => handler.release_lease(peer, packed_key, reply),
            Command::TakeWritten { region, reply } => handler.take_written(region, reply),
            Command::Driver(command) => handler.driver_command(command),
            Command::Shutdown { reply } => {
                handler.shutdown_requested(reply);
                return ControlFlow::Break(());
            }
        }
        handler.command_done();
        ControlFlow::Continue(())
    }

    /// Completes the command with [`RdmaError::ShuttingDown`] without doing
    /// it. A driver command and a shutdown are dropped: their senders see
    /// the channel closed.
    pub fn refuse(self) {
        match self {
            Command::Map { reply, .. } => {
                let _ = reply.send(Err(RdmaError::ShuttingDown));
            }
            Command::Lease { reply, .. } => {
                let _ = reply.send(Err(RdmaError::ShuttingDown));
            }
            Command::TakeWritten { reply, .. } => {
                let _ = reply.send(Err(RdmaError::ShuttingDown));
            }
            Command::Get { reply, .. }
            | Command::Put { reply, .. }
            | Command::GetWithNotice { reply, .. }
            | Command::Notice { reply, .. }
            | Command::ReleaseLease { reply, .. }
            | Command::Unmap {
                reply: Some(reply), ..
            } => {
                let _ = reply.send(Err(RdmaError::ShuttingDown));
            }
            Command::GetBatch { requests, reply } => {
                let _ = reply.send(vec![Err(RdmaError::ShuttingDown); requests.len()]);
            }
            Command::GetSharedBatch { requests, reply } => {
                let _ = reply.send(vec![Err(RdmaError::ShuttingDown); requests.len()]);
            }
            Command::PutBatch { requests, reply } => {
                let _ = reply.send(vec![Err(RdmaError::ShuttingDown); requests.len()]);
            }
            Command::Unmap { reply: None, .. } | Command::Driver(_) | Command::Shutdown { .. } => {}
        }
    }
}

/// Checks a map's range and draws its capability.
fn new_region(id: u64, ptr: usize, len: usize, access: Access) -> Result<NewRegion, RdmaError> {
    if ptr == 0 || len == 0 || ptr.checked_add(len).is_none() {
        return Err(RdmaError::OutOfRange);
    }
    Ok(NewRegion {
        id,
        ptr,
        len,
        access,
        capability: draw_capability()?,
    })
}

/// Sixteen random bytes from the OS, for a registration or a lease.
///
/// # Errors
/// [`RdmaError::Backend`] when the OS gives no random bytes.
pub fn draw_capability() -> Result<[u8; 16], RdmaError> {
    let mut capability = [0u8; 16];
    getrandom::fill(&mut capability).map_err(|err| {
        RdmaError::backend(format!("cannot draw a capability from the OS: {err}"))
    })?;
    Ok(capability)
}

/// What a driver without remote writes answers.
pub(crate) fn unsupported_writes() -> RdmaError {
    RdmaError::Unsupported {
        operation: "remote writes",
    }
}

/// What a driver without descriptor leases answers.
fn unsupported_leases() -> RdmaError {
    RdmaError::Unsupported {
        operation: "descriptor leases",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Records what reached it.
    #[derive(Default)]
    struct Recorder {
        mapped: Vec<NewRegion>,
        shutdowns: usize,
    }

    impl Registrations for Recorder {
        fn map_region(&mut self, region: NewRegion, reply: Reply<BackendRegion>) {
            self.mapped.push(region);
            drop(reply);
        }
        fn unmap_region(&mut self, _: u64, _: Option<Reply<()>>) {}
    }

    impl Handler for Recorder {
        type DriverCommand = ();
        fn get(&mut self, _: BackendGet, _: Reply<()>) {}
        fn get_batch(&mut self, _: Vec<BackendGet>, _: BatchReply) {}
        fn driver_command(&mut self, _: ()) {}
        fn shutdown_requested(&mut self, _: oneshot::Sender<()>) {
            self.shutdowns += 1;
        }
    }

    fn map(
        ptr: usize,
        len: usize,
    ) -> (
        Command<()>,
        oneshot::Receiver<Result<BackendRegion, RdmaError>>,
    ) {
        let (reply, result) = oneshot::channel();
        let command = Command::Map {
            id: 7,
            ptr,
            len,
            access: rdmareg_core::Access::Read,
            reply,
        };
        (command, result)
    }

    #[test]
    fn a_map_whose_caller_left_reaches_no_handler() {
        let mut recorder = Recorder::default();
        let (command, result) = map(0x1000, 64);
        drop(result);
        assert!(command.dispatch(&mut recorder).is_continue());
        assert!(recorder.mapped.is_empty());
    }

    #[test]
    fn bad_map_ranges_fail_out_of_range_before_the_handler() {
        for (ptr, len) in [(0, 64), (0x1000, 0), (usize::MAX - 3, 8)] {
            let mut recorder = Recorder::default();
            let (command, mut result) = map(ptr, len);
            let _ = command.dispatch(&mut recorder);
            assert!(recorder.mapped.is_empty(), "{ptr:#x}+{len}");
            assert_eq!(
                result.try_recv().ok().flatten(),
                Some(Err(RdmaError::OutOfRange))
            );
        }
    }

    #[test]
    fn each_new_region_gets_a_capability_of_its_own() {
        let mut recorder = Recorder::default();
        for _ in 0..2 {
            let (command, _result) = map(0x1000, 64);
            let _ = command.dispatch(&mut recorder);
        }
        let [first, second] = recorder.mapped[..] else {
            panic!("two regions reached the handler: {}", recorder.mapped.len());
        };
        assert_eq!((first.id, first.ptr, first.len), (7, 0x1000, 64));
        assert_ne!(first.capability, second.capability);
        assert_ne!(first.capability, [0; 16]);
    }

    #[test]
    fn a_shutdown_stops_the_dispatch() {
        let mut recorder = Recorder::default();
        let (reply, _done) = oneshot::channel();
        assert!(
            Command::<()>::Shutdown { reply }
                .dispatch(&mut recorder)
                .is_break()
        );
        assert_eq!(recorder.shutdowns, 1);
    }
}
