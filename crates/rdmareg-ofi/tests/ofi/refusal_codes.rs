//! A refusal's code on the wire, and the caller's error for each code.
//!
//! An owner and a consumer of different releases talk to each other, so
//! the codes are pinned here as the bytes they are, not as a round trip
//! through this build's own encoder and decoder (which would pass if both
//! sides were renumbered together).

use rdmareg_core::RdmaError;
use rdmareg_ofi::protocol::{
    REFUSAL_BIT, Refusal, is_unverified, parse_gathered, refusal_tag, reply_outcome,
};

/// Where a refusal's reason sits in its tag.
const REASON_SHIFT: u32 = 48;

/// Each refusal's code, as every release so far sends it (8 since
/// descriptor leases, 9 and 10 since access rights; unassigned before).
const CODES: [(Refusal, u64); 10] = [
    (Refusal::RegionUnknown, 1),
    (Refusal::CapabilityMismatch, 2),
    (Refusal::OutOfRange, 3),
    (Refusal::Deregistering, 4),
    (Refusal::Busy, 5),
    (Refusal::Unverified, 6),
    (Refusal::NotTheRequester, 7),
    (Refusal::LeaseExpired, 8),
    (Refusal::AccessDenied, 9),
    (Refusal::ReceiveFailed, 10),
];

/// The kind of error a read refused with `code` gets: a range the
/// registration does not cover, a registration that is gone or not the
/// consumer's, a descriptor lease that ended, or a transient backend
/// error for the rest. Code 8 was unassigned (an unknown code, so a
/// transient backend error) before descriptor leases gave it
/// `LeaseExpired`: only an owner that leases sends it, and a consumer of
/// an earlier release still reads it as an unknown code.
fn kind_of(code: u8) -> &'static str {
    match code {
        3 => "OutOfRange",
        1 | 2 | 4 => "RegionNotFound",
        8 => "LeaseExpired",
        9 => "AccessDenied",
        _ => "transient Backend",
    }
}

fn kind(err: &RdmaError) -> &'static str {
    match err {
        RdmaError::OutOfRange => "OutOfRange",
        RdmaError::RegionNotFound => "RegionNotFound",
        RdmaError::LeaseExpired => "LeaseExpired",
        RdmaError::AccessDenied { .. } => "AccessDenied",
        RdmaError::Backend(_) if err.is_transient() => "transient Backend",
        _ => "something else",
    }
}

/// Each refusal goes out as the code peers of earlier releases know it
/// by, in the tag's reason byte, with the request id below it.
#[test]
fn each_refusal_keeps_its_code_in_the_tag() {
    for (refusal, code) in CODES {
        let tag = refusal_tag(0x2A, refusal);
        assert_eq!(
            tag,
            REFUSAL_BIT | (code << REASON_SHIFT) | 0x2A,
            "{refusal:?}"
        );
        assert_eq!(is_unverified(tag), code == 6, "{refusal:?}");
    }
}

/// Every reason byte a peer can send, as a tag's reason and as a list
/// entry's status, fails the read with the same kind of error as before:
/// no code moved between `OutOfRange`, `RegionNotFound` and a transient
/// backend error.
#[test]
fn every_code_keeps_its_kind_of_error() {
    for code in 1..=u8::MAX {
        let tag = REFUSAL_BIT | (u64::from(code) << REASON_SHIFT) | 0x2A;
        let single = reply_outcome(tag).expect_err("a refusal");
        assert_eq!(kind(&single), kind_of(code), "tag code {code}: {single}");
        let listed = parse_gathered(&[code, 0, 7, 7, 7, 7], &[4, 4])
            .expect("the lengths add up")
            .remove(0)
            .expect_err("a refused entry");
        assert_eq!(listed, single, "list status {code}");
    }
    // A refusal tag with no reason is still a refusal.
    let none = reply_outcome(REFUSAL_BIT | 0x2A).expect_err("a refusal");
    assert_eq!(kind(&none), "transient Backend", "{none}");
}
