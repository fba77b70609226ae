//! The registration table of one loopback instance: which ranges are
//! registered, how many transfers hold each, and how far each unmap got.
//!
//! A region goes `Live` → `Requested` (unmap submitted; new pins refused) →
//! `Released` (the unmap's delay is over, it was dropped, or shutdown
//! forced it) → removed once no transfer pins it, so an `Ok(())` unmap
//! means no transfer can touch it. The mutex is never held across an await;
//! waiters use [`Notify`] enable-then-check, so no change is lost.

use std::collections::HashMap;
use std::pin::pin;

use parking_lot::Mutex;
use rdmareg_core::{Access, WrittenLog, WrittenRanges};
use tokio::sync::Notify;

/// A byte range a transfer wants to pin.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Span {
    /// `[addr, addr + len)`, absolute (a remote range).
    Absolute { addr: u64, len: u64 },
    /// `[ptr + offset, ..+ len)` from the mapped pointer (a destination).
    Offset { offset: u64, len: u64 },
}

/// Why a pin was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PinError {
    /// The instance is shutting down.
    Closed,
    /// No such region, another registration than the key names, or unmapping.
    NotFound,
    /// The span leaves the mapped pointer and length, or overflows.
    OutOfRange,
}

/// What submitting an unmap found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum UnmapStart {
    /// The id names nothing.
    Absent,
    /// This call moved the region to `Requested`.
    Started,
    /// Another unmap is already under way; wait for it.
    AlreadyUnmapping,
    /// The region is live but the instance is shutting down.
    Closed,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    Live,
    Requested,
    Released,
}

#[derive(Debug)]
struct Region {
    ptr: usize,
    len: usize,
    nonce: u64,
    access: Access,
    pins: usize,
    stage: Stage,
    /// Ranges PUTs copied in whole since the last take.
    written: WrittenLog,
}

#[derive(Debug)]
struct TableState {
    regions: HashMap<u64, Region>,
    next_id: u64,
    closed: bool,
    removed: u64,
}

/// The registrations of one instance.
#[derive(Debug)]
pub(crate) struct RegionTable {
    state: Mutex<TableState>,
    changed: Notify,
}

impl RegionTable {
    pub(crate) fn new() -> Self {
        Self {
            state: Mutex::new(TableState {
                regions: HashMap::new(),
                next_id: 1,
                closed: false,
                removed: 0,
            }),
            changed: Notify::new(),
        }
    }

    /// Register a range; `None` once the table is closed.
    pub(crate) fn insert(&self, ptr: usize, len: usize, nonce: u64, access: Access) -> Option<u64> {
        let mut state = self.state.lock();
        if state.closed {
            return None;
        }
        let id = state.next_id;
        state.next_id += 1;
        state.regions.insert(
            id,
            Region {
                ptr,
                len,
                nonce,
                access,
                pins: 0,
                stage: Stage::Live,
                written: WrittenLog::default(),
            },
        );
        Some(id)
    }

    /// What peers may do with region `id`; `None` once it is gone.
    pub(crate) fn access(&self, id: u64) -> Option<Access> {
        self.state
            .lock()
            .regions
            .get(&id)
            .map(|region| region.access)
    }

    /// A PUT copied `len` bytes whole to `addr` of region `id`, which it
    /// pins: listed in the region's log of written ranges.
    pub(crate) fn record_written(&self, id: u64, addr: usize, len: usize) {
        if let Some(region) = self.state.lock().regions.get_mut(&id) {
            let start = addr.saturating_sub(region.ptr) as u64;
            region.written.record(start..start + len as u64);
        }
    }

    /// The ranges PUTs wrote into region `id` since the last take; `None`
    /// once it is gone.
    pub(crate) fn take_written(&self, id: u64) -> Option<WrittenRanges> {
        self.state
            .lock()
            .regions
            .get_mut(&id)
            .map(|region| region.written.take())
    }

    /// Registrations held, including those being unmapped.
    pub(crate) fn live(&self) -> usize {
        self.state.lock().regions.len()
    }

