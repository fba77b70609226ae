//! The [`RdmaBackend`] trait and its contract.
//!
//! The trait is object-safe (methods return [`BoxFuture`]) because the
//! registry holds a backend as `Arc<dyn RdmaBackend>`. Nothing
//! backend-specific crosses it: a registration is an opaque id, a byte range
//! and packed key bytes.
//!
//! # Contract
//!
//! Every implementation must honour these; the conformance kit checks them.
//!
//! 1. **`map` rolls back if its future is dropped.** A cancelled `map` leaves
//!    no registration behind. The caller treats a dropped `map` exactly like an
//!    error, so a backend that stays pinned after cancellation turns that
//!    into a use-after-free. A backend may roll back asynchronously (a map
//!    already submitted to a progress thread is undone by a compensating
//!    unmap), but then [`live_registrations`](RdmaBackend::live_registrations)
//!    counts the map from its submission until the rollback is done, so a
//!    caller that frees on the count's evidence never frees early. The
//!    registry itself never frees on a dropped map: it lets the map finish,
//!    unmaps it, and frees the memory only after that unmap returned
//!    `Ok(())`.
//! 2. **`unmap` is idempotent and proceeds once submitted.** An id that names
//!    nothing (never mapped, or already unmapped) returns `Ok(())`. Dropping
//!    the future abandons only the notification.
//! 3. **`Ok(())` from `unmap` means the pages are no longer pinned.** Any error
//!    ([`RdmaError::ShuttingDown`] in particular) means *unknown*, never
//!    *unmapped*.
//!    During teardown an unmap of a region that is already gone returns
//!    `Ok(())`; one the backend still holds fails with an error.
//! 4. **`get` keeps the destination region alive until the transfer
//!    finishes**, whether or not anyone still awaits it: an `unmap` of the
//!    destination waits for the transfer, and from the moment it is submitted
//!    new GETs into that region are refused. A backend that can see the source
//!    side (the loopback can; a one-sided transport cannot) holds the source
//!    registration the same way.
//! 5. **`live_registrations` is the backend's own count**, not the caller's
//!    bookkeeping. `Some(0)` is the evidence the registry needs before it
//!    declares memory released at the end of shutdown.
//! 6. **Degenerate requests are typed errors**: null pointer, zero length,
//!    overflow, a local range outside the mapped pointer and length, a remote
//!    range the key does not cover (where the backend can tell), a malformed or
//!    oversized key. Never a panic, never undefined behaviour.
//! 7. **The effective range is page-enclosing.** A successful `map` of
//!    `[ptr, ptr + len)` reports an
//!    [`effective_addr`](BackendRegion::effective_addr) and
//!    [`effective_len`](BackendRegion::effective_len) that are multiples of
//!    the system page size and cover every page the range touches: the OS
//!    pins whole pages, and the registry charges its budget (and
//!    `RLIMIT_MEMLOCK` is spent) on what is reported. A backend whose
//!    provider reports the caller's bytes unrounded (UCX's `ucp_mem_query`
//!    does) rounds them outward itself. The registry also never charges less
//!    than the page-enclosing length, so an undercounting backend cannot let
//!    it pass its budget.
//! 8. **A completed GET means the backend has let go of the destination.**
//!    No GET completes — `Ok`, `Timeout`, `ShuttingDown`, a peer failure —
//!    while the transport may still write its destination; the result
//!    reports what really happened (a transfer that completed during a
//!    shutdown drain returns `Ok`). The registry hands the destination back
//!    to safe code when the GET completes, so completing first would give
//!    safe code a `&mut` to bytes the transport still writes. A backend that
//!    cannot withdraw a transfer at its deadline completes the GET when the
//!    transport has ended it.
//! 9. **A batch is its entries.** [`get_batch`](RdmaBackend::get_batch)
//!    returns one result per request, in request order, and each entry's
//!    result is exactly what the same request alone would return: its own
//!    typed error (one bad entry fails nothing else), its own deadline, its
//!    destination held until its transfer is over (point 4) and its result
//!    given only once the backend let go of it (point 8). Dropping the
//!    batch's future abandons only the results, as dropping single GETs
//!    does. An empty batch returns an empty list.
//!    [`get_shared_batch`](RdmaBackend::get_shared_batch) returns exactly
//!    what `get_batch` of the same requests would, on every post: what a
//!    backend remembers of a list from one post never completes a later post
//!    without the checks that post's state calls for (an unmapped
//!    destination is refused, a removed peer is unknown).

use std::sync::Arc;

use futures::future::BoxFuture;
use rdmareg_core::{BackendGet, BackendRegion, RdmaError};

