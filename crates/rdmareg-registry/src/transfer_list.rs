//! Transfer lists: many GETs and PUTs with one peer, checked once and
//! posted as one submission, any number of times.
//!
//! A post into the same slots as the one before reuses its GET requests
//! through [`RdmaBackend::get_shared_batch`], so a backend may keep what it
//! worked out for them; its PUTs go through [`RdmaBackend::put_batch`], at
//! the same time. A post checks every buffer before submitting anything, is
//! admitted through the gate, holds every slot until the backend completed
//! every entry, and gives each entry its own result. Like a single
//! transfer, a dropped post surrenders its buffers.
//!
//! A read and a write of one list may not share buffer bytes: the write
//! could send bytes the read is replacing. `push` and `push_put` refuse
//! that, so every post's entries are independent.
//!
//! [`RdmaBackend::get_shared_batch`]: rdmareg_backend::RdmaBackend::get_shared_batch
//! [`RdmaBackend::put_batch`]: rdmareg_backend::RdmaBackend::put_batch

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use bytes::Bytes;
use futures::future::BoxFuture;
use rdmareg_backend::{BackendGet, BackendPut};
use rdmareg_core::{Descriptor, DescriptorError, PeerId, RdmaError};

use crate::pool::PinnedBuf;
use crate::registry::Inner;
use crate::transfer::{HeldSlots, InFlight, PendingTransfer, busy_poll_window};

/// One entry of a list: a described range read into a buffer, or a
/// buffer's bytes written into a described range.
#[derive(Debug, Clone)]
struct Entry {
    remote_addr: u64,
    packed_key: Bytes,
    len: u64,
    /// Index into the buffers given to `post`.
    buffer: usize,
    offset: u64,
    /// A write of the buffer's bytes rather than a read into them.
    write: bool,
}

impl Entry {
    /// Whether this entry and `other` touch one byte of one buffer.
    fn shares_bytes_with(&self, buffer: usize, offset: u64, len: u64) -> bool {
        self.buffer == buffer && self.offset < offset + len && offset < self.offset + self.len
    }
}

