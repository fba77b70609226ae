//! Consumers that send the owner requests it must refuse or drop: ranges
//! outside the registration, forged capabilities, unknown regions, bytes
//! that are no request, garbage lists, reads cut into pieces that run past
//! the end or carry a forged key, requests the driver could not confirm.

use rdmareg_core::RdmaError;

use super::super::consumer::{DropReason, ReplyVerdict};
use super::super::owner::{Action, Refusal, UnmapStatus};
use super::*;

/// A raw consumer, as the owner names it.
const RAW: u32 = 20;

/// The owner's answers to `RAW` so far, as `(request id, refusal or
/// served length)`, taken out of `elsewhere`.
fn answers_to_raw(pair: &mut Pair) -> Vec<(u64, Result<u64, Refusal>)> {
    pair.deliver_requests();
    let mut out = Vec::new();
    for action in pair.elsewhere.drain(..) {
        match action {
            Action::Serve {
                endpoint: RAW,
                request_id,
                payload,
                ..
            } => out.push((request_id, Ok(payload.length))),
            Action::Refuse {
                endpoint: RAW,
                request_id,
                refusal,
                ..
            } => out.push((request_id, Err(refusal))),
            other => panic!("not a single answer to RAW: {other:?}"),
        }
    }
    out
}

/// Every kind of bad single request — a range that wraps, starts past the
/// end or before the start, is empty or huge, a forged capability, an
/// unknown region, a request of any length that does not decode — gets a
/// refusal that fits, under the id it carries, and not one byte.
#[test]
fn bad_requests_get_refusals_and_no_bytes() {
    let mut pair = Pair::new();
    let mut forged = CAP;
    forged[15] ^= 1;
    let ask = |id, address, length| Read {
        request_id: id,
        address,
        length,
        ..read_of(id, 0, 0)
    };
    let cases = [
        (ask(1, BASE, u64::MAX), Refusal::OutOfRange),
        (ask(2, u64::MAX, 1), Refusal::OutOfRange),
        (ask(3, u64::MAX - 10, 20), Refusal::OutOfRange),
        (ask(4, BASE + 1, LEN), Refusal::OutOfRange),
        (ask(5, BASE - 1, 2), Refusal::OutOfRange),
        (
            Read {
                capability: forged,
                ..ask(6, BASE, 16)
            },
            Refusal::CapabilityMismatch,
        ),
        (
            Read {
                region: REGION + 1,
                ..ask(7, BASE, 16)
            },
            Refusal::RegionUnknown,
        ),
        (ask(8, BASE, 0), Refusal::OutOfRange),
        (ask(9, 0, 4096), Refusal::OutOfRange),
    ];
    for (read, _) in &cases {
        pair.raw_request(RAW, &wire::encode_request(read));
    }
    let expected: Vec<_> = cases
        .iter()
        .map(|(read, refusal)| (read.request_id, Err(*refusal)))
        .collect();
    assert_eq!(answers_to_raw(&mut pair), expected);
    for n in 0..60usize {
        pair.raw_request(RAW, &vec![1u8; n]);
    }
    let garbage = answers_to_raw(&mut pair);
    assert_eq!(garbage.len(), 60, "each is refused, none dropped");
    assert!(
        garbage
            .iter()
            .all(|(_, answer)| *answer == Err(Refusal::Malformed))
    );
    assert_eq!(pair.owner.leases_in_flight(), 0);
    assert_eq!(pair.owner.region_leases(REGION), Some(0));
}

