//! Descriptor leases: a registration's descriptor handed out with an
//! expiry and a number of readers.
//!
//! The owner learns when every reader released the lease, or stops
//! serving at its expiry whatever its readers did; a read under an ended
//! lease fails [`RdmaError::LeaseExpired`](crate::RdmaError).
//! These are the terms and outcomes every layer shares; the engine kit's
//! `served::leases` keeps the owner's rules.

use std::time::{Duration, Instant};

use crate::RdmaError;

/// The most readers one lease may allow.
pub const MAX_LEASE_READERS: u32 = 4096;

/// What a lease allows: how many readers may release it, and until when
/// it serves reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseTerms {
    /// Distinct readers whose releases end the lease, 1 to
    /// [`MAX_LEASE_READERS`].
    pub readers: u32,
    /// From this instant on, no read is served under the lease.
    pub expires_at: Instant,
}

impl LeaseTerms {
    /// Checks the terms against `now`.
    ///
    /// # Errors
    /// [`RdmaError::OutOfRange`] for no readers, more than
    /// [`MAX_LEASE_READERS`], an expiry not after `now`, or one so far
    /// off that a second past it is not an `Instant` (timers that wait
    /// for the expiry round it up).
    pub fn check(&self, now: Instant) -> Result<(), RdmaError> {
        let representable = self
            .expires_at
            .checked_add(Duration::from_secs(1))
            .is_some();
        if self.readers == 0
            || self.readers > MAX_LEASE_READERS
            || self.expires_at <= now
            || !representable
        {
            return Err(RdmaError::OutOfRange);
        }
        Ok(())
    }
}

/// How a lease ended, as far as its owner's backend can tell.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseEnd {
    /// As many readers as the lease allows released it.
    Released,
    /// It ended without that: it expired, its region was unmapped, or the
    /// owner stopped.
    Withdrawn,
}
