//! The [`RdmaBackend`] trait and its contract.
//!
//! The trait is object-safe (the registry holds `Arc<dyn RdmaBackend>`);
//! a registration crosses it as an opaque id, a byte range and key bytes.
//!
//! # Contract
//!
//! Every implementation honours these; the conformance kit checks them.
//!
//! 1. **`map` rolls back if its future is dropped**, leaving no
//!    registration. A rollback may be asynchronous, but then
//!    [`live_registrations`](RdmaBackend::live_registrations) counts the map
//!    until it is done.
//! 2. **`unmap` is idempotent and proceeds once submitted.** An unknown id
//!    returns `Ok(())`; dropping the future abandons only the result.
//! 3. **`Ok(())` from `unmap` means the pages are no longer pinned.** Any
//!    error (including [`RdmaError::ShuttingDown`]) means *unknown*.
//! 4. **`get` holds its destination region until the transfer finishes**,
//!    awaited or not: an `unmap` of it waits, and refuses new GETs into it
//!    from submission. A backend that sees the source side holds it too.
//! 5. **`live_registrations` is the backend's own count**; `Some(0)` is the
//!    evidence shutdown needs before declaring memory released.
//! 6. **Degenerate requests are typed errors** (null, zero length, overflow,
//!    out-of-range, malformed key), never a panic or undefined behaviour.
//! 7. **The effective range is page-enclosing**: a `map` reports
//!    [`effective_addr`](BackendRegion::effective_addr) and
//!    [`effective_len`](BackendRegion::effective_len) covering every page
//!    the range touches, since the OS pins whole pages and the budget is
//!    charged on them.
//! 8. **A completed GET means the backend has let go of the destination.**
//!    No outcome (`Ok`, `Timeout`, `ShuttingDown`, ...) is returned while
//!    the transport may still write it, because the registry hands the
//!    buffer back to safe code on completion.
//! 9. **A batch is its entries.** [`get_batch`](RdmaBackend::get_batch)
//!    returns one result per request, in order, each exactly what that
//!    request alone would get; [`get_shared_batch`](RdmaBackend::get_shared_batch)
//!    returns what `get_batch` would on every post.
//! 10. **A notice follows its reads.** [`get_with_notice`](RdmaBackend::get_with_notice)
//!     sends its notice only after the read completed successfully (point
//!     8), and never after a failed one; an owner's
//!     [`notices`](RdmaBackend::notices) delivers each notice at most once,
//!     in send order per sender, from a bounded queue whose overflow
//!     [`notice_drops`](RdmaBackend::notice_drops) counts. A backend
//!     without notices refuses them with [`RdmaError::Unsupported`].
//! 11. **A lease ends reads.** A key from [`lease`](RdmaBackend::lease)
//!     reads what the region's own key reads until the lease ended: from
//!     its expiry on, or once as many distinct readers as it allows sent
//!     [`release_lease`](RdmaBackend::release_lease) for it, a read under
//!     it fails [`RdmaError::LeaseExpired`]. Its `released` future resolves
//!     [`LeaseEnd::Released`] only after the last of those releases
//!     arrived. A backend refuses to lease (the default,
//!     [`RdmaError::Unsupported`]) rather than issue a key whose reads it
//!     could not end.
//! 12. **A write lands only where its owner allowed it.** A
//!     [`put`](RdmaBackend::put) writes nothing outside `[remote_addr,
//!     remote_addr + len)` of a live registration its owner mapped with
//!     write access ([`map_with_access`](RdmaBackend::map_with_access));
//!     to one without it, it fails [`RdmaError::AccessDenied`] having
//!     written nothing. It holds its source region as a GET holds its
//!     destination (an unmap of it waits), and completes only once the
//!     transport let go of the source; `Ok(())` means the bytes are in the
//!     owner's registration. An unmap of the owner's region waits for
//!     writes into it in flight. A backend without writes refuses them
//!     with [`RdmaError::Unsupported`].
//! 13. **An owner can say which writes landed.** For a region it mapped,
//!     [`take_written`](RdmaBackend::take_written) returns the ranges
//!     (offsets from the registration's start, coalesced) that writes it
//!     served filled whole since the last take, and empties that log. A
//!     write that was refused or failed is never listed; past its bound
//!     the log lists fewer ranges and says it is incomplete, never more.
//!     A backend without it refuses with [`RdmaError::Unsupported`].

