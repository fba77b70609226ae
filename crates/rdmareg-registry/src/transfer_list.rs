//! Transfer lists: many GETs checked once and posted as one batch, any
//! number of times.
//!
//! A post into the same destination slots as the one before reuses its
//! requests through [`RdmaBackend::get_shared_batch`], so a backend may keep
//! what it worked out for them. A post checks every destination before
//! submitting anything, is admitted through the gate, holds every slot until
//! the backend completed every entry, and gives each entry its own result.
//! Like a single GET, a dropped post surrenders its destination buffers.
//!
//! [`RdmaBackend::get_shared_batch`]: rdmareg_backend::RdmaBackend::get_shared_batch

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use bytes::Bytes;
use futures::future::BoxFuture;
use rdmareg_backend::BackendGet;
use rdmareg_core::{Descriptor, DescriptorError, PeerId, RdmaError};

use crate::pool::PinnedBuf;
use crate::registry::Inner;
use crate::transfer::{HeldSlots, InFlight, PendingTransfer, busy_poll_window};

/// One read of a list: a described range into a destination buffer.
#[derive(Debug, Clone)]
struct Entry {
    remote_addr: u64,
    packed_key: Bytes,
    len: u64,
    /// Index into the buffers given to `post`.
    buffer: usize,
    offset: u64,
}

/// Reads from one peer, checked once, posted as one batch any number of
/// times with [`RdmaRegistry::post`](crate::RdmaRegistry::post).
///
/// Entries name destinations by index into each post's slice of buffers,
/// so one list can be written to different buffers of the same shapes.
#[derive(Debug, Clone)]
pub struct TransferList {
    peer: PeerId,
    backend_key: String,
    entries: Vec<Entry>,
    /// Per buffer index named (not dense), the end of its furthest entry.
    needed: BTreeMap<usize, u64>,
    last_requests: LastRequests,
}

/// The last post's requests, kept for the next post into the same
/// destinations; cleared by `push`, not cloned.
#[derive(Default)]
struct LastRequests(parking_lot::Mutex<Option<BuiltRequests>>);

struct BuiltRequests {
    /// Per buffer index, in `needed`'s order: the slot's registration and
    /// offset.
    destinations: Vec<(u64, u64)>,
    deadline: std::time::Duration,
    requests: Arc<[BackendGet]>,
}

impl Clone for LastRequests {
    fn clone(&self) -> Self {
        LastRequests::default()
    }
}

impl std::fmt::Debug for LastRequests {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let built = self.0.lock().as_ref().map(|built| built.requests.len());
        f.debug_struct("LastRequests")
            .field("requests", &built)
            .finish()
    }
}

impl LastRequests {
    /// The last post's requests if it wrote into the same slots under the
    /// same deadline, else `build`'s, kept.
    fn for_destinations(
        &self,
        destinations: Vec<(u64, u64)>,
        deadline: std::time::Duration,
        build: impl FnOnce() -> Result<Vec<BackendGet>, RdmaError>,
    ) -> Result<Arc<[BackendGet]>, RdmaError> {
        let mut last = self.0.lock();
        if let Some(built) = last.as_ref() {
            if built.destinations == destinations && built.deadline == deadline {
                return Ok(Arc::clone(&built.requests));
            }
        }
        let requests: Arc<[BackendGet]> = build()?.into();
        *last = Some(BuiltRequests {
            destinations,
            deadline,
            requests: Arc::clone(&requests),
        });
        Ok(requests)
    }
}

impl TransferList {
    /// Destination buffers one list may name: far above any real slice, so
    /// a mistaken index is refused at push rather than at post.
    pub const MAX_BUFFERS: usize = 1 << 20;

    pub(crate) fn new(peer: PeerId, backend_key: &str) -> TransferList {
        TransferList {
            peer,
            backend_key: backend_key.to_owned(),
            entries: Vec::new(),
            needed: BTreeMap::new(),
            last_requests: LastRequests::default(),
        }
    }

    /// Add a read of everything `src` describes (cut it with
    /// [`Descriptor::slice`]) into buffer `buffer` at byte `offset`; returns
    /// the entry's index in every post's results.
    ///
    /// # Errors
    /// [`RdmaError::InvalidDescriptor`] if `src` names another backend;
    /// [`RdmaError::OutOfRange`] for an empty range, an overflowing offset,
    /// or `buffer >= MAX_BUFFERS`. The list is unchanged on error.
    pub fn push(
        &mut self,
        src: &Descriptor,
        buffer: usize,
        offset: usize,
    ) -> Result<usize, RdmaError> {
        if src.backend_key() != self.backend_key {
            return Err(RdmaError::InvalidDescriptor(
                DescriptorError::InvalidBackendKey,
            ));
        }
        if buffer >= Self::MAX_BUFFERS {
            return Err(RdmaError::OutOfRange);
        }
        let end = (offset as u64)
            .checked_add(src.len())
            .filter(|_| !src.is_empty())
            .ok_or(RdmaError::OutOfRange)?;
        self.last_requests = LastRequests::default();
        let furthest = self.needed.entry(buffer).or_insert(0);
        *furthest = (*furthest).max(end);
        self.entries.push(Entry {
            remote_addr: src.addr(),
            packed_key: src.packed_key().clone(),
            len: src.len(),
            buffer,
            offset: offset as u64,
        });
        Ok(self.entries.len() - 1)
    }

