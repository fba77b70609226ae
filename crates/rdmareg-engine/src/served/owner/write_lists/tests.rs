use rdmareg_core::Access;

use super::super::{OwnerConfig, Payload, ReceiveId, SendId, UnmapStatus};
use super::*;

const CAP: [u8; 16] = [7; 16];
const BASE: u64 = 0x10_000;
const LEN: u64 = 0x1000;
/// Registered read-write and read-only.
const RW: u64 = 1;
const RO: u64 = 2;

fn owner(bound: u32) -> Owner<u64> {
    let mut owner = Owner::new(OwnerConfig {
        max_replies_per_endpoint: bound,
        ..OwnerConfig::default()
    });
    owner
        .register_with_access(RW, CAP, BASE, LEN, Access::ReadWrite)
        .unwrap();
    owner.register(RO, CAP, BASE + LEN, LEN).unwrap();
    owner
}

fn write(request_id: u64, region: u64, address: u64, length: u64) -> Write {
    Write {
        request_id,
        region,
        capability: CAP,
        address,
        length,
    }
}

fn actions(owner: &mut Owner<u64>) -> Vec<Action<u64>> {
    std::iter::from_fn(|| owner.poll_action()).collect()
}

fn total(entries: &[Write]) -> u64 {
    entries.iter().map(|w| w.length).sum()
}

/// Sends `entries` as a list with a payload that adds up; returns each
/// receive asked for, with its request id and payload offset.
fn receives(
    owner: &mut Owner<u64>,
    endpoint: u64,
    entries: &[Write],
) -> Vec<(u64, ReceiveId, u64)> {
    owner.handle_write_list(
        endpoint,
        entries,
        total(entries),
        WriteListLimits::default(),
    );
    actions(owner)
        .into_iter()
        .map(|action| match action {
            Action::Receive {
                endpoint: to,
                request_id,
                receive,
                payload_offset,
                ..
            } => {
                assert_eq!(to, endpoint);
                (request_id, receive, payload_offset)
            }
            other => panic!("only receives expected, got {other:?}"),
        })
        .collect()
}

/// The one list reply queued, with its send.
fn list_reply(owner: &mut Owner<u64>) -> (SendId, Vec<ListEntryReply>) {
    match &actions(owner)[..] {
        [
            Action::AcknowledgeList {
                send,
                entry_replies,
                ..
            },
        ] => (*send, entry_replies.clone()),
        other => panic!("one list reply expected, got {other:?}"),
    }
}

fn outcomes(entry_replies: &[ListEntryReply]) -> Vec<Result<u64, Refusal>> {
    entry_replies
        .iter()
        .map(|entry| entry.outcome.map(|payload| payload.length))
        .collect()
}

/// Each entry's bytes are where the lengths before it end, and the list
/// is answered once, after its last receive, with every entry's result.
#[test]
fn a_lists_entries_are_received_then_answered_once() {
    let mut owner = owner(8);
    let list = [
        write(1, RW, BASE, 8),
        write(2, RW, BASE + 100, 16),
        write(3, RW, BASE + 8, 4),
    ];
    let asked = receives(&mut owner, 5, &list);
    let offsets: Vec<(u64, u64)> = asked.iter().map(|&(id, _, at)| (id, at)).collect();
    assert_eq!(offsets, [(1, 0), (2, 8), (3, 24)]);
    assert_eq!(owner.region_leases(RW), Some(3));
    for &(_, receive, _) in &asked[..2] {
        assert!(owner.receive_completed(receive));
        assert_eq!(actions(&mut owner), [], "no reply before the last receive");
    }
    owner.receive_completed(asked[2].1);
    let (send, replies) = list_reply(&mut owner);
    assert_eq!(outcomes(&replies), [Ok(8), Ok(16), Ok(4)]);
    let ids: Vec<u64> = replies.iter().map(|entry| entry.request_id).collect();
    assert_eq!(ids, [1, 2, 3]);
    assert_eq!(owner.region_leases(RW), Some(0));
    assert_eq!(owner.load(5).served, 1, "the one reply holds its place");
    owner.send_completed(send);
    assert_eq!(owner.endpoints(), 0);
    assert_eq!(owner.write_lists_in_flight(), 0);
}

