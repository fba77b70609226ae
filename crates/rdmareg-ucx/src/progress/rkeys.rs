//! The cache of unpacked remote keys, per endpoint.
//!
//! Validating and unpacking a key costs about as much as a whole GET on
//! shared memory, and a consumer reads the same owner region many times, so
//! the unpacked `ucp_rkey_h` is cached under (endpoint serial, key bytes).
//!
//! # Rules
//!
//! - A key is destroyed only when no posted GET uses it: every entry counts
//!   its in-flight users, and an entry that must go while in use (evicted, or
//!   its endpoint failed or closed) is *retired* — taken out of the index,
//!   destroyed when its last user completes.
//! - The cache is bounded: inserting into a full cache evicts the least
//!   recently used idle entry; if every entry is busy, the new key is used
//!   uncached (retired from the start).
//! - Every key is destroyed before the worker that unpacked it.

use std::collections::HashMap;

use bytes::Bytes;

use super::ucp::RkeyHandle;

#[derive(Debug)]
struct Entry {
    handle: RkeyHandle,
    serial: u64,
    key: Bytes,
    in_flight: u32,
    retired: bool,
    last_used: u64,
}

/// Remote keys by id, with an index by (endpoint serial, key bytes).
#[derive(Debug)]
pub(crate) struct RkeyTable {
    entries: HashMap<u64, Entry>,
    index: HashMap<u64, HashMap<Bytes, u64>>,
    cached: usize,
    capacity: usize,
    next_id: u64,
    tick: u64,
}

impl RkeyTable {
    /// An empty cache holding at most `capacity` idle keys.
    pub(crate) fn new(capacity: usize) -> RkeyTable {
        RkeyTable {
            entries: HashMap::new(),
            index: HashMap::new(),
            cached: 0,
            capacity: capacity.max(1),
            next_id: 1,
            tick: 0,
        }
    }

    /// The cached key for `key` on endpoint `serial`.
    pub(crate) fn lookup(&mut self, serial: u64, key: &[u8]) -> Option<(u64, RkeyHandle)> {
        let id = *self.index.get(&serial)?.get(key)?;
        self.tick += 1;
        let entry = self.entries.get_mut(&id)?;
        entry.last_used = self.tick;
        Some((id, entry.handle))
    }

    /// Adds a freshly unpacked key; returns its id and any handles the
    /// caller must now destroy (an evicted idle entry).
    pub(crate) fn insert(
        &mut self,
        serial: u64,
        key: Bytes,
        handle: RkeyHandle,
    ) -> (u64, Vec<RkeyHandle>) {
        let mut destroy = Vec::new();
        let mut retired = false;
        if self.cached >= self.capacity {
            match self.least_recently_used_idle() {
                Some(victim) => destroy.extend(self.remove(victim)),
                None => retired = true,
            }
        }
        let id = self.next_id;
        self.next_id += 1;
        self.tick += 1;
        if !retired {
            self.index
                .entry(serial)
                .or_default()
                .insert(key.clone(), id);
            self.cached += 1;
        }
        self.entries.insert(
            id,
            Entry {
                handle,
                serial,
                key,
                in_flight: 0,
                retired,
                last_used: self.tick,
            },
        );
        (id, destroy)
    }

    /// A GET using `id` was posted.
    pub(crate) fn acquire(&mut self, id: u64) {
        if let Some(entry) = self.entries.get_mut(&id) {
            entry.in_flight += 1;
        }
    }

    /// A GET using `id` completed; returns the handle if it must now be
    /// destroyed.
    pub(crate) fn release(&mut self, id: u64) -> Option<RkeyHandle> {
        let entry = self.entries.get_mut(&id)?;
        entry.in_flight = entry.in_flight.saturating_sub(1);
        if entry.retired && entry.in_flight == 0 {
            return self.entries.remove(&id).map(|e| e.handle);
        }
        None
    }

    /// An id that was looked up or inserted but whose GET never got posted:
    /// destroy it now if it is retired and unused.
    pub(crate) fn discard_if_unused(&mut self, id: u64) -> Option<RkeyHandle> {
        let entry = self.entries.get(&id)?;
        if entry.retired && entry.in_flight == 0 {
            return self.entries.remove(&id).map(|e| e.handle);
        }
        None
    }