/// An RDMA provider: registers memory and pulls remote memory into it.
///
/// See the module documentation for the contract.
///
/// # Safety
///
/// The registry builds safe APIs on top of a backend: it hands a GET's
/// destination back to safe code (as `&mut [u8]`) when the GET completes, and
/// frees memory when an unmap returns `Ok(())`. Both are sound only if the
/// backend keeps its word, so implementing the trait is a promise the
/// compiler cannot check, and it takes `unsafe impl`. An implementation
/// guarantees contract points 1, 3, 4 and 8: a dropped `map` leaves nothing
/// registered (or is counted until its rollback is done), `Ok(())` from
/// `unmap` means nothing can touch the range any more, and no GET
/// completes — with any outcome — while the transport may still write its
/// destination. A backend that wraps another one and completes a GET before
/// the inner one did breaks this, however safe its own code looks.
///
/// The conformance kit checks these points for a given backend; passing it
/// is evidence, not proof.
///
/// Calling [`map`](Self::map), [`get`](Self::get) and
/// [`get_batch`](Self::get_batch) is `unsafe` too, for the other side of
/// the same bargain: they make the transport write memory named by an
/// address or by a region id, and only the caller can know that nobody else
/// owns those bytes. The registry is the safe way in: it maps memory it owns
/// (or that `unsafe` code handed it) and GETs only into a buffer the call
/// borrows mutably.
///
/// Each of the three fails to compile outside `unsafe`:
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
/// The same calls compile inside `unsafe`, where the caller takes on the
/// obligations each method's `# Safety` section lists.
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
/// The same implementation, written with `unsafe impl` (the only change),
/// compiles: the line above fails for the missing `unsafe` alone.
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
    ///
    /// The range is memory the caller owns, and it stays allocated until an
    /// `unmap` of the returned id returns `Ok(())` (or, when the future is
    /// dropped or fails with an error, until
    /// [`live_registrations`](Self::live_registrations) no longer counts the
    /// map). While it is registered, any GET through this backend that names
    /// the region may write it and any peer holding the key may read it, so
    /// the caller must not keep safe references to bytes a GET may write
    /// (see [`get`](Self::get)). Registering memory that safe code owns (a
    /// `Vec`, a borrowed slice) breaks this.
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

    /// Deregister a region. Idempotent; `Ok(())` means "no longer pinned".
    ///
    /// # Cancel safety
    /// Once the future has been polled once, the unmap proceeds even if it is
    /// dropped; only the result is lost.
    fn unmap(&self, backend_region_id: u64) -> BoxFuture<'_, Result<(), RdmaError>>;

    /// Read remote memory into a locally registered region.
    ///
    /// # Safety
    ///
    /// `request.local_region_id` names a region the caller mapped through
    /// this backend, and the destination bytes
    /// (`local_offset .. local_offset + len` of it) are the caller's to
    /// give: nothing reads or writes them — no reference to them exists —
    /// from the call until the future completes, or, if the future is
    /// dropped before it completes, until an `unmap` of the destination
    /// region returns `Ok(())` (the unmap waits for the transfer, contract
    /// point 4). A region id is a plain number that safe code can guess, so
    /// naming one whose bytes someone else holds breaks this.
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
    /// held until the transfer has really finished (contract point 4).
    unsafe fn get(&self, request: BackendGet) -> BoxFuture<'_, Result<(), RdmaError>>;

    /// Read several ranges in one submission; one result per request, in
    /// order (contract point 9).
    ///
    /// The default submits every request as its own [`get`](Self::get), all
    /// at once, and collects the results, so every backend supports batches;
    /// a backend that can post a batch in one go (one command to its
    /// progress thread, one completion back) overrides it.
    ///
    /// # Safety
    ///
    /// As [`get`](Self::get), for every request; and no two requests name
    /// overlapping destination bytes unless the caller accepts either
    /// entry's bytes being written there (both writes are the transport's,
    /// and the caller reads the destination only after the batch completed).
    ///
    /// # Errors
    /// Per entry, as [`get`](Self::get).
    ///
    /// # Cancel safety
    /// As [`get`](Self::get), for every entry: dropping the future stops no
    /// transfer, and every destination stays held until its transfer is
    /// over.
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
    /// A list identifies itself by its allocation: while the caller keeps
    /// the `Arc`, posting it again posts the same requests. A backend may
    /// keep what it worked out for a list at one post (decoded keys, checked
    /// bounds, ranges in the source's order) and reuse it at the next post
    /// of the same `Arc`, re-checking only what can change between posts:
    /// whether each destination is still mapped and the peer still the one
    /// it was. That is what makes a transfer list checked once and posted
    /// many times cheaper per post than building the batch again. The
    /// default posts a copy of the requests with `get_batch`.
    ///
    /// # Safety
    /// As [`get_batch`](Self::get_batch), for this post.
    ///
    /// # Errors
    /// Per entry, as [`get`](Self::get), exactly as `get_batch` would return
    /// (contract point 9).
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

    /// How many registrations the backend still holds, if it can say.
    ///
    /// `Some(0)` establishes that the backend attempted and finished an unmap
    /// for every region it held. `None` (the default) opts out of the check,
    /// and the registry then relies on call ordering alone.
    fn live_registrations(&self) -> Option<usize> {
        None
    }

    /// How many transfers this backend can see still using a region — GETs
    /// into it, and (where the backend sees the source side, as the loopback
    /// does) GETs from it — if it can say. `Some(0)` for an id that names
    /// nothing.
    ///
    /// Diagnostic only: the registry reports it when an unmap outlives the
    /// caller's timeout (an unmap waits for these, contract point 4). `None`
    /// (the default) means the backend cannot tell.
    fn transfers_in_flight(&self, backend_region_id: u64) -> Option<usize> {
        let _ = backend_region_id;
        None
    }
}
