//! Descriptor leases on the loopback fabric, with the shared rules of
//! [`crate::leases`].
//!
//! A lease key is `b"LBL1"`, the instance, the region id and the lease's
//! 16-byte capability (36 bytes, little-endian); a GET presenting one is
//! judged against the region's leases at the time it starts, before the
//! region is pinned. A release travels as the notice wire's release
//! message, delivered at once like a notice, and is counted once per
//! sending instance and sender number.

use std::time::Instant;

use bytes::{BufMut, Bytes, BytesMut};
use futures::FutureExt;
use rdmareg_core::{LeaseTerms, PeerId, RdmaError};

use super::LoopbackBackend;
use super::key::fresh_nonce;
use super::table::UnmapStart;
use crate::BackendLease;
use crate::leases::RegionLeases;
use crate::notices::wire;

const LEASE_MAGIC: [u8; 4] = *b"LBL1";
/// Exact length of a loopback lease key.
pub(crate) const LEASE_KEY_LEN: usize = 4 + 8 + 8 + 16;

/// A decoded loopback lease key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct LeaseKey {
    pub(crate) instance: u64,
    pub(crate) region: u64,
    pub(crate) capability: [u8; 16],
}

impl LeaseKey {
    fn encode(&self) -> Bytes {
        let mut out = BytesMut::with_capacity(LEASE_KEY_LEN);
        out.put_slice(&LEASE_MAGIC);
        out.put_u64_le(self.instance);
        out.put_u64_le(self.region);
        out.put_slice(&self.capability);
        out.freeze()
    }

    /// `None` for bytes that are not a lease key (they may be a region's).
    pub(crate) fn decode(raw: &[u8]) -> Option<LeaseKey> {
        if raw.len() != LEASE_KEY_LEN || raw[..4] != LEASE_MAGIC {
            return None;
        }
        let field = |at: usize| {
            let mut le = [0u8; 8];
            le.copy_from_slice(&raw[at..at + 8]);
            u64::from_le_bytes(le)
        };
        let mut capability = [0u8; 16];
        capability.copy_from_slice(&raw[20..]);
        Some(LeaseKey {
            instance: field(4),
            region: field(12),
            capability,
        })
    }
}

/// The time leases are judged by: tokio's clock, which is the system's
/// except in tests that pause it (the registry's lease waits use it too).
fn now() -> Instant {
    tokio::time::Instant::now().into_std()
}

/// Each instance's leases, by region id; a reader is the sending
/// instance and its sender number.
pub(crate) type LeaseBook = std::collections::HashMap<u64, RegionLeases<(u64, u64)>>;

impl LoopbackBackend {
    pub(super) fn make_lease(
        &self,
        region: u64,
        terms: LeaseTerms,
    ) -> Result<BackendLease, RdmaError> {
        if self.is_shutting_down() {
            return Err(RdmaError::ShuttingDown);
        }
        let now = now();
        let mut book = self.leases.lock();
        // Under the book's lock, so an unmap that starts now withdraws it.
        if self.table.peek(region) != UnmapStart::Started {
            return Err(RdmaError::RegionNotFound);
        }
        terms.check(now)?;
        let mut capability = [0u8; 16];
        capability[..8].copy_from_slice(&fresh_nonce().to_le_bytes());
        capability[8..].copy_from_slice(&fresh_nonce().to_le_bytes());
        let leases = book.entry(region).or_default();
        leases.sweep(now);
        let released = leases.add(capability, terms);
        let packed_key = LeaseKey {
            instance: self.instance,
            region,
            capability,
        }
        .encode();
        Ok(BackendLease {
            packed_key,
            released: released.boxed(),
        })
    }

    /// Whether a GET under `key` may read now.
    pub(crate) fn judge_lease(&self, key: &LeaseKey) -> Result<(), RdmaError> {
        let book = self.leases.lock();
        match book
            .get(&key.region)
            .and_then(|leases| leases.judge(&key.capability, Some(now())))
        {
            Some(Ok(())) => Ok(()),
            Some(Err(_)) => Err(RdmaError::LeaseExpired),
            None => Err(RdmaError::RegionNotFound),
        }
    }

    /// The region's unmap started: its leases end (their waiters hear
    /// `Withdrawn`).
    pub(super) fn withdraw_leases(&self, region: u64) {
        self.leases.lock().remove(&region);
    }

    pub(super) fn send_release(&self, peer: PeerId, packed_key: &[u8]) -> Result<(), RdmaError> {
        let key = LeaseKey::decode(packed_key).ok_or(RdmaError::InvalidKey)?;
        if self.is_shutting_down() {
            return Err(RdmaError::ShuttingDown);
        }
        let owner = self.fabric.lookup(peer).ok_or(RdmaError::NotConfigured)?;
        let mut sent = self.notices_sent.lock();
        *sent += 1;
        let message = wire::encode_release(self.instance, *sent, key.region, &key.capability);
        owner.receive_release(self.instance, &message);
        Ok(())
    }

    fn receive_release(&self, from: u64, message: &[u8]) {
        let Ok(release) = wire::decode_release(message) else {
            return;
        };
        let mut book = self.leases.lock();
        if let Some(leases) = book.get_mut(&release.region) {
            let outcome = leases.release((from, release.sender), &release.capability, Some(now()));
            tracing::debug!(region = release.region, ?outcome, "loopback lease release");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lease_key_round_trips_and_nothing_else_decodes() {
        let key = LeaseKey {
            instance: 3,
            region: 17,
            capability: [9; 16],
        };
        let wire = key.encode();
        assert_eq!(wire.len(), LEASE_KEY_LEN);
        assert_eq!(LeaseKey::decode(&wire), Some(key));
        for cut in 0..wire.len() {
            assert_eq!(LeaseKey::decode(&wire[..cut]), None);
        }
        let mut region_magic = wire.to_vec();
        region_magic[..4].copy_from_slice(b"LBK1");
        assert_eq!(LeaseKey::decode(&region_magic), None);
    }
}
