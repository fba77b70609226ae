//! Descriptor leases, the owner's rules: a registration's descriptor
//! handed out under its own capability, with an expiry and a number of
//! readers.
//!
//! An owner that gives a descriptor to readers it does not control wants
//! two things the plain descriptor cannot say: when every reader is done
//! (so it may free the memory at once), and that a reader who never says
//! so cannot read for ever. A lease gives both. It is a second capability
//! of a registration; reads that present it are served like the
//! registration's own until the lease ends, and refused
//! [`RdmaError::LeaseExpired`](rdmareg_core::RdmaError::LeaseExpired)
//! after. The rules live here, beside the seam, so every backend keeps
//! them alike: the engine kit's owner of served reads holds a
//! [`RegionLeases`] per region, and so does the loopback backend.
//!
//! # Rules
//!
//! - **A lease ends** when as many distinct readers as it allows released
//!   it, or at its expiry, whichever comes first; its region's unmap ends
//!   it too. A read is served under a lease only while it has not ended:
//!   the caller gives the time it judges a read at (the engine kit's owner
//!   reads no clock: its driver gives it the time).
//! - **A release counts once per reader.** A reader is the connection the
//!   release came on and the sender number the reading engine drew, so a
//!   release repeated (a replay, or a reader releasing twice) does not
//!   spend another reader's share. A release must present the lease's
//!   capability: a peer that was never given the lease's descriptor
//!   cannot end it, and one given another lease of the same region ends
//!   only that one. A reader that holds the descriptor and rotates sender
//!   numbers can spend the shares of the lease: holding the descriptor is
//!   the trust a lease grants, as it is for reading.
//! - **The owner keeps an ended lease's capability** among a bounded
//!   number per region ([`ENDED_REMEMBERED`]), so a late read gets
//!   `LeaseExpired` rather than a bare "not registered"; past that bound
//!   the oldest are forgotten and such a read is refused as any unknown
//!   capability is.
//! - **Whoever waits for the release** holds the [`LeaseReleased`] future
//!   [`RegionLeases::add`] returned: it
//!   resolves [`LeaseEnd::Released`] when the last reader released the
//!   lease, and [`LeaseEnd::Withdrawn`] if the lease ended otherwise
//!   (expiry, the region's unmap, the owner's teardown). Expiry is the
//!   waiter's to time: it knows the lease's expiry and the same clock.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Instant;

use futures::channel::oneshot;
pub use rdmareg_core::{LeaseEnd, LeaseTerms, MAX_LEASE_READERS};

/// How many ended leases' capabilities an owner remembers per region.
pub const ENDED_REMEMBERED: usize = 64;

/// Resolves when a lease ended (module docs, last rule).
#[derive(Debug)]
pub struct LeaseReleased {
    receiver: oneshot::Receiver<()>,
}

impl Future for LeaseReleased {
    type Output = LeaseEnd;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<LeaseEnd> {
        Pin::new(&mut self.receiver).poll(cx).map(|got| match got {
            Ok(()) => LeaseEnd::Released,
            Err(oneshot::Canceled) => LeaseEnd::Withdrawn,
        })
    }
}

/// What a release did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReleaseOutcome {
    /// Counted; the lease waits for `remaining` more readers.
    Counted {
        /// Readers still to release it.
        remaining: u32,
    },
    /// The last reader released it: it serves no more reads.
    Ended,
    /// Not counted, for the reason given.
    Ignored(IgnoredRelease),
}

/// Why a release was not counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IgnoredRelease {
    /// No lease of a held region has that capability.
    UnknownLease,
    /// This reader already released the lease.
    AlreadyReleased,
    /// The lease already ended.
    AlreadyEnded,
}

#[derive(Debug)]
struct Lease<R> {
    capability: [u8; 16],
    terms: LeaseTerms,
    released_by: Vec<R>,
    waiter: Option<oneshot::Sender<()>>,
}

/// The ended lease a read presented: refuse it as
/// [`RdmaError::LeaseExpired`](rdmareg_core::RdmaError::LeaseExpired).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseEnded;

