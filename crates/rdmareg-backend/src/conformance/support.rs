//! Small tools the checks share: polling a future by hand, waiting for a
//! backend's own live count, byte patterns, and request building.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::future::BoxFuture;
use rdmareg_core::{Access, BackendGet, BackendPut, BackendRegion, PeerId, RdmaError};

use super::BackendPair;
use super::buffer::Mapped;
use crate::RdmaBackend;

/// Deadline the kit puts on its GETs.
pub(crate) const GET_DEADLINE: Duration = Duration::from_secs(30);
/// Byte the kit fills destinations with; source patterns never produce it.
pub(crate) const FILL: u8 = 0xEE;

/// The source pattern: never [`FILL`], with a period no power of two, so a
/// copy from the wrong offset shows.
pub(crate) fn source_byte(i: usize) -> u8 {
    (i % 199) as u8
}

/// Poll once with a waker that does nothing, as a caller that then drops the
/// future would.
pub(crate) fn poll_once<F: Future + ?Sized>(future: Pin<&mut F>) -> Poll<F::Output> {
    future.poll(&mut Context::from_waker(Waker::noop()))
}

/// Poll `future` up to `polls` times, `gap` apart, then drop it, as a
/// caller that gives up would. Returns its output if it finished first.
pub(crate) async fn poll_then_drop<F: Future + ?Sized>(
    mut future: Pin<Box<F>>,
    polls: usize,
    gap: Duration,
) -> Option<F::Output> {
    for poll in 0..polls {
        if poll > 0 {
            tokio::time::sleep(gap).await;
        }
        if let Poll::Ready(output) = poll_once(future.as_mut()) {
            return Some(output);
        }
    }
    None
}

/// The backend's own registration count, if it keeps one.
pub(crate) fn live(backend: &dyn RdmaBackend) -> Option<usize> {
    backend.live_registrations()
}

/// Assert the live count is `expected` right now (skipped when the backend
/// cannot count).
pub(crate) fn assert_live_now(backend: &dyn RdmaBackend, expected: Option<usize>, what: &str) {
    let now = live(backend);
    if expected.is_some() {
        assert_eq!(now, expected, "live registrations {what}");
    }
}

/// Wait until the live count is `expected`, for at most `within`; whether it
/// was observed (`false` if the backend cannot count).
pub(crate) async fn settle_live(
    backend: &dyn RdmaBackend,
    expected: Option<usize>,
    within: Duration,
    what: &str,
) -> bool {
    let Some(expected) = expected else {
        return false;
    };
    let start = Instant::now();
    loop {
        let now = live(backend);
        if now == Some(expected) {
            return true;
        }
        assert!(
            start.elapsed() < within,
            "live registrations {what}: still {now:?} after {within:?}, expected {expected}"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// [`settle_live`], then insist the count stays at `expected` for
/// [`CANCEL_HOLD`]: a rollback racing a late map could show it only briefly.
pub(crate) async fn settle_live_and_hold(
    backend: &dyn RdmaBackend,
    expected: Option<usize>,
    within: Duration,
    what: &str,
) -> bool {
    if !settle_live(backend, expected, within, what).await {
        return false;
    }
    let start = Instant::now();
    while start.elapsed() < CANCEL_HOLD {
        tokio::time::sleep(Duration::from_millis(1)).await;
        let now = live(backend);
        assert_eq!(
            now, expected,
            "live registrations {what}: reached {expected:?}, then moved to {now:?} (a late map after cancellation)"
        );
    }
    true
}

/// How long the live count must hold still after a cancelled map.
pub(crate) const CANCEL_HOLD: Duration = Duration::from_millis(10);

/// `expected` more than `baseline`, keeping "cannot count" as it is.
pub(crate) fn plus(baseline: Option<usize>, more: usize) -> Option<usize> {
    baseline.map(|n| n + more)
}

/// A GET of `len` bytes from `remote_offset` of `source` (on the owner) into
/// `local_offset` of `destination` (on the consumer).
pub(crate) fn get_request(
    pair: &BackendPair,
    source: &Mapped,
    remote_offset: u64,
    destination: &Mapped,
    local_offset: u64,
    len: u64,
) -> BackendGet {
    BackendGet {
        peer: pair.owner_as_seen_by_consumer,
        remote_addr: source.addr() + remote_offset,
        packed_key: source.region.packed_key.clone(),
        local_region_id: destination.id(),
        local_offset,
        len,
        deadline: Some(GET_DEADLINE),
    }
}

// The kit's memory discipline, which makes the calls below sound: every
// range it maps is degenerate (which a backend must refuse) or inside a
// `KitBuffer`, reached only through its raw pointer and freed only once no
// registration can remain (`buffer.rs`). A destination is read only after
// its GET completed or its unmap returned `Ok`, or through that pointer to
// see nothing was written. Region ids are the kit's own or name nothing.

/// [`RdmaBackend::map`] of a range that follows the kit's discipline.
pub(crate) fn kit_map(
    backend: &dyn RdmaBackend,
    ptr: usize,
    len: usize,
) -> BoxFuture<'_, Result<BackendRegion, RdmaError>> {
    // SAFETY: by the kit's discipline (above), the range is degenerate or
    // inside a kit buffer that stays allocated while it may be registered.
    unsafe { backend.map(ptr, len) }
}

/// [`RdmaBackend::map_with_access`] of a range that follows the kit's
/// discipline; with write access the kit reads the range only through its
/// raw pointer, after the writes it awaited.
pub(crate) fn kit_map_with_access(
    backend: &dyn RdmaBackend,
    ptr: usize,
    len: usize,
    access: Access,
) -> BoxFuture<'_, Result<BackendRegion, RdmaError>> {
    // SAFETY: as `kit_map`; a kit buffer is never reached through a Rust
    // reference, so peers' writes into it invalidate none.
    unsafe { backend.map_with_access(ptr, len, access) }
}

/// [`RdmaBackend::put`] from a source that follows the kit's discipline.
pub(crate) fn kit_put(
    backend: &dyn RdmaBackend,
    request: BackendPut,
) -> BoxFuture<'_, Result<(), RdmaError>> {
    // SAFETY: by the kit's discipline (above), the source is a kit buffer
    // nothing writes while a put may read it, or an id that names nothing.
    unsafe { backend.put(request) }
}