/// A refused entry changes nothing and leaves the others accepted, at
/// their own places in the payload.
#[test]
fn a_refused_entry_leaves_the_others_accepted() {
    let mut owner = owner(8);
    let list = [
        write(1, RO, BASE + LEN, 8),
        write(2, RW, BASE, 16),
        write(3, RW, BASE + LEN - 4, 8),
        Write {
            capability: [0; 16],
            ..write(4, RW, BASE, 8)
        },
    ];
    let asked = receives(&mut owner, 5, &list);
    assert_eq!(asked.len(), 1);
    assert_eq!((asked[0].0, asked[0].2), (2, 8));
    owner.receive_completed(asked[0].1);
    let (_, replies) = list_reply(&mut owner);
    assert_eq!(
        outcomes(&replies),
        [
            Err(Refusal::AccessDenied),
            Ok(16),
            Err(Refusal::OutOfRange),
            Err(Refusal::CapabilityMismatch)
        ]
    );
    assert_eq!(owner.refused_requests(), 3);
}

/// A payload that does not add up to the entries, or passes the list's
/// bound, says nothing about whose bytes are whose: every entry is
/// refused, nothing received, and the reply goes at once as a refusal.
#[test]
fn a_payload_that_does_not_add_up_refuses_every_entry() {
    let list = [write(1, RW, BASE, 8), write(2, RW, BASE + 8, 8)];
    for (payload, limits) in [
        (15, WriteListLimits::default()),
        (17, WriteListLimits::default()),
        (
            16,
            WriteListLimits {
                max_total: 15,
                ..WriteListLimits::default()
            },
        ),
    ] {
        let mut owner = owner(8);
        owner.handle_write_list(5, &list, payload, limits);
        let (send, replies) = list_reply(&mut owner);
        assert_eq!(
            outcomes(&replies),
            [Err(Refusal::Malformed), Err(Refusal::Malformed)]
        );
        assert_eq!(owner.region_leases(RW), Some(0));
        assert_eq!(owner.load(5).refusals, 1, "one refusal send");
        owner.send_completed(send);
        assert_eq!(owner.endpoints(), 0);
    }
}

/// Lengths that overflow when added are refused, not wrapped around.
#[test]
fn lengths_that_overflow_together_are_refused() {
    let mut owner = owner(8);
    let list = [write(1, RW, BASE, u64::MAX), write(2, RW, BASE, 2)];
    owner.handle_write_list(5, &list, 1, WriteListLimits::default());
    let (_, replies) = list_reply(&mut owner);
    assert_eq!(
        outcomes(&replies),
        [Err(Refusal::Malformed), Err(Refusal::Malformed)]
    );
}

/// An entry past the list's entry bound is refused alone; the payload's
/// places of the others are unchanged.
#[test]
fn an_entry_past_the_entry_bound_is_refused_alone() {
    let mut owner = owner(8);
    let list = [write(1, RW, BASE, 64), write(2, RW, BASE + 64, 8)];
    let limits = WriteListLimits {
        max_entry: 32,
        ..WriteListLimits::default()
    };
    owner.handle_write_list(5, &list, 72, limits);
    let [
        Action::Receive {
            request_id: 2,
            payload_offset: 64,
            receive,
            ..
        },
    ] = actions(&mut owner)[..]
    else {
        panic!("only the second entry received");
    };
    owner.receive_completed(receive);
    let (_, replies) = list_reply(&mut owner);
    assert_eq!(outcomes(&replies), [Err(Refusal::Malformed), Ok(8)]);
}

/// A failed receive is answered in the list as such; the others keep
/// their `Ok`, and only the completed ranges are logged as written.
#[test]
fn a_failed_receive_is_answered_within_the_list() {
    let mut owner = owner(8);
    let list = [write(1, RW, BASE, 8), write(2, RW, BASE + 64, 8)];
    let asked = receives(&mut owner, 5, &list);
    owner.receive_failed(asked[1].1);
    owner.receive_completed(asked[0].1);
    let (_, replies) = list_reply(&mut owner);
    assert_eq!(outcomes(&replies), [Ok(8), Err(Refusal::ReceiveFailed)]);
    let written = owner.take_written(RW).expect("registered");
    assert_eq!(written.ranges, vec![0..8_u64]);
}