/// The leases of one region; `R` names a reader.
#[derive(Debug)]
pub struct RegionLeases<R> {
    live: Vec<Lease<R>>,
    ended: VecDeque<[u8; 16]>,
}

impl<R> Default for RegionLeases<R> {
    fn default() -> Self {
        RegionLeases {
            live: Vec::new(),
            ended: VecDeque::new(),
        }
    }
}

impl<R: PartialEq> RegionLeases<R> {
    /// Whether the region has no lease, live or remembered as ended.
    pub fn is_empty(&self) -> bool {
        self.live.is_empty() && self.ended.is_empty()
    }

    /// Leases not ended (as far as the last sweep or release knows).
    pub fn live(&self) -> usize {
        self.live.len()
    }

    /// Adds a lease under `capability`, which the caller drew at random.
    pub fn add(&mut self, capability: [u8; 16], terms: LeaseTerms) -> LeaseReleased {
        let (waiter, receiver) = oneshot::channel();
        self.live.push(Lease {
            capability,
            terms,
            released_by: Vec::new(),
            waiter: Some(waiter),
        });
        LeaseReleased { receiver }
    }

    /// Whether `capability` is one of these leases': `None` if not,
    /// `Some(Ok)` while the lease serves reads at `now`, and
    /// `Some(Err(LeaseEnded))` once it ended. With `now` `None` no lease
    /// has expired yet.
    pub fn judge(
        &self,
        capability: &[u8; 16],
        now: Option<Instant>,
    ) -> Option<Result<(), LeaseEnded>> {
        if let Some(lease) = self
            .live
            .iter()
            .find(|l| capabilities_match(&l.capability, capability))
        {
            let expired = now.is_some_and(|now| now >= lease.terms.expires_at);
            return Some(if expired { Err(LeaseEnded) } else { Ok(()) });
        }
        self.ended
            .iter()
            .any(|ended| capabilities_match(ended, capability))
            .then_some(Err(LeaseEnded))
    }

    /// A release of the lease `capability` by `reader`, at `now` (as in
    /// [`judge`](Self::judge)).
    pub fn release(
        &mut self,
        reader: R,
        capability: &[u8; 16],
        now: Option<Instant>,
    ) -> ReleaseOutcome {
        let Some(at) = self
            .live
            .iter()
            .position(|l| capabilities_match(&l.capability, capability))
        else {
            return ReleaseOutcome::Ignored(
                if self.ended.iter().any(|e| capabilities_match(e, capability)) {
                    IgnoredRelease::AlreadyEnded
                } else {
                    IgnoredRelease::UnknownLease
                },
            );
        };
        let lease = &mut self.live[at];
        if now.is_some_and(|now| now >= lease.terms.expires_at) {
            self.end(at);
            return ReleaseOutcome::Ignored(IgnoredRelease::AlreadyEnded);
        }
        if lease.released_by.contains(&reader) {
            return ReleaseOutcome::Ignored(IgnoredRelease::AlreadyReleased);
        }
        lease.released_by.push(reader);
        let remaining = lease.terms.readers - lease.released_by.len() as u32;
        if remaining > 0 {
            return ReleaseOutcome::Counted { remaining };
        }
        if let Some(waiter) = self.live[at].waiter.take() {
            let _ = waiter.send(());
        }
        self.end(at);
        ReleaseOutcome::Ended
    }

    /// Ends every lease expired at `now` (their waiters hear `Withdrawn`).
    pub fn sweep(&mut self, now: Instant) {
        while let Some(at) = self.live.iter().position(|l| now >= l.terms.expires_at) {
            self.end(at);
        }
    }

    fn end(&mut self, at: usize) {
        let lease = self.live.swap_remove(at);
        if self.ended.len() == ENDED_REMEMBERED {
            self.ended.pop_front();
        }
        self.ended.push_back(lease.capability);
    }
}

/// Compares capabilities without an early exit, so the time to refuse does
/// not tell a guessing peer how many leading bytes it got right. The
/// engine kit's owner compares registrations' capabilities with it too.
pub fn capabilities_match(a: &[u8; 16], b: &[u8; 16]) -> bool {
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}
