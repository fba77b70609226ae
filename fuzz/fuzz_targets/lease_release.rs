//! Fuzzes the release of a descriptor lease as an owner receives it, alone
//! and as a stream of lease events into one region's leases. Releases come
//! from peers; the stream also makes leases, moves time and reads.
//!
//! Properties for every input:
//!
//! * decoding a release never panics, and whatever it accepts re-encodes to
//!   exactly the input; a release never decodes as a notice;
//! * no read is judged servable under a lease at or after its expiry, or
//!   after it was released by as many distinct readers as it allows;
//! * a lease's future resolves `Released` only once that many distinct
//!   readers released it, and never before;
//! * the live leases kept never outnumber those made.

#![no_main]

use std::collections::HashSet;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use libfuzzer_sys::fuzz_target;
use rdmareg_engine::notices::wire;
use rdmareg_engine::served::leases::{
    LeaseEnd, LeaseReleased, LeaseTerms, RegionLeases, ReleaseOutcome,
};

/// What the target knows of one lease it made.
struct Made {
    capability: [u8; 16],
    terms: LeaseTerms,
    readers: HashSet<(u8, u64)>,
    released: LeaseReleased,
    resolved: Option<LeaseEnd>,
}

fuzz_target!(|bytes: &[u8]| {
    if let Ok(release) = wire::decode_release(bytes) {
        let encoded =
            wire::encode_release(release.sender, release.sequence, release.region, &release.capability);
        assert_eq!(encoded, bytes, "an accepted release re-encodes to itself");
        assert!(wire::decode(bytes).is_err(), "a release is never a notice");
    }

    // The input as a stream of events, each a control byte (top three bits
    // the event) and its operands.
    let start = Instant::now();
    let mut now = start;
    let mut leases: RegionLeases<(u8, u64)> = RegionLeases::default();
    let mut made: Vec<Made> = Vec::new();
    let mut context = Context::from_waker(Waker::noop());
    let mut rest = bytes;
    while let Some((&control, tail)) = rest.split_first() {
        rest = tail;
        let operand = control & 0x1F;
        match control >> 5 {
            // Make a lease: 1-4 readers, 1-8 ms.
            0 if made.len() < 64 => {
                let capability = [made.len() as u8 + 1; 16];
                let terms = LeaseTerms {
                    readers: u32::from(operand & 3) + 1,
                    expires_at: now + Duration::from_millis(u64::from(operand >> 2) + 1),
                };
                leases.sweep(now);
                let released = leases.add(capability, terms);
                made.push(Made {
                    capability,
                    terms,
                    readers: HashSet::new(),
                    released,
                    resolved: None,
                });
            }
            // Time moves on, 0-31 ms.
            1 => now += Duration::from_millis(u64::from(operand)),
            // A release of a lease made (or of a forged capability), by one
            // of eight readers (connection, sender).
            2 | 3 => {
                let Some((&which, tail)) = rest.split_first() else {
                    break;
                };
                rest = tail;
                let reader = (operand & 3, u64::from(operand >> 2));
                let index = usize::from(which & 0x7F);
                let forged = which & 0x80 != 0;
                let capability = match made.get(index) {
                    Some(lease) if !forged => lease.capability,
                    _ => [0xEE; 16],
                };
                let outcome = leases.release(reader, &capability, Some(now));
                if let (Some(lease), false) = (made.get_mut(index), forged) {
                    let live = now < lease.terms.expires_at
                        && (lease.readers.len() as u32) < lease.terms.readers;
                    if live {
                        lease.readers.insert(reader);
                    }
                    let owed = lease.readers.len() as u32 == lease.terms.readers;
                    if matches!(outcome, ReleaseOutcome::Ended) {
                        assert!(live && owed, "a lease ended before its readers released it");
                    }
                } else {
                    assert!(
                        !matches!(outcome, ReleaseOutcome::Ended | ReleaseOutcome::Counted { .. }),
                        "a forged release counted"
                    );
                }
            }
            // A read under a lease made.
            _ => {
                if let Some(lease) = made.get(usize::from(operand)) {
                    let verdict = leases.judge(&lease.capability, Some(now));
                    let ended = now >= lease.terms.expires_at
                        || lease.readers.len() as u32 >= lease.terms.readers;
                    if ended {
                        assert!(
                            !matches!(verdict, Some(Ok(()))),
                            "a read served under an ended lease"
                        );
                    }
                }
            }
        }
        for lease in &mut made {
            if lease.resolved.is_none() {
                if let Poll::Ready(end) = Pin::new(&mut lease.released).poll(&mut context) {
                    lease.resolved = Some(end);
                }
            }
            if lease.resolved == Some(LeaseEnd::Released) {
                assert_eq!(
                    lease.readers.len() as u32,
                    lease.terms.readers,
                    "released before every reader released it"
                );
            }
        }
        assert!(leases.live() <= made.len(), "more leases kept than made");
    }
});