/// A list counts under the endpoint's bound by its replies, not its
/// entries: a full list is accepted by an endpoint with one place free,
/// a list arriving at the bound is busy as a whole (entries refused for
/// their own reason keep it), and the place comes back when the reply's
/// send ended.
#[test]
fn a_list_at_the_bound_is_busy_as_a_whole() {
    let mut owner = owner(1);
    let list: Vec<Write> = (0..64).map(|i| write(i, RW, BASE + 8 * i, 8)).collect();
    let asked = receives(&mut owner, 5, &list);
    assert_eq!(asked.len(), 64, "one place is enough for a whole list");
    for &(_, receive, _) in &asked {
        owner.receive_completed(receive);
    }
    let (send, replies) = list_reply(&mut owner);
    assert!(outcomes(&replies).iter().all(|outcome| *outcome == Ok(8)));
    let busy = [write(1, RW, BASE, 8), write(2, RO, BASE + LEN, 8)];
    owner.handle_write_list(5, &busy, 16, WriteListLimits::default());
    let (refusal, replies) = list_reply(&mut owner);
    assert_eq!(
        outcomes(&replies),
        [Err(Refusal::Busy), Err(Refusal::AccessDenied)],
        "at the bound"
    );
    assert_eq!(owner.load(5).served, 1);
    owner.send_completed(refusal);
    owner.send_completed(send);
    assert_eq!(owner.endpoints(), 0);
    assert_eq!(receives(&mut owner, 5, &busy[..1]).len(), 1);
}

/// A list of more entries than one reply carries is answered in several
/// replies, in entry order, each holding one place until its send ended.
#[test]
fn a_long_list_is_answered_in_several_replies() {
    let mut owner = owner(8);
    let list: Vec<Write> = (0..5).map(|i| write(i, RW, BASE + 8 * i, 8)).collect();
    let mut refused = list.clone();
    refused[1].region = RO;
    let limits = WriteListLimits {
        entries_per_reply: 2,
        ..WriteListLimits::default()
    };
    owner.handle_write_list(5, &refused, 40, limits);
    let asked: Vec<ReceiveId> = actions(&mut owner)
        .into_iter()
        .map(|action| match action {
            Action::Receive { receive, .. } => receive,
            other => panic!("a receive expected, got {other:?}"),
        })
        .collect();
    assert_eq!(asked.len(), 4);
    assert_eq!(owner.load(5).served, 3, "a place per reply");
    for receive in asked {
        owner.receive_completed(receive);
    }
    let parts: Vec<(SendId, Vec<Result<u64, Refusal>>)> = actions(&mut owner)
        .into_iter()
        .map(|action| match action {
            Action::AcknowledgeList {
                send,
                entry_replies,
                ..
            } => (send, outcomes(&entry_replies)),
            other => panic!("a list reply expected, got {other:?}"),
        })
        .collect();
    let answers: Vec<Vec<Result<u64, Refusal>>> =
        parts.iter().map(|(_, part)| part.clone()).collect();
    assert_eq!(
        answers,
        [
            vec![Ok(8), Err(Refusal::AccessDenied)],
            vec![Ok(8), Ok(8)],
            vec![Ok(8)]
        ]
    );
    for (send, _) in parts {
        owner.send_completed(send);
    }
    assert_eq!(owner.endpoints(), 0);
    // Refused whole, a long list is answered in parts too, each under the
    // refusal bound.
    owner.refuse_write_list(5, &list, Refusal::Malformed, limits);
    assert_eq!(actions(&mut owner).len(), 3);
    assert_eq!(owner.load(5).refusals, 3);
}

/// An unmap waits for every receive of a list into its region; entries
/// arriving after it started are refused.
#[test]
fn an_unmap_waits_for_a_lists_receives() {
    let mut owner = owner(8);
    let list = [write(1, RW, BASE, 8), write(2, RW, BASE + 8, 8)];
    let asked = receives(&mut owner, 5, &list);
    assert_eq!(owner.unmap(RW), UnmapStatus::Waiting);
    owner.handle_write_list(6, &list, 16, WriteListLimits::default());
    let (_, replies) = list_reply(&mut owner);
    assert_eq!(
        outcomes(&replies),
        [Err(Refusal::Deregistering), Err(Refusal::Deregistering)]
    );
    owner.receive_completed(asked[0].1);
    assert_eq!(actions(&mut owner), [], "one receive still writes");
    owner.receive_completed(asked[1].1);
    let done = actions(&mut owner);
    assert!(matches!(
        done[..],
        [
            Action::AcknowledgeList { .. },
            Action::Unmapped { region: RW }
        ]
    ));
}