/// Garbage lists — empty, cut, of 0, 65 or 255 entries, a wrong version —
/// are dropped without an answer (no request id in them can be trusted);
/// a list of valid, wrapping, below-the-start, unknown-region and forged
/// entries is answered entry by entry; the owner then serves an honest
/// consumer and unmaps.
#[test]
fn garbage_lists_are_dropped_and_hostile_entries_refused() {
    let mut pair = Pair::new();
    let one = wire::encode_list_request(&[read_of(1, 0, 8)]).unwrap();
    let mut lists: Vec<Vec<u8>> = vec![Vec::new(), vec![1], one[..one.len() - 1].to_vec()];
    for count in [0u16, 65, 255] {
        let mut bytes = vec![1, 0, 0, 0];
        bytes.extend_from_slice(&count.to_le_bytes());
        bytes.extend_from_slice(&[0, 0]);
        bytes.resize(8 + usize::from(count) * wire::LIST_REQUEST_ENTRY_LEN, 0);
        lists.push(bytes);
    }
    let mut versioned = one.clone();
    versioned[0] = 2;
    lists.push(versioned);
    for bytes in &lists {
        pair.raw_list(RAW, bytes);
    }
    pair.deliver_requests();
    assert!(pair.elsewhere.is_empty(), "{:?}", pair.elsewhere);
    assert_eq!(pair.owner.dropped_requests(), lists.len() as u64);

    let mut forged = read_of(5, 0, 8);
    forged.capability[0] ^= 1;
    let entries = [
        read_of(1, 0, 8),
        Read {
            address: u64::MAX - 3,
            ..read_of(2, 0, 8)
        },
        Read {
            address: BASE - 8,
            ..read_of(3, 0, 16)
        },
        Read {
            region: 99,
            ..read_of(4, 0, 8)
        },
        forged,
    ];
    pair.raw_list(RAW, &wire::encode_list_request(&entries).unwrap());
    pair.deliver_requests();
    let [
        Action::ServeList {
            entry_replies: answers,
            ..
        },
    ] = &pair.elsewhere[..]
    else {
        panic!("one list reply: {:?}", pair.elsewhere);
    };
    let judged: Vec<_> = answers
        .iter()
        .map(|a| (a.request_id, a.outcome.map(|p| p.length)))
        .collect();
    assert_eq!(
        judged,
        [
            (1, Ok(8)),
            (2, Err(Refusal::OutOfRange)),
            (3, Err(Refusal::OutOfRange)),
            (4, Err(Refusal::RegionUnknown)),
            (5, Err(Refusal::CapabilityMismatch)),
        ]
    );
    let read = pair.read(0, 64, DEADLINE);
    pair.settle();
    assert_eq!(pair.answer(read), Some(Ok(())));
    assert_eq!(pair.dest(read), pair.source(0, 64));
    assert_eq!(pair.owner.unmap(REGION), UnmapStatus::Waiting);
    pair.perform_owner_actions();
    assert_eq!(
        pair.unmapped,
        [] as [u64; 0],
        "the raw list's entry holds it"
    );
    let Action::ServeList { send, .. } = pair.elsewhere[0] else {
        unreachable!()
    };
    pair.owner.send_failed(send);
    pair.perform_owner_actions();
    assert_eq!(pair.unmapped, [REGION]);
}

/// A read asked in pieces — as the UCX engine cuts a large read over tcp
/// — whose last piece runs one byte past the registration: the first
/// pieces are served and land their own bytes, the last is refused
/// `OutOfRange` and lands nothing.
#[test]
fn a_last_piece_past_the_end_is_refused_alone() {
    let mut pair = Pair::new();
    let piece = 16 * 1024;
    let start = LEN - 4 * piece + 1;
    let pieces: Vec<_> = (0..4)
        .map(|i| pair.read(start + i * piece, piece, DEADLINE))
        .collect();
    pair.settle();
    for (i, &read) in pieces[..3].iter().enumerate() {
        assert_eq!(pair.answer(read), Some(Ok(())));
        assert_eq!(
            pair.dest(read),
            pair.source(start + i as u64 * piece, piece)
        );
    }
    assert_eq!(pair.answer(pieces[3]), Some(Err(RdmaError::OutOfRange)));
    assert!(pair.untouched(pieces[3]));
    pair.assert_clean_end();
}