    /// Transfers pinning region `id` (0 if it names nothing).
    pub(crate) fn pins(&self, id: u64) -> usize {
        self.state.lock().regions.get(&id).map_or(0, |r| r.pins)
    }

    /// Regions removed so far (by unmap or by shutdown).
    pub(crate) fn removed(&self) -> u64 {
        self.state.lock().removed
    }

    /// Pin `span` of region `id` for a transfer and return the address of its
    /// first byte. `nonce`, when given, must match the registration's.
    pub(crate) fn pin(&self, id: u64, nonce: Option<u64>, span: Span) -> Result<usize, PinError> {
        let mut state = self.state.lock();
        if state.closed {
            return Err(PinError::Closed);
        }
        let region = state.regions.get_mut(&id).ok_or(PinError::NotFound)?;
        if region.stage != Stage::Live || nonce.is_some_and(|n| n != region.nonce) {
            return Err(PinError::NotFound);
        }
        let start = span_start(region, span)?;
        region.pins += 1;
        Ok(start)
    }

    /// Release one pin taken by [`pin`](Self::pin).
    pub(crate) fn unpin(&self, id: u64) {
        let notify = {
            let mut state = self.state.lock();
            let Some(region) = state.regions.get_mut(&id) else {
                tracing::error!(
                    region = id,
                    "loopback: unpin of a region that is not registered"
                );
                return;
            };
            region.pins -= 1;
            let idle = region.pins == 0;
            if idle {
                remove_if_done(&mut state, id);
            }
            idle
        };
        if notify {
            self.changed.notify_waiters();
        }
    }

    /// Submit an unmap of `id`.
    pub(crate) fn start_unmap(&self, id: u64) -> UnmapStart {
        let mut state = self.state.lock();
        let closed = state.closed;
        match state.regions.get_mut(&id) {
            None => UnmapStart::Absent,
            Some(region) if region.stage != Stage::Live => UnmapStart::AlreadyUnmapping,
            Some(_) if closed => UnmapStart::Closed,
            Some(region) => {
                region.stage = Stage::Requested;
                UnmapStart::Started
            }
        }
    }

    /// What [`start_unmap`](Self::start_unmap) would return, changing nothing.
    pub(crate) fn peek(&self, id: u64) -> UnmapStart {
        let state = self.state.lock();
        match state.regions.get(&id) {
            None => UnmapStart::Absent,
            Some(region) if region.stage != Stage::Live => UnmapStart::AlreadyUnmapping,
            Some(_) if state.closed => UnmapStart::Closed,
            Some(_) => UnmapStart::Started,
        }
    }

    /// Let a `Requested` region go, now or at its last unpin.
    pub(crate) fn release_unmap(&self, id: u64) {
        let removed = {
            let mut state = self.state.lock();
            match state.regions.get_mut(&id) {
                Some(region) if region.stage == Stage::Requested => {
                    region.stage = Stage::Released;
                    remove_if_done(&mut state, id)
                }
                _ => false,
            }
        };
        if removed {
            self.changed.notify_waiters();
        }
    }

    /// Resolve once `id` is no longer registered.
    pub(crate) async fn wait_absent(&self, id: u64) {
        self.wait_until(|state| !state.regions.contains_key(&id))
            .await;
    }

    /// Refuse new registrations and pins from now on.
    pub(crate) fn close(&self) {
        self.state.lock().closed = true;
    }

    /// Resolve once no transfer pins any region.
    pub(crate) async fn wait_unpinned(&self) {
        self.wait_until(|state| state.regions.values().all(|r| r.pins == 0))
            .await;
    }

    /// Release every region being unmapped (and live ones if `live_as_well`);
    /// returns how many remain.
    pub(crate) fn force_release(&self, live_as_well: bool) -> usize {
        let remaining = {
            let mut state = self.state.lock();
            let ids: Vec<u64> = state
                .regions
                .iter()
                .filter(|(_, r)| r.stage == Stage::Requested || live_as_well)
                .map(|(id, _)| *id)
                .collect();
            for id in ids {
                if let Some(region) = state.regions.get_mut(&id) {
                    region.stage = Stage::Released;
                }
                remove_if_done(&mut state, id);
            }
            state.regions.len()
        };
        self.changed.notify_waiters();
        remaining
    }