    /// The endpoint `serial` is going away: retire its keys; returns those
    /// that can be destroyed at once.
    pub(crate) fn retire_endpoint(&mut self, serial: u64) -> Vec<RkeyHandle> {
        let Some(keys) = self.index.remove(&serial) else {
            return Vec::new();
        };
        self.cached -= keys.len();
        let mut destroy = Vec::new();
        for id in keys.into_values() {
            if let Some(entry) = self.entries.get_mut(&id) {
                entry.retired = true;
                if entry.in_flight == 0 {
                    destroy.extend(self.entries.remove(&id).map(|e| e.handle));
                }
            }
        }
        destroy
    }

    /// Every key, busy or not, for teardown; returns `(handle, in_flight)`.
    pub(crate) fn drain_all(&mut self) -> Vec<(RkeyHandle, u32)> {
        self.index.clear();
        self.cached = 0;
        self.entries
            .drain()
            .map(|(_, e)| (e.handle, e.in_flight))
            .collect()
    }

    /// How many keys are held (cached or retired-but-busy).
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    fn least_recently_used_idle(&self) -> Option<u64> {
        self.entries
            .iter()
            .filter(|(_, e)| !e.retired && e.in_flight == 0)
            .min_by_key(|(_, e)| e.last_used)
            .map(|(id, _)| *id)
    }

    /// Takes an idle cached entry out; returns its handle.
    fn remove(&mut self, id: u64) -> Option<RkeyHandle> {
        let entry = self.entries.remove(&id)?;
        if !entry.retired {
            if let Some(keys) = self.index.get_mut(&entry.serial) {
                keys.remove(&entry.key);
                if keys.is_empty() {
                    self.index.remove(&entry.serial);
                }
            }
            self.cached -= 1;
        }
        Some(entry.handle)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn handle(n: usize) -> RkeyHandle {
        RkeyHandle::dangling_for_tests(n)
    }

    #[test]
    fn a_cached_key_is_found_again_on_the_same_endpoint_only() {
        let mut t = RkeyTable::new(4);
        let (id, destroy) = t.insert(1, Bytes::from_static(b"key"), handle(1));
        assert!(destroy.is_empty());
        assert_eq!(t.lookup(1, b"key").map(|(i, _)| i), Some(id));
        assert!(t.lookup(2, b"key").is_none());
        assert!(t.lookup(1, b"other").is_none());
    }

    #[test]
    fn a_full_cache_evicts_the_least_recently_used_idle_key() {
        let mut t = RkeyTable::new(2);
        t.insert(1, Bytes::from_static(b"a"), handle(1));
        t.insert(1, Bytes::from_static(b"b"), handle(2));
        t.lookup(1, b"a");
        let (_, destroy) = t.insert(1, Bytes::from_static(b"c"), handle(3));
        assert_eq!(destroy.len(), 1);
        assert!(t.lookup(1, b"b").is_none(), "b was least recently used");
        assert!(t.lookup(1, b"a").is_some());
        assert!(t.lookup(1, b"c").is_some());
    }

    #[test]
    fn a_busy_key_is_never_destroyed_until_its_last_get_completes() {
        let mut t = RkeyTable::new(1);
        let (a, _) = t.insert(1, Bytes::from_static(b"a"), handle(1));
        t.acquire(a);
        // Cache full of busy keys: the newcomer is used uncached.
        let (b, destroy) = t.insert(1, Bytes::from_static(b"b"), handle(2));
        assert!(destroy.is_empty());
        assert!(t.lookup(1, b"b").is_none());
        assert!(
            t.discard_if_unused(b).is_some(),
            "an unused uncached key goes at once"
        );
        // Endpoint failure retires the busy key without destroying it.
        assert!(t.retire_endpoint(1).is_empty());
        assert_eq!(t.len(), 1);
        assert!(
            t.release(a).is_some(),
            "destroyed when its last GET completes"
        );
        assert_eq!(t.len(), 0);
    }

    #[test]
    fn retiring_an_endpoint_destroys_its_idle_keys_at_once() {
        let mut t = RkeyTable::new(8);
        t.insert(1, Bytes::from_static(b"a"), handle(1));
        t.insert(1, Bytes::from_static(b"b"), handle(2));
        t.insert(2, Bytes::from_static(b"a"), handle(3));
        assert_eq!(t.retire_endpoint(1).len(), 2);
        assert!(t.lookup(2, b"a").is_some());
        assert_eq!(t.drain_all().len(), 1);
    }
}