/// A read in pieces under a forged capability: every piece is refused,
/// not one byte lands, and no lease is taken.
#[test]
fn a_forged_key_read_in_pieces_lands_nothing() {
    let mut pair = Pair::new();
    let mut forged = CAP;
    forged[3] ^= 0x10;
    let pieces: Vec<_> = (0..5)
        .map(|i| {
            let request = Read {
                capability: forged,
                ..read_of(0, i * 16384, 16384)
            };
            pair.read_with(OWNER, request, DEADLINE)
        })
        .collect();
    pair.deliver_requests();
    assert_eq!(pair.owner.leases_in_flight(), 0);
    pair.deliver_replies();
    for read in pieces {
        assert_eq!(pair.answer(read), Some(Err(RdmaError::RegionNotFound)));
        assert!(pair.untouched(read));
    }
    pair.assert_clean_end();
}

/// A request the driver could not confirm came from the endpoint it names
/// as its reply address (a bystander's) is refused by the driver through
/// the owner: a refusal without a lease, so an unmap of the region it
/// named answers at once, and the bystander never holds a reply.
#[test]
fn a_request_in_a_bystanders_name_holds_no_lease() {
    let mut pair = Pair::new();
    const BYSTANDER: u32 = 30;
    for refusal in [Refusal::Unverified, Refusal::NotTheRequester] {
        pair.owner.refuse_request(BYSTANDER, 1, refusal);
    }
    pair.perform_owner_actions();
    assert!(matches!(
        pair.elsewhere[..],
        [
            Action::Refuse {
                endpoint: BYSTANDER,
                refusal: Refusal::Unverified,
                ..
            },
            Action::Refuse {
                endpoint: BYSTANDER,
                refusal: Refusal::NotTheRequester,
                ..
            }
        ]
    ));
    assert_eq!(pair.owner.load(BYSTANDER).served, 0);
    assert_eq!(pair.owner.unmap(REGION), UnmapStatus::Waiting);
    pair.perform_owner_actions();
    assert_eq!(pair.unmapped, [REGION], "no lease to wait for");
}

/// Requests that arrive after the transport closed, or from an endpoint
/// that failed, are dropped: no refusal is queued for an endpoint the
/// transport can no longer answer on.
#[test]
fn requests_from_a_failed_endpoint_are_dropped() {
    let mut pair = Pair::new();
    pair.raw_request(RAW, &wire::encode_request(&read_of(1, 0, 8)));
    let [(1, Ok(8))] = answers_to_raw(&mut pair)[..] else {
        panic!("served");
    };
    pair.owner.endpoint_failed(RAW);
    pair.raw_request(RAW, &wire::encode_request(&read_of(2, 0, 8)));
    pair.raw_request(RAW, &[0u8; 3]);
    assert_eq!(answers_to_raw(&mut pair), []);
    assert_eq!(pair.owner.dropped_requests(), 2);
}

/// A request delivered twice (the network, or a consumer, repeated it) is
/// served twice, each reply under a lease of its own: the consumer takes
/// the first and drops the second, and an unmap started between them
/// waits for both sends to end, whichever ends last.
#[test]
fn a_repeated_request_holds_a_lease_per_reply() {
    let mut pair = Pair::new();
    let read = pair.read(0, 4096, DEADLINE);
    let bytes = wire::encode_request(&read_of(read.0, 0, 4096));
    pair.raw_request(CONSUMER, &bytes);
    pair.deliver_requests();
    assert_eq!(pair.owner.region_leases(REGION), Some(2));
    assert_eq!(pair.owner.unmap(REGION), UnmapStatus::Waiting);
    let verdicts: Vec<_> = (0..2).flat_map(|_| pair.deliver_next_held()).collect();
    assert_eq!(
        verdicts,
        [
            ReplyVerdict::Write(read),
            ReplyVerdict::Drop(DropReason::NotAwaited)
        ]
    );
    pair.perform_owner_actions();
    assert!(pair.unmapped.is_empty(), "the first reply still sends");
    pair.finish_landing(read, true);
    assert_eq!(pair.unmapped, [REGION]);
    assert_eq!(pair.dest(read), pair.source(0, 4096));
    pair.assert_clean_end();
}
