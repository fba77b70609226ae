//! The engine kit's owner with descriptor leases: the shared rules of
//! `rdmareg_backend::leases`, driven through [`Owner`](super::Owner)'s
//! reads, releases and time.

pub use rdmareg_backend::leases::{
    ENDED_REMEMBERED, IgnoredRelease, LeaseEnd, LeaseEnded, LeaseReleased, LeaseTerms,
    MAX_LEASE_READERS, RegionLeases, ReleaseOutcome,
};

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use futures::FutureExt;

    use rdmareg_core::RdmaError;

    use super::*;
    use crate::served::{Action, Owner, OwnerConfig, Read, Refusal, UnmapStatus};

    const REGION: u64 = 1;
    const OWN: [u8; 16] = [1; 16];
    const LEASE: [u8; 16] = [2; 16];
    const OTHER_LEASE: [u8; 16] = [3; 16];

    fn owner() -> Owner<u64> {
        let mut owner = Owner::new(OwnerConfig::default());
        owner.register(REGION, OWN, 0x1000, 4096).unwrap();
        owner
    }

    fn terms(readers: u32, start: Instant, ttl_ms: u64) -> LeaseTerms {
        LeaseTerms {
            readers,
            expires_at: start + Duration::from_millis(ttl_ms),
        }
    }

    fn read(capability: [u8; 16]) -> Read {
        Read {
            request_id: 7,
            region: REGION,
            capability,
            address: 0x1000,
            length: 64,
        }
    }

    /// What the owner does with one read: `Ok` if served (the send is
    /// completed at once), else the refusal.
    fn outcome(owner: &mut Owner<u64>, capability: [u8; 16]) -> Result<(), Refusal> {
        owner.handle_read(5, read(capability));
        match owner.poll_action() {
            Some(Action::Serve { send, .. }) => {
                owner.send_completed(send);
                Ok(())
            }
            Some(Action::Refuse { send, refusal, .. }) => {
                owner.send_completed(send);
                Err(refusal)
            }
            other => panic!("a reply, not {other:?}"),
        }
    }

    #[test]
    fn a_read_under_a_live_lease_is_served() {
        let start = Instant::now();
        let mut owner = owner();
        let _released = owner
            .register_lease(REGION, LEASE, terms(1, start, 100), start)
            .unwrap();
        assert_eq!(outcome(&mut owner, LEASE), Ok(()));
        assert_eq!(
            outcome(&mut owner, OTHER_LEASE),
            Err(Refusal::CapabilityMismatch)
        );
    }

    /// The expiry is exact at the owner's time: the last instant before
    /// it serves, the expiry itself refuses, and the registration's own
    /// descriptor is untouched.
    #[test]
    fn a_read_from_the_expiry_on_is_refused_lease_expired() {
        let start = Instant::now();
        let mut owner = owner();
        let mut released = owner
            .register_lease(REGION, LEASE, terms(1, start, 100), start)
            .unwrap();
        owner.set_time(start + Duration::from_millis(100) - Duration::from_nanos(1));
        assert_eq!(outcome(&mut owner, LEASE), Ok(()));
        owner.set_time(start + Duration::from_millis(100));
        assert_eq!(outcome(&mut owner, LEASE), Err(Refusal::LeaseExpired));
        assert_eq!(outcome(&mut owner, OWN), Ok(()));
        assert_eq!(
            (&mut released).now_or_never(),
            None,
            "expiry is the waiter's to time"
        );
    }

    #[test]
    fn the_last_readers_release_ends_the_lease() {
        let start = Instant::now();
        let mut owner = owner();
        let mut released = owner
            .register_lease(REGION, LEASE, terms(2, start, 10_000), start)
            .unwrap();
        assert_eq!(
            owner.handle_release(5, 11, REGION, &LEASE),
            ReleaseOutcome::Counted { remaining: 1 }
        );
        assert_eq!(outcome(&mut owner, LEASE), Ok(()), "one reader is left");
        assert_eq!((&mut released).now_or_never(), None);
        assert_eq!(
            owner.handle_release(6, 12, REGION, &LEASE),
            ReleaseOutcome::Ended
        );
        assert_eq!((&mut released).now_or_never(), Some(LeaseEnd::Released));
        assert_eq!(outcome(&mut owner, LEASE), Err(Refusal::LeaseExpired));
        assert_eq!(
            owner.handle_release(6, 13, REGION, &LEASE),
            ReleaseOutcome::Ignored(IgnoredRelease::AlreadyEnded)
        );
    }

    /// A replayed release, or a reader releasing twice, does not spend the
    /// share of the reader who has not released yet.
    #[test]
    fn a_reader_releasing_twice_counts_once() {
        let start = Instant::now();
        let mut owner = owner();
        let mut released = owner
            .register_lease(REGION, LEASE, terms(2, start, 10_000), start)
            .unwrap();
        owner.handle_release(5, 11, REGION, &LEASE);
        assert_eq!(
            owner.handle_release(5, 11, REGION, &LEASE),
            ReleaseOutcome::Ignored(IgnoredRelease::AlreadyReleased)
        );
        assert_eq!((&mut released).now_or_never(), None);
        assert_eq!(outcome(&mut owner, LEASE), Ok(()));
        // The same sender number on another connection is another reader.
        assert_eq!(
            owner.handle_release(6, 11, REGION, &LEASE),
            ReleaseOutcome::Ended
        );
    }

    /// A peer without the lease's capability cannot end it, and one with
    /// another lease of the region ends only its own.
    #[test]
    fn forged_and_foreign_releases_end_nothing() {
        let start = Instant::now();
        let mut owner = owner();
        let mut mine = owner
            .register_lease(REGION, LEASE, terms(1, start, 10_000), start)
            .unwrap();
        let mut theirs = owner
            .register_lease(REGION, OTHER_LEASE, terms(1, start, 10_000), start)
            .unwrap();
        let mut forged = LEASE;
        forged[15] ^= 1;
        for capability in [forged, OWN] {
            assert_eq!(
                owner.handle_release(9, 99, REGION, &capability),
                ReleaseOutcome::Ignored(IgnoredRelease::UnknownLease)
            );
        }
        assert_eq!(
            owner.handle_release(9, 99, REGION + 1, &LEASE),
            ReleaseOutcome::Ignored(IgnoredRelease::UnknownLease)
        );
        assert_eq!(
            owner.handle_release(9, 99, REGION, &OTHER_LEASE),
            ReleaseOutcome::Ended
        );
        assert_eq!((&mut theirs).now_or_never(), Some(LeaseEnd::Released));
        assert_eq!((&mut mine).now_or_never(), None);
        assert_eq!(outcome(&mut owner, LEASE), Ok(()));
    }

    #[test]
    fn a_release_after_the_expiry_does_not_count() {
        let start = Instant::now();
        let mut owner = owner();
        let mut released = owner
            .register_lease(REGION, LEASE, terms(1, start, 100), start)
            .unwrap();
        owner.set_time(start + Duration::from_millis(100));
        assert_eq!(
            owner.handle_release(5, 11, REGION, &LEASE),
            ReleaseOutcome::Ignored(IgnoredRelease::AlreadyEnded)
        );
        assert_eq!((&mut released).now_or_never(), Some(LeaseEnd::Withdrawn));
    }

    /// A read admitted just before the expiry keeps its send's hold on the
    /// region after it: the unmap still waits for it.
    #[test]
    fn a_read_admitted_before_the_expiry_still_holds_the_unmap() {
        let start = Instant::now();
        let mut owner = owner();
        let _released = owner
            .register_lease(REGION, LEASE, terms(1, start, 100), start)
            .unwrap();
        owner.handle_read(5, read(LEASE));
        let Some(Action::Serve { send, .. }) = owner.poll_action() else {
            panic!("served");
        };
        owner.set_time(start + Duration::from_secs(1));
        assert_eq!(owner.unmap(REGION), UnmapStatus::Waiting);
        assert_eq!(
            owner.poll_action(),
            None,
            "the reply may still read the region"
        );
        owner.send_completed(send);
        assert_eq!(
            owner.poll_action(),
            Some(Action::Unmapped { region: REGION })
        );
    }

    #[test]
    fn an_unmap_withdraws_the_regions_leases() {
        let start = Instant::now();
        let mut owner = owner();
        let mut released = owner
            .register_lease(REGION, LEASE, terms(1, start, 10_000), start)
            .unwrap();
        owner.unmap(REGION);
        assert_eq!((&mut released).now_or_never(), Some(LeaseEnd::Withdrawn));
        assert_eq!(
            owner
                .register_lease(REGION, OTHER_LEASE, terms(1, start, 10_000), start)
                .err(),
            Some(RdmaError::RegionNotFound)
        );
    }

    #[test]
    fn terms_without_readers_or_time_are_refused() {
        let start = Instant::now();
        let mut owner = owner();
        for bad in [
            terms(0, start, 100),
            terms(MAX_LEASE_READERS + 1, start, 100),
            terms(1, start, 0),
        ] {
            assert_eq!(
                owner.register_lease(REGION, LEASE, bad, start).err(),
                Some(RdmaError::OutOfRange),
                "{bad:?}"
            );
        }
        assert_eq!(
            owner
                .register_lease(REGION + 1, LEASE, terms(1, start, 100), start)
                .err(),
            Some(RdmaError::RegionNotFound)
        );
        owner.shutdown();
        assert_eq!(
            owner
                .register_lease(REGION, LEASE, terms(1, start, 100), start)
                .err(),
            Some(RdmaError::ShuttingDown)
        );
    }

    /// Ended leases are remembered up to a bound: the oldest then reads
    /// as an unknown capability, and memory stays bounded however many
    /// leases a long-lived region hands out.
    #[test]
    fn ended_leases_are_remembered_up_to_a_bound() {
        let start = Instant::now();
        let mut owner = owner();
        for n in 0..=ENDED_REMEMBERED as u8 {
            let capability = [n + 10; 16];
            drop(
                owner
                    .register_lease(REGION, capability, terms(1, start, 10_000), start)
                    .unwrap(),
            );
            assert_eq!(
                owner.handle_release(5, 1, REGION, &capability),
                ReleaseOutcome::Ended
            );
        }
        assert_eq!(
            outcome(&mut owner, [10; 16]),
            Err(Refusal::CapabilityMismatch)
        );
        assert_eq!(outcome(&mut owner, [11; 16]), Err(Refusal::LeaseExpired));
        assert_eq!(owner.live_descriptor_leases(REGION), Some(0));
    }
}