/// Reads from and writes to one peer, checked once, posted as one
/// submission any number of times with
/// [`RdmaRegistry::post`](crate::RdmaRegistry::post).
///
/// Entries name buffers by index into each post's slice of buffers, so one
/// list can move bytes of different buffers of the same shapes.
#[derive(Debug, Clone)]
pub struct TransferList {
    peer: PeerId,
    backend_key: String,
    entries: Vec<Entry>,
    /// Per buffer index named (not dense), the end of its furthest entry.
    needed: BTreeMap<usize, u64>,
    /// The same, for the entries that write a buffer's bytes out.
    needed_by_writes: BTreeMap<usize, u64>,
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
            needed_by_writes: BTreeMap::new(),
            last_requests: LastRequests::default(),
        }
    }

    /// Add a read of everything `src` describes (cut it with
    /// [`Descriptor::slice`]) into buffer `buffer` at byte `offset`; returns
    /// the entry's index in every post's results.
    ///
    /// # Errors
    /// [`RdmaError::InvalidDescriptor`] if `src` names another backend;
    /// [`RdmaError::AccessDenied`] if `src` does not grant reads;
    /// [`RdmaError::OutOfRange`] for an empty range, an overflowing offset
    /// or `buffer >= MAX_BUFFERS`; [`RdmaError::OverlappingEntries`] for
    /// bytes a write of this list sends. The list is unchanged on error.
    pub fn push(
        &mut self,
        src: &Descriptor,
        buffer: usize,
        offset: usize,
    ) -> Result<usize, RdmaError> {
        self.add(src, buffer, offset, false)
    }

    /// Add a write of `buffer`'s bytes from `offset` into everything `dst`
    /// describes (cut it with [`Descriptor::slice`]); returns the entry's
    /// index in every post's results.
    ///
    /// # Errors
    /// [`RdmaError::InvalidDescriptor`] if `dst` names another backend;
    /// [`RdmaError::AccessDenied`] if `dst` does not grant writes (the
    /// owner refuses a write whatever the descriptor says);
    /// [`RdmaError::OutOfRange`] for an empty range, an overflowing offset
    /// or `buffer >= MAX_BUFFERS`; [`RdmaError::OverlappingEntries`] for
    /// bytes a read of this list writes. The list is unchanged on error.
    pub fn push_put(
        &mut self,
        dst: &Descriptor,
        buffer: usize,
        offset: usize,
    ) -> Result<usize, RdmaError> {
        self.add(dst, buffer, offset, true)
    }

    fn add(
        &mut self,
        remote: &Descriptor,
        buffer: usize,
        offset: usize,
        write: bool,
    ) -> Result<usize, RdmaError> {
        if remote.backend_key() != self.backend_key {
            return Err(RdmaError::InvalidDescriptor(
                DescriptorError::InvalidBackendKey,
            ));
        }
        let (granted, operation) = if write {
            (remote.access().allows_write(), "write")
        } else {
            (remote.access().allows_read(), "read")
        };
        if !granted {
            return Err(RdmaError::AccessDenied { operation });
        }
        if buffer >= Self::MAX_BUFFERS {
            return Err(RdmaError::OutOfRange);
        }
        let (offset, len) = (offset as u64, remote.len());
        let end = offset
            .checked_add(len)
            .filter(|_| !remote.is_empty())
            .ok_or(RdmaError::OutOfRange)?;
        let crosses = self
            .entries
            .iter()
            .any(|entry| entry.write != write && entry.shares_bytes_with(buffer, offset, len));
        if crosses {
            return Err(RdmaError::OverlappingEntries { buffer });
        }
        self.last_requests = LastRequests::default();
        for needed in [
            Some(&mut self.needed),
            write.then_some(&mut self.needed_by_writes),
        ]
        .into_iter()
        .flatten()
        {
            let furthest = needed.entry(buffer).or_insert(0);
            *furthest = (*furthest).max(end);
        }
        self.entries.push(Entry {
            remote_addr: remote.addr(),
            packed_key: remote.packed_key().clone(),
            len,
            buffer,
            offset,
            write,
        });
        Ok(self.entries.len() - 1)
    }

    /// The peer every entry reads from.
    pub fn peer(&self) -> PeerId {
        self.peer
    }

    /// Number of entries, reads and writes.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Number of writes.
    pub fn writes(&self) -> usize {
        self.entries.iter().filter(|entry| entry.write).count()
    }

    /// Whether the list has no entries.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Bytes one post moves.
    ///
    /// Saturates at `u64::MAX`: descriptors are peers' bytes, and entries
    /// of forged lengths are refused only when posted.
    pub fn total_bytes(&self) -> u64 {
        self.entries
            .iter()
            .fold(0u64, |total, entry| total.saturating_add(entry.len))
    }

    /// How many buffers a post needs (highest index plus one).
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
        (Ok(outcomes), Some(took)) => {
            let entries = list.entries.iter().zip(outcomes);
            let (writes, reads): (Vec<_>, Vec<_>) = entries.partition(|(entry, _)| entry.write);
            for (entry, outcome) in writes {
                inner.counters.put(entry.len, outcome);
            }
            inner.counters.list(
                reads
                    .into_iter()
                    .map(|(entry, outcome)| (entry.len, outcome)),
                took,
            );
        }
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
        return Err(RdmaError::MissingBuffers {
            needed: list.buffers_needed(),
            given: buffers.len(),
        });
    }
    // Check every buffer the list uses before taking anything.
    for (&index, &needed) in &list.needed {
        let buffer = &buffers[index];
        if buffer.is_surrendered() {
            return Err(RdmaError::BufferSurrendered);
        }
        if !buffer.belongs_to(inner) {
            return Err(RdmaError::ForeignBuffer);
        }
        let available = buffer.len() as u64;
        match list.needed_by_writes.get(&index) {
            Some(&needed) if needed > available => {
                return Err(RdmaError::SourceTooSmall { needed, available });
            }
            _ if needed > available => {
                return Err(RdmaError::DestinationTooSmall { needed, available });
            }
            _ => {}
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
            for entry in list.entries.iter().filter(|entry| !entry.write) {
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
    let mut writes = Vec::with_capacity(list.writes());
    for entry in list.entries.iter().filter(|entry| entry.write) {
        let slot = buffers[entry.buffer]
            .slot()
            .ok_or(RdmaError::RegionNotFound)?;
        writes.push(BackendPut {
            peer: list.peer,
            remote_addr: entry.remote_addr,
            packed_key: entry.packed_key.clone(),
            local_region_id: slot.arena.backend_region_id,
            local_offset: slot.offset() + entry.offset,
            len: entry.len,
            deadline: Some(deadline),
        });
    }
    let kinds: Vec<bool> = list.entries.iter().map(|entry| entry.write).collect();
    let ticket = inner.gate.enter().ok_or(RdmaError::ShuttingDown)?;
    let admitted = std::time::Instant::now();
    let in_flight = InFlight::new(inner);
    // Alone, poll before sleeping, as a lone GET does (`get_busy_poll`).
    let alone = inner.transfers_in_flight.load(Ordering::SeqCst) == 1;
    let list_bytes = list.total_bytes();
    let busy_poll = (alone && !inner.config.get_busy_poll.is_zero())
        .then(|| busy_poll_window(inner.config.get_busy_poll, list_bytes));
    // Take the used buffers' slots (checked above) until the batch ends.
    let used: Vec<usize> = list.needed.keys().copied().collect();
    let slots: Vec<_> = used
        .iter()
        .filter_map(|&i| buffers[i].take_slot())
        .collect();
    let backend = Arc::clone(&inner.backend);
    // The terms of every backend call below: every destination and source
    // is a slot's bytes in a pool arena the registry mapped, and every used
    // slot was taken out above, so no `PinnedBuf` reaches those bytes until
    // `pending` hands them back after the backend completed every entry.
    // Overlapping reads are both the transport's writes, read only after the
    // batch; no read shares bytes with a write (`TransferList::add`). Kept
    // requests were built for these same slots, offsets and deadline.
    let transfer: BoxFuture<'static, Vec<Result<(), RdmaError>>> = Box::pin(async move {
        match (requests.is_empty(), writes.is_empty()) {
            // SAFETY: the terms above.
            (_, true) => unsafe { backend.get_shared_batch(requests) }.await,
            // SAFETY: the terms above.
            (true, false) => unsafe { backend.put_batch(writes) }.await,
            (false, false) => {
                // SAFETY: the terms above.
                let (reads, writes) = unsafe {
                    (
                        backend.get_shared_batch(requests),
                        backend.put_batch(writes),
                    )
                };
                let (reads, writes) = futures::join!(reads, writes);
                in_entry_order(&kinds, reads, writes)
            }
        }
    });
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
    for (&i, slot) in used.iter().zip(pending.finish()) {
        buffers[i].restore(slot);
    }
    outcomes.ok_or(RdmaError::RegionNotFound)
}

/// The reads' and the writes' results merged back into the list's order
/// (`writes[i]` says whether entry `i` is a write).
fn in_entry_order(
    writes: &[bool],
    read_results: Vec<Result<(), RdmaError>>,
    write_results: Vec<Result<(), RdmaError>>,
) -> Vec<Result<(), RdmaError>> {
    let (mut reads, mut puts) = (read_results.into_iter(), write_results.into_iter());
    let lost = || {
        Err(RdmaError::backend(
            "the backend answered fewer entries than posted",
        ))
    };
    writes
        .iter()
        .map(|&write| {
            let next = if write { puts.next() } else { reads.next() };
            next.unwrap_or_else(lost)
        })
        .collect()
}