use std::sync::Arc;

use bytes::Bytes;
use futures::future::BoxFuture;
use futures::stream::BoxStream;
use rdmareg_core::{
    Access, BackendGet, BackendPut, BackendRegion, LeaseEnd, LeaseTerms, MAX_NOTICE_BYTES, Notice,
    NoticeDrops, NoticeSender, PeerId, RdmaError, WrittenRanges,
};

/// A descriptor lease a backend made (contract point 11).
pub struct BackendLease {
    /// The lease's key: what a reader presents instead of the region's.
    pub packed_key: Bytes,
    /// Resolves when the lease ended: [`LeaseEnd::Released`] once the
    /// last reader released it, [`LeaseEnd::Withdrawn`] when it ended
    /// otherwise (expiry, unmap, teardown). Expiry is the caller's to time:
    /// the backend may resolve it late or only at the unmap.
    pub released: BoxFuture<'static, LeaseEnd>,
}

impl std::fmt::Debug for BackendLease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BackendLease")
            .field("packed_key", &self.packed_key)
            .finish_non_exhaustive()
    }
}

/// An RDMA provider: registers memory, pulls remote memory into it and, where
/// it offers writes, pushes it into remote registrations.
///
/// # Safety
/// The registry hands a GET's destination back to safe code when the GET
/// completes and frees memory when an unmap returns `Ok(())`, so an
/// implementation promises contract points 1, 3, 4 and 8 (see the module
/// docs and `docs/safety.md`). Calling `map`, `get` and `get_batch` is
/// `unsafe` for the other side of that bargain: they make the transport
/// write memory only the caller knows to be its own. Outside `unsafe`:
///
/// ```compile_fail,E0133
/// # use rdmareg_backend::RdmaBackend;
/// // Safe code cannot register memory a `Vec` owns…
/// async fn map_a_vec(backend: &dyn RdmaBackend, owned: &Vec<u8>) {
///     let _ = backend.map(owned.as_ptr() as usize, owned.len()).await;
/// }
/// ```
///
/// ```compile_fail,E0133
/// # use rdmareg_backend::{BackendGet, RdmaBackend};
/// // …nor name a destination by a region id it may have guessed…
/// async fn get_into_a_guessed_region(backend: &dyn RdmaBackend, get: BackendGet) {
///     let _ = backend.get(get).await;
/// }
/// ```
///
/// ```compile_fail,E0133
/// # use rdmareg_backend::{BackendGet, RdmaBackend};
/// // …nor a list of them.
/// async fn get_many_into_guessed_regions(backend: &dyn RdmaBackend, gets: Vec<BackendGet>) {
///     let _ = backend.get_batch(gets).await;
/// }
/// ```
///
/// Inside `unsafe`, where the caller takes on each `# Safety` section, they
/// compile:
///
/// ```
/// use rdmareg_backend::{BackendGet, RdmaBackend};
///
/// async fn calls(backend: &dyn RdmaBackend, owned: &Vec<u8>, get: BackendGet) {
///     // SAFETY: a sketch that is only compiled: a real caller hands over
///     // memory it owns and keeps it allocated and untouched until the
///     // region's unmap returns `Ok`.
///     let _ = unsafe { backend.map(owned.as_ptr() as usize, owned.len()) }.await;
///     // SAFETY: as above, for the destinations the requests name.
///     let _ = unsafe { backend.get(get.clone()) }.await;
///     // SAFETY: as above.
///     let _ = unsafe { backend.get_batch(vec![get]) }.await;
/// }
/// ```
///
/// ```compile_fail,E0200
/// // A backend that completes GETs early cannot be written without `unsafe`.
/// use futures::future::BoxFuture;
/// use rdmareg_backend::{BackendGet, BackendRegion, RdmaBackend, RdmaError};
///
/// struct CompletesEarly;
///
/// impl RdmaBackend for CompletesEarly {
///     fn key(&self) -> &str { "early" }
///     unsafe fn map(&self, _: usize, _: usize) -> BoxFuture<'_, Result<BackendRegion, RdmaError>> {
///         Box::pin(async { Err(RdmaError::NotConfigured) })
///     }
///     fn unmap(&self, _: u64) -> BoxFuture<'_, Result<(), RdmaError>> {
///         Box::pin(async { Ok(()) })
///     }
///     unsafe fn get(&self, _: BackendGet) -> BoxFuture<'_, Result<(), RdmaError>> {
///         Box::pin(async { Ok(()) })
///     }
/// }
/// ```
///
/// With `unsafe impl` (the only change) it compiles:
///
/// ```
/// use futures::future::BoxFuture;
/// use rdmareg_backend::{BackendGet, BackendRegion, RdmaBackend, RdmaError};
///
/// struct RefusesEverything;
///
/// // SAFETY: it registers nothing, so it pins nothing and never writes a
/// // destination; its results cannot outlive a transfer.
/// unsafe impl RdmaBackend for RefusesEverything {
///     fn key(&self) -> &str { "refuses" }
///     unsafe fn map(&self, _: usize, _: usize) -> BoxFuture<'_, Result<BackendRegion, RdmaError>> {
///         Box::pin(async { Err(RdmaError::NotConfigured) })
///     }
///     fn unmap(&self, _: u64) -> BoxFuture<'_, Result<(), RdmaError>> {
///         Box::pin(async { Ok(()) })
///     }
///     unsafe fn get(&self, _: BackendGet) -> BoxFuture<'_, Result<(), RdmaError>> {
///         Box::pin(async { Err(RdmaError::RegionNotFound) })
///     }
/// }
/// ```
pub unsafe trait RdmaBackend: Send + Sync + 'static {
    /// The backend's wire name (`"ucx"`, `"loopback"`), carried in every
    /// descriptor so a consumer never hands one backend's key to another.
    fn key(&self) -> &str;

    /// Register `[ptr, ptr + len)` and pack a key for it.
    ///
    /// # Safety
    /// The range is memory the caller owns. It stays allocated until an
    /// `unmap` of the returned id returns `Ok(())` (or, if the future is
    /// dropped or fails, until [`live_registrations`](Self::live_registrations)
    /// no longer counts the map), and no safe reference points into bytes a
    /// GET may write. Memory safe code owns (a `Vec`, a borrowed slice)
    /// breaks this.
    ///
    /// # Errors
    /// [`RdmaError::OutOfRange`] for a null pointer, zero length or overflow;
    /// [`RdmaError::ShuttingDown`] after teardown began;
    /// [`RdmaError::Backend`] when the provider refuses.
    ///
    /// # Cancel safety
    /// Dropping the future leaves no registration behind (contract point 1).
    unsafe fn map(&self, ptr: usize, len: usize)
    -> BoxFuture<'_, Result<BackendRegion, RdmaError>>;

    /// [`map`](Self::map) with the [`Access`] peers get: `Access::Read` is
    /// what `map` registers; a registration that allows writes lets peers
    /// holding its key write its bytes (contract point 12).
    ///
    /// The default maps `Access::Read` with `map` and refuses the others
    /// with [`RdmaError::Unsupported`], mapping nothing.
    ///
    /// # Safety
    /// As [`map`](Self::map). For an access that allows writes the caller
    /// also accepts that peers write the range at any time until the unmap
    /// returns `Ok(())`: it reads the bytes only in ways that tolerate that
    /// (never through a Rust reference while a write may land).
    ///
    /// # Errors
    /// As [`map`](Self::map); [`RdmaError::Unsupported`] for an access the
    /// backend cannot grant.
    ///
    /// # Cancel safety
    /// As [`map`](Self::map).
    unsafe fn map_with_access(
        &self,
        ptr: usize,
        len: usize,
        access: Access,
    ) -> BoxFuture<'_, Result<BackendRegion, RdmaError>> {
        if access == Access::Read {
            // SAFETY: this method's caller gives the terms `map` asks for.
            unsafe { self.map(ptr, len) }
        } else {
            Box::pin(async { Err(unsupported_writes()) })
        }
    }

    /// Deregister a region. Idempotent; `Ok(())` means "no longer pinned".
    ///
    /// # Cancel safety
    /// Once polled, the unmap proceeds even if the future is dropped.
    fn unmap(&self, backend_region_id: u64) -> BoxFuture<'_, Result<(), RdmaError>>;

    /// Read remote memory into a locally registered region.
    ///
    /// # Safety
    /// `request.local_region_id` names a region the caller mapped through
    /// this backend, and nothing references the destination bytes from the
    /// call until the future completes or, if it is dropped, until an
    /// `unmap` of that region returns `Ok(())`. A region id is a number safe
    /// code can guess, so naming someone else's region breaks this.
    ///
    /// # Errors
    /// [`RdmaError::RegionNotFound`] for an unknown or unmapping destination,
    /// [`RdmaError::OutOfRange`] for a destination range outside the mapped
    /// pointer and length (or a zero length), [`RdmaError::InvalidKey`] for a
    /// malformed key, [`RdmaError::NotConfigured`] for an unknown peer,
    /// [`RdmaError::Timeout`] past the deadline.
    ///
    /// # Cancel safety
    /// Dropping the future does not stop the transfer; the destination stays
    /// held until it has finished (contract point 4).
    unsafe fn get(&self, request: BackendGet) -> BoxFuture<'_, Result<(), RdmaError>>;

    /// Read several ranges in one submission; one result per request, in
    /// order (contract point 9).
    ///
    /// The default runs every request as its own [`get`](Self::get), all at
    /// once; a backend that can post a batch in one go overrides it.
    ///
    /// # Safety
    /// As [`get`](Self::get), for every request; overlapping destinations
    /// are the caller's choice to accept.
    ///
    /// # Errors
    /// Per entry, as [`get`](Self::get).
    ///
    /// # Cancel safety
    /// As [`get`](Self::get), for every entry.
    unsafe fn get_batch(
        &self,
        requests: Vec<BackendGet>,
    ) -> BoxFuture<'_, Vec<Result<(), RdmaError>>> {
        let gets: Vec<_> = requests
            .into_iter()
            // SAFETY: the caller of `get_batch` gives every request's
            // destination under the same terms `get` asks for.
            .map(|request| unsafe { self.get(request) })
            .collect();
        Box::pin(futures::future::join_all(gets))
    }

    /// [`get_batch`](Self::get_batch) of a list the caller posts again and
    /// again: the same requests, shared rather than handed over.
    ///
    /// While the caller keeps the `Arc`, posting it again posts the same
    /// requests, so a backend may reuse what it worked out at one post
    /// (decoded keys, checked bounds) and re-check only what can change:
    /// whether each destination is still mapped and the peer still known.
    /// The default posts a copy with `get_batch`.
    ///
    /// # Safety
    /// As [`get_batch`](Self::get_batch), for this post.
    ///
    /// # Errors
    /// Per entry, exactly as `get_batch` would return (contract point 9).
    ///
    /// # Cancel safety
    /// As [`get_batch`](Self::get_batch).
    unsafe fn get_shared_batch(
        &self,
        requests: Arc<[BackendGet]>,
    ) -> BoxFuture<'_, Vec<Result<(), RdmaError>>> {
        // SAFETY: this method's caller gives the terms `get_batch` asks for.
        unsafe { self.get_batch(requests.to_vec()) }
    }

    /// Write a locally registered range into a peer's registration
    /// (contract point 12).
    ///
    /// The default refuses with [`RdmaError::Unsupported`].
    ///
    /// # Safety
    /// `request.local_region_id` names a region the caller mapped through
    /// this backend, and nothing writes the source bytes from the call until
    /// the future completes or, if it is dropped, until an `unmap` of that
    /// region returns `Ok(())` (the transport may still be reading them).
    ///
    /// # Errors
    /// [`RdmaError::RegionNotFound`] for an unknown or unmapping source or
    /// target, [`RdmaError::OutOfRange`] for a range outside either (or a
    /// zero length), [`RdmaError::InvalidKey`] for a malformed key,
    /// [`RdmaError::AccessDenied`] for a target registered without write
    /// access, [`RdmaError::NotConfigured`] for an unknown peer,
    /// [`RdmaError::Timeout`] past the deadline. After `Timeout` or a
    /// transport failure the target range holds unspecified bytes of the
    /// source or its earlier ones.
    ///
    /// # Cancel safety
    /// Dropping the future does not stop the transfer; the source stays
    /// held until it has finished.
    unsafe fn put(&self, request: BackendPut) -> BoxFuture<'_, Result<(), RdmaError>> {
        let _ = request;
        Box::pin(async { Err(unsupported_writes()) })
    }

    /// Write several ranges in one submission; one result per request, in
    /// order, each what that request alone would get.
    ///
    /// The default runs every request as its own [`put`](Self::put), all at
    /// once.
    ///
    /// # Safety
    /// As [`put`](Self::put), for every request.
    ///
    /// # Errors
    /// Per entry, as [`put`](Self::put).
    ///
    /// # Cancel safety
    /// As [`put`](Self::put), for every entry.
    unsafe fn put_batch(
        &self,
        requests: Vec<BackendPut>,
    ) -> BoxFuture<'_, Vec<Result<(), RdmaError>>> {
        let puts: Vec<_> = requests
            .into_iter()
            // SAFETY: the caller of `put_batch` gives every request's source
            // under the same terms `put` asks for.
            .map(|request| unsafe { self.put(request) })
            .collect();
        Box::pin(futures::future::join_all(puts))
    }

    /// The ranges of the local region `backend_region_id` that served
    /// writes filled whole since the last call (or the map), as offsets
    /// from the registration's start; the log starts over empty (contract
    /// point 13).
    ///
    /// A write is listed once all its bytes are in the registration, so
    /// after a writer vanished mid-PUT the list names exactly the chunks
    /// it wrote whole. The log is bounded
    /// ([`MAX_WRITTEN_RANGES`](rdmareg_core::MAX_WRITTEN_RANGES) disjoint
    /// ranges): past it, writes are left out and
    /// [`WrittenRanges::incomplete`] set, never a range listed that did not
    /// land. It ends with the registration.
    ///
    /// # Errors
    /// [`RdmaError::RegionNotFound`] for a region not mapped;
    /// [`RdmaError::ShuttingDown`]; [`RdmaError::Unsupported`] (the
    /// default) for a backend that keeps no such log.
    ///
    /// # Cancel safety
    /// Dropping the future may lose the ranges taken: a later take does
    /// not list them again.
    fn take_written(
        &self,
        backend_region_id: u64,
    ) -> BoxFuture<'_, Result<WrittenRanges, RdmaError>> {
        let _ = backend_region_id;
        Box::pin(async {
            Err(RdmaError::Unsupported {
                operation: "logs of served writes",
            })
        })
    }

    /// How many registrations the backend still holds, if it can say.
    ///
    /// `Some(0)` means every region it held has been unmapped; `None` (the
    /// default) opts out, and the registry relies on call ordering alone.
    fn live_registrations(&self) -> Option<usize> {
        None
    }

    /// How many transfers this backend can see still using a region, if it
    /// can say; `Some(0)` for an id that names nothing.
    ///
    /// Diagnostic only: reported when an unmap outlives the caller's
    /// timeout (an unmap waits for these, contract point 4).
    fn transfers_in_flight(&self, backend_region_id: u64) -> Option<usize> {
        let _ = backend_region_id;
        None
    }

    /// Send `notice` to `peer`'s engine on its own, not tied to a read.
    ///
    /// Resolves once the transport took the message; the owner receives it
    /// unless the connection fails first (notices are not acknowledged).
    ///
    /// # Errors
    /// [`RdmaError::NoticeTooLarge`] past [`MAX_NOTICE_BYTES`];
    /// [`RdmaError::NotConfigured`] for a peer never added;
    /// [`RdmaError::ShuttingDown`]; [`RdmaError::Backend`] when the
    /// transport fails the send; [`RdmaError::Unsupported`] (the default)
    /// for a backend without notices.
    fn send_notice(&self, peer: PeerId, notice: Bytes) -> BoxFuture<'_, Result<(), RdmaError>> {
        let _ = (peer, notice);
        Box::pin(async { Err(unsupported()) })
    }

    /// A GET whose `notice` goes to the owner once the read completed
    /// successfully (contract point 10).
    ///
    /// `Ok(())` means the read completed and the notice was handed on for
    /// sending (to the transport, or to the engine's thread when the read
    /// was copied without it), in order with the reader's later notices.
    /// An error is either the read's (the notice was not sent) or, after a
    /// read that completed, the notice's own; an oversized notice is
    /// refused before anything is read.
    ///
    /// The default refuses before reading when the backend names no
    /// [`notice_sender`](Self::notice_sender), else reads with
    /// [`get`](Self::get), then calls [`send_notice`](Self::send_notice);
    /// a backend may send from its own completion path instead, sooner.
    ///
    /// # Safety
    /// As for [`get`](Self::get).
    ///
    /// # Errors
    /// As for [`get`](Self::get) and [`send_notice`](Self::send_notice).
    unsafe fn get_with_notice(
        &self,
        request: BackendGet,
        notice: Bytes,
    ) -> BoxFuture<'_, Result<(), RdmaError>> {
        if self.notice_sender().is_none() {
            // Nothing to send it with: refuse before reading.
            return Box::pin(async { Err(unsupported()) });
        }
        if notice.len() > MAX_NOTICE_BYTES {
            return Box::pin(async move { Err(too_large(&notice)) });
        }
        let peer = request.peer;
        // SAFETY: this method's caller gives the terms `get` asks for.
        let read = unsafe { self.get(request) };
        Box::pin(async move {
            read.await?;
            self.send_notice(peer, notice).await
        })
    }

    /// The notices readers sent this engine, oldest first; the stream ends
    /// when the backend shuts down. Several streams share one queue: each
    /// notice goes to one of them.
    ///
    /// # Errors
    /// [`RdmaError::Unsupported`] (the default) for a backend without
    /// notices.
    fn notices(&self) -> Result<BoxStream<'static, Notice>, RdmaError> {
        Err(unsupported())
    }

    /// Notices this engine dropped, by reason; `None` (the default) for a
    /// backend without notices.
    fn notice_drops(&self) -> Option<NoticeDrops> {
        None
    }

    /// The number this engine's notices carry as their sender; `None` (the
    /// default) for a backend without notices.
    fn notice_sender(&self) -> Option<NoticeSender> {
        None
    }

    /// Hands the region `backend_region_id` out under a descriptor lease
    /// with `terms` (contract point 11).
    ///
    /// # Errors
    /// [`RdmaError::RegionNotFound`] for a region not mapped (or being
    /// unmapped); [`RdmaError::OutOfRange`] for terms
    /// [`LeaseTerms::check`] refuses; [`RdmaError::ShuttingDown`];
    /// [`RdmaError::Unsupported`] (the default) for a backend without
    /// leases.
    fn lease(
        &self,
        backend_region_id: u64,
        terms: LeaseTerms,
    ) -> BoxFuture<'_, Result<BackendLease, RdmaError>> {
        let _ = (backend_region_id, terms);
        Box::pin(async { Err(unsupported_leases()) })
    }

    /// Tells the owner `peer` that this reader is done with the lease
    /// whose key is `packed_key`. Fire-and-forget, like a notice: resolves
    /// once the transport took the message, and the owner counts it once
    /// per reader.
    ///
    /// # Errors
    /// [`RdmaError::InvalidKey`] for a key that is not this backend's;
    /// [`RdmaError::NotConfigured`] for a peer never added;
    /// [`RdmaError::ShuttingDown`]; [`RdmaError::Backend`] when the
    /// transport fails the send; [`RdmaError::Unsupported`] (the default)
    /// for a backend without leases.
    fn release_lease(
        &self,
        peer: PeerId,
        packed_key: Bytes,
    ) -> BoxFuture<'_, Result<(), RdmaError>> {
        let _ = (peer, packed_key);
        Box::pin(async { Err(unsupported_leases()) })
    }
}

/// What a backend without writes answers.
fn unsupported_writes() -> RdmaError {
    RdmaError::Unsupported {
        operation: "remote writes",
    }
}

/// What a backend without leases answers.
fn unsupported_leases() -> RdmaError {
    RdmaError::Unsupported {
        operation: "descriptor leases",
    }
}

/// What a backend without notices answers.
fn unsupported() -> RdmaError {
    RdmaError::Unsupported {
        operation: "notices",
    }
}

/// The error for a notice over [`MAX_NOTICE_BYTES`].
fn too_large(notice: &[u8]) -> RdmaError {
    RdmaError::NoticeTooLarge {
        length: notice.len() as u64,
    }
}