    /// The peer every entry reads from.
    pub fn peer(&self) -> PeerId {
        self.peer
    }

    /// Number of reads.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether the list has no reads.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Bytes one post moves.
    pub fn total_bytes(&self) -> u64 {
        self.entries.iter().map(|e| e.len).sum()
    }

    /// How many destination buffers a post needs (highest index plus one).
    pub fn buffers_needed(&self) -> usize {
        self.needed
            .last_key_value()
            .map_or(0, |(&index, _)| index + 1)
    }
}

/// [`RdmaRegistry::post`](crate::RdmaRegistry::post), counting outcomes.
pub(crate) async fn post(
    inner: &Arc<Inner>,
    list: &TransferList,
    buffers: &mut [PinnedBuf],
) -> Result<Vec<Result<(), RdmaError>>, RdmaError> {
    let mut took = None;
    let result = post_timed(inner, list, buffers, &mut took).await;
    match (&result, took) {
        (Ok(outcomes), Some(took)) => inner.counters.list(
            list.entries
                .iter()
                .zip(outcomes)
                .map(|(entry, outcome)| (entry.len, outcome)),
            took,
        ),
        (result, _) => inner.counters.outcome(result),
    }
    result
}

/// The post; sets `took` to the time from admission to the results.
async fn post_timed(
    inner: &Arc<Inner>,
    list: &TransferList,
    buffers: &mut [PinnedBuf],
    took: &mut Option<std::time::Duration>,
) -> Result<Vec<Result<(), RdmaError>>, RdmaError> {
    if list.backend_key != inner.backend_key {
        return Err(RdmaError::InvalidDescriptor(
            DescriptorError::InvalidBackendKey,
        ));
    }
    if buffers.len() < list.buffers_needed() {
        return Err(RdmaError::OutOfRange);
    }
    // Check every destination the list writes before taking anything.
    for (&index, &needed) in &list.needed {
        let buffer = &buffers[index];
        if buffer.is_surrendered() {
            return Err(RdmaError::BufferSurrendered);
        }
        if !buffer.belongs_to(inner) {
            return Err(RdmaError::ForeignBuffer);
        }
        if needed > buffer.len() as u64 {
            return Err(RdmaError::DestinationTooSmall {
                needed,
                available: buffer.len() as u64,
            });
        }
    }
    if list.entries.is_empty() {
        return Ok(Vec::new());
    }
    let mut destinations = Vec::with_capacity(list.needed.len());
    for &index in list.needed.keys() {
        let slot = buffers[index].slot().ok_or(RdmaError::RegionNotFound)?;
        destinations.push((slot.arena.backend_region_id, slot.offset()));
    }
    let deadline = inner.config.get_deadline;
    let requests = list
        .last_requests
        .for_destinations(destinations, deadline, || {
            let mut requests = Vec::with_capacity(list.entries.len());
            for entry in &list.entries {
                let slot = buffers[entry.buffer]
                    .slot()
                    .ok_or(RdmaError::RegionNotFound)?;
                requests.push(BackendGet {
                    peer: list.peer,
                    remote_addr: entry.remote_addr,
                    packed_key: entry.packed_key.clone(),
                    local_region_id: slot.arena.backend_region_id,
                    local_offset: slot.offset() + entry.offset,
                    len: entry.len,
                    deadline: Some(deadline),
                });
            }
            Ok(requests)
        })?;
    let ticket = inner.gate.enter().ok_or(RdmaError::ShuttingDown)?;
    let admitted = std::time::Instant::now();
    let in_flight = InFlight::new(inner);
    // Alone, poll before sleeping, as a lone GET does (`get_busy_poll`).
    let alone = inner.transfers_in_flight.load(Ordering::SeqCst) == 1;
    let list_bytes = list.entries.iter().map(|entry| entry.len).sum::<u64>();
    let busy_poll = (alone && !inner.config.get_busy_poll.is_zero())
        .then(|| busy_poll_window(inner.config.get_busy_poll, list_bytes));
    // Take the written buffers' slots (checked above) until the batch ends.
    let written: Vec<usize> = list.needed.keys().copied().collect();
    let slots: Vec<_> = written
        .iter()
        .filter_map(|&i| buffers[i].take_slot())
        .collect();
    let backend = Arc::clone(&inner.backend);
    let transfer: BoxFuture<'static, Vec<Result<(), RdmaError>>> =
        // SAFETY: every destination is a slot's bytes in a pool arena the
        // registry mapped, and every written slot was taken out above, so no
        // `PinnedBuf` reaches those bytes until `pending` hands them back
        // after the backend completed every entry. Overlapping entries are
        // both the transport's writes, read only after the batch. Kept
        // requests were built for these same slots, offsets and deadline.
        Box::pin(async move { unsafe { backend.get_shared_batch(requests) }.await });
    let mut pending = PendingTransfer {
        transfer: Some(transfer),
        slots: HeldSlots(slots),
        ticket: Some(ticket),
        in_flight: Some(in_flight),
        handle: inner.handle.clone(),
        busy_poll,
    };
    let outcomes = (&mut pending).await;
    *took = Some(admitted.elapsed());
    for (&i, slot) in written.iter().zip(pending.finish()) {
        buffers[i].restore(slot);
    }
    outcomes.ok_or(RdmaError::RegionNotFound)
}