    async fn wait_until(&self, mut done: impl FnMut(&TableState) -> bool) {
        loop {
            let mut notified = pin!(self.changed.notified());
            notified.as_mut().enable();
            if done(&self.state.lock()) {
                return;
            }
            notified.await;
        }
    }
}

/// Remove `id` if its unmap is released and nothing pins it; returns whether
/// it was removed.
fn remove_if_done(state: &mut TableState, id: u64) -> bool {
    let done = state
        .regions
        .get(&id)
        .is_some_and(|r| r.stage == Stage::Released && r.pins == 0);
    if done {
        state.regions.remove(&id);
        state.removed += 1;
    }
    done
}

/// First address of `span` inside `region`'s mapped pointer and length.
fn span_start(region: &Region, span: Span) -> Result<usize, PinError> {
    let (ptr, len) = (region.ptr as u64, region.len as u64);
    let (start, span_len) = match span {
        Span::Absolute { addr, len } => (addr, len),
        Span::Offset { offset, len } => (ptr.checked_add(offset).ok_or(PinError::OutOfRange)?, len),
    };
    let end = start.checked_add(span_len).ok_or(PinError::OutOfRange)?;
    if span_len == 0 || start < ptr || end > ptr + len {
        return Err(PinError::OutOfRange);
    }
    usize::try_from(start).map_err(|_| PinError::OutOfRange)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pin_refuses_spans_outside_the_mapped_range() {
        let table = RegionTable::new();
        let id = table.insert(1000, 100, 7, Access::Read).unwrap();
        let off = |offset, len| Span::Offset { offset, len };
        let abs = |addr, len| Span::Absolute { addr, len };
        assert_eq!(table.pin(id, None, off(0, 100)), Ok(1000));
        assert_eq!(table.pin(id, None, off(99, 1)), Ok(1099));
        assert_eq!(table.pin(id, None, off(100, 1)), Err(PinError::OutOfRange));
        assert_eq!(table.pin(id, None, off(1, 100)), Err(PinError::OutOfRange));
        assert_eq!(table.pin(id, None, off(0, 0)), Err(PinError::OutOfRange));
        assert_eq!(
            table.pin(id, None, off(u64::MAX, 2)),
            Err(PinError::OutOfRange)
        );
        assert_eq!(table.pin(id, None, abs(999, 1)), Err(PinError::OutOfRange));
        assert_eq!(table.pin(id, None, abs(1050, 50)), Ok(1050));
        assert_eq!(
            table.pin(id, None, abs(u64::MAX, 2)),
            Err(PinError::OutOfRange)
        );
        assert_eq!(
            table.pin(id, Some(8), abs(1000, 1)),
            Err(PinError::NotFound)
        );
        assert_eq!(table.pin(id + 1, None, off(0, 1)), Err(PinError::NotFound));
    }

    #[test]
    fn released_region_stays_until_its_last_pin_goes() {
        let table = RegionTable::new();
        let id = table.insert(4096, 10, 1, Access::Read).unwrap();
        table
            .pin(id, None, Span::Offset { offset: 0, len: 1 })
            .unwrap();
        assert_eq!(table.start_unmap(id), UnmapStart::Started);
        assert_eq!(
            table.pin(id, None, Span::Offset { offset: 0, len: 1 }),
            Err(PinError::NotFound)
        );
        table.release_unmap(id);
        assert_eq!(table.live(), 1);
        table.unpin(id);
        assert_eq!(table.live(), 0);
        assert_eq!(table.removed(), 1);
    }

    #[test]
    fn closed_table_refuses_inserts_and_pins() {
        let table = RegionTable::new();
        let id = table.insert(4096, 10, 1, Access::Read).unwrap();
        table.close();
        assert_eq!(table.insert(8192, 10, 2, Access::Read), None);
        assert_eq!(
            table.pin(id, None, Span::Offset { offset: 0, len: 1 }),
            Err(PinError::Closed)
        );
        assert_eq!(table.start_unmap(id), UnmapStart::Closed);
        assert_eq!(table.force_release(true), 0);
    }
}