/// A failed endpoint's list is not answered; its receives still hold the
/// region until they end, and then the endpoint is forgotten.
#[test]
fn a_failed_endpoints_list_is_not_answered() {
    let mut owner = owner(8);
    let list = [write(1, RW, BASE, 8), write(2, RW, BASE + 8, 8)];
    let asked = receives(&mut owner, 5, &list);
    owner.endpoint_failed(5);
    owner.unmap(RW);
    owner.receive_completed(asked[0].1);
    owner.receive_failed(asked[1].1);
    assert_eq!(actions(&mut owner), [Action::Unmapped { region: RW }]);
    assert_eq!(owner.endpoints(), 0);
    assert_eq!(owner.write_lists_in_flight(), 0);
}

/// The transport's close ends a list's receives unanswered, and the owner
/// drains.
#[test]
fn a_closed_transport_ends_a_list_unanswered() {
    let mut owner = owner(8);
    receives(
        &mut owner,
        5,
        &[write(1, RW, BASE, 8), write(2, RW, BASE + 8, 8)],
    );
    owner.shutdown();
    assert_eq!(actions(&mut owner), [Action::Unmapped { region: RO }]);
    owner.transport_closed();
    assert_eq!(
        actions(&mut owner),
        [Action::Unmapped { region: RW }, Action::Drained]
    );
    assert_eq!(owner.write_lists_in_flight(), 0);
}

/// A driver's own refusal of a list answers every entry at once, and
/// receives nothing.
#[test]
fn a_drivers_refusal_answers_every_entry() {
    let mut owner = owner(8);
    let list = [write(1, RW, BASE, 8), write(2, RW, BASE + 8, 8)];
    owner.refuse_write_list(5, &list, Refusal::Malformed, WriteListLimits::default());
    let (_, replies) = list_reply(&mut owner);
    assert_eq!(
        outcomes(&replies),
        [Err(Refusal::Malformed), Err(Refusal::Malformed)]
    );
    assert_eq!(owner.region_leases(RW), Some(0));
    assert_eq!(owner.refused_requests(), 2);
}

/// A header that does not decode is dropped; an empty list too.
#[test]
fn an_undecodable_or_empty_list_is_dropped() {
    let mut owner = owner(8);
    let bytes = wire::encode_write_list_request(&[write(1, RW, BASE, 8)]).unwrap();
    owner.handle_write_list_request(5, &bytes[..bytes.len() - 1], 8, WriteListLimits::default());
    owner.handle_write_list(5, &[], 0, WriteListLimits::default());
    assert_eq!(actions(&mut owner), []);
    assert_eq!(owner.dropped_requests(), 2);
    owner.handle_write_list_request(5, &bytes, 8, WriteListLimits::default());
    assert!(matches!(
        actions(&mut owner)[..],
        [Action::Receive {
            request_id: 1,
            payload_offset: 0,
            ..
        }]
    ));
}

/// The list reply's header encodes each entry's result, and a writer's
/// decoder reads it back.
#[test]
fn a_list_reply_header_round_trips() {
    let entry_replies = vec![
        ListEntryReply {
            request_id: 1,
            outcome: Ok(Payload {
                region: RW,
                address: BASE,
                length: 8,
            }),
        },
        ListEntryReply {
            request_id: 2,
            outcome: Err(Refusal::Busy),
        },
    ];
    let action = Action::AcknowledgeList {
        endpoint: 5u64,
        send: SendId(0),
        entry_replies,
    };
    let header = action.list_reply_header().expect("a list reply");
    let decoded = wire::decode_list_reply(&header).unwrap();
    let got: Vec<(u64, Result<u64, Refusal>)> = decoded
        .iter()
        .map(|reply| (reply.request_id, reply.outcome))
        .collect();
    assert_eq!(got, [(1, Ok(8)), (2, Err(Refusal::Busy))]);
}