/// [`RdmaBackend::put_batch`] from sources that follow the kit's
/// discipline.
pub(crate) fn kit_put_batch(
    backend: &dyn RdmaBackend,
    requests: Vec<BackendPut>,
) -> BoxFuture<'_, Vec<Result<(), RdmaError>>> {
    // SAFETY: as `kit_put`, for every request.
    unsafe { backend.put_batch(requests) }
}

/// [`RdmaBackend::get`] into a destination that follows the kit's discipline.
pub(crate) fn kit_get(
    backend: &dyn RdmaBackend,
    request: BackendGet,
) -> BoxFuture<'_, Result<(), RdmaError>> {
    // SAFETY: by the kit's discipline (above), the destination is a kit
    // buffer no reference aliases, or an id that names nothing.
    unsafe { backend.get(request) }
}

/// [`RdmaBackend::get_with_notice`] into a destination that follows the
/// kit's discipline.
pub(crate) fn kit_get_with_notice(
    backend: &dyn RdmaBackend,
    request: BackendGet,
    notice: Bytes,
) -> BoxFuture<'_, Result<(), RdmaError>> {
    // SAFETY: as `kit_get`.
    unsafe { backend.get_with_notice(request, notice) }
}

/// [`RdmaBackend::get_batch`] into destinations that follow the kit's
/// discipline.
pub(crate) fn kit_get_batch(
    backend: &dyn RdmaBackend,
    requests: Vec<BackendGet>,
) -> BoxFuture<'_, Vec<Result<(), RdmaError>>> {
    // SAFETY: as `kit_get`, for every request; where two requests share
    // destination bytes the check reads them only after the batch completed.
    unsafe { backend.get_batch(requests) }
}

/// [`RdmaBackend::get_shared_batch`] into destinations that follow the
/// kit's discipline.
pub(crate) fn kit_get_shared_batch(
    backend: &dyn RdmaBackend,
    requests: Arc<[BackendGet]>,
) -> BoxFuture<'_, Vec<Result<(), RdmaError>>> {
    // SAFETY: as `kit_get_batch`.
    unsafe { backend.get_shared_batch(requests) }
}

/// A peer id the consumer has not been told about.
pub(crate) fn unknown_peer(pair: &BackendPair) -> PeerId {
    let known = pair.owner_as_seen_by_consumer.0;
    PeerId(if known == u64::MAX - 1 {
        u64::MAX - 2
    } else {
        u64::MAX - 1
    })
}

/// Assert `destination` holds `source[remote_offset..][..len]` at
/// `local_offset` and [`FILL`] everywhere else.
pub(crate) fn assert_copied(
    destination: &[u8],
    local_offset: usize,
    remote_offset: usize,
    len: usize,
    what: &str,
) {
    for (i, &byte) in destination.iter().enumerate() {
        let expected = if (local_offset..local_offset + len).contains(&i) {
            source_byte(remote_offset + i - local_offset)
        } else {
            FILL
        };
        assert_eq!(
            byte, expected,
            "{what}: wrong byte at destination offset {i}"
        );
    }
}
