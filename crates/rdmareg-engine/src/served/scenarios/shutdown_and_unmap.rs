//! Shutdowns, lost peers and unmaps in the middle of reads, lists and
//! pieces: the consumer answers only after the transport let go; the
//! owner's unmap waits for every reply that reads the region, however the
//! consumer holds it, but its teardown does not.

use std::time::Instant;

use rdmareg_core::RdmaError;

use super::super::consumer::{Consumer, ReplyVerdict};
use super::super::owner::{Action, EndpointLoad, SendId, UnmapStatus};
use super::*;

const KIB: u64 = 1024;
/// A raw consumer, as the owner names it.
const RAW: u32 = 20;

fn sends_to(pair: &Pair, endpoint: u32) -> Vec<SendId> {
    pair.elsewhere
        .iter()
        .filter_map(|action| match *action {
            Action::Serve {
                endpoint: e, send, ..
            }
            | Action::Refuse {
                endpoint: e, send, ..
            }
            | Action::ServeList {
                endpoint: e, send, ..
            } if e == endpoint => Some(send),
            _ => None,
        })
        .collect()
}

/// The consumer shuts down with one read's payload being written and one
/// waiting for its reply: the waiting read answers `ShuttingDown` at once,
/// the written one only once the transport let go (its worker destroyed),
/// new reads are refused, and the owner's reply after that lands nothing.
#[test]
fn a_consumer_shut_down_mid_read_answers_after_release() {
    let mut pair = Pair::new();
    let landing = pair.read(0, 64 * KIB, DEADLINE);
    let waiting = pair.read(0, 64, DEADLINE);
    pair.deliver_requests();
    assert_eq!(pair.deliver_next_held(), [ReplyVerdict::Write(landing)]);
    pair.consumer.shutdown();
    pair.collect();
    assert_eq!(pair.answer(waiting), Some(Err(RdmaError::ShuttingDown)));
    assert_eq!(pair.answer(landing), None, "the transport may still write");
    let refused = pair.read(0, 64, DEADLINE);
    assert_eq!(pair.answer(refused), Some(Err(RdmaError::ShuttingDown)));
    pair.finish_landing(landing, false);
    assert_eq!(pair.answer(landing), Some(Err(RdmaError::ShuttingDown)));
    pair.settle();
    assert!(
        [landing, waiting, refused]
            .iter()
            .all(|&r| pair.untouched(r))
    );
    pair.assert_clean_end();
}

/// The owner's endpoint fails with one read being written and a list
/// waiting for its reply: every entry of the list answers the typed
/// failure at once, the written read only once the transport let go, and
/// nothing lands afterwards.
#[test]
fn an_owner_lost_mid_list_answers_every_entry() {
    let mut pair = Pair::new();
    let landing = pair.read(0, 64 * KIB, DEADLINE);
    pair.deliver_requests();
    assert_eq!(pair.deliver_next_held(), [ReplyVerdict::Write(landing)]);
    let list = pair.read_list(&[(0, KIB), (KIB, KIB), (2 * KIB, KIB)], DEADLINE);
    let failure = RdmaError::backend("the endpoint to the owner failed");
    assert_eq!(
        pair.consumer.endpoint_failed(OWNER, failure.clone()),
        [landing]
    );
    pair.collect();
    for &read in &list {
        assert_eq!(pair.answer(read), Some(Err(failure.clone())));
    }
    assert_eq!(pair.answer(landing), None);
    pair.finish_landing(landing, false);
    assert!(matches!(
        pair.answer(landing),
        Some(Err(RdmaError::Backend(_)))
    ));
    pair.settle();
    assert!(list.iter().chain([&landing]).all(|&r| pair.untouched(r)));
    pair.assert_clean_end();
}

/// The consumer shuts down after the first reply of a list answered in
/// several landed: the entries it brought stay `Ok` with their bytes,
/// every other entry answers `ShuttingDown` holding nothing, and the
/// owner's later replies change nothing.
#[test]
fn a_shutdown_between_the_replies_of_a_list() {
    let mut pair = Pair::new();
    pair.limits = ListLimits {
        payload_per_reply: 16 * KIB,
        ..ListLimits::default()
    };
    let spans: Vec<(u64, u64)> = (0..12).map(|i| (i * 4 * KIB, 4 * KIB)).collect();
    let reads = pair.read_list(&spans, DEADLINE);
    pair.deliver_requests();
    assert_eq!(pair.to_consumer.len(), 3);
    let first = pair.to_consumer.pop_front().unwrap();
    pair.deliver(first, false);
    pair.consumer.shutdown();
    pair.deliver_replies();
    for (i, &read) in reads.iter().enumerate() {
        if i < 4 {
            assert_eq!(pair.answer(read), Some(Ok(())));
            assert_eq!(pair.dest(read), pair.source(spans[i].0, spans[i].1));
        } else {
            assert_eq!(pair.answer(read), Some(Err(RdmaError::ShuttingDown)));
            assert!(pair.untouched(read), "entry {i}");
        }
    }
    assert_eq!(pair.owner.leases_in_flight(), 0);
    pair.assert_clean_end();
}

/// A consumer holds a large reply open (a rendezvous it does not take):
/// the owner's unmap waits, refusing new reads meanwhile, and finishes the
/// moment the consumer lets the reply go.
#[test]
fn an_unmap_waits_for_a_reply_the_consumer_holds() {
    let mut pair = Pair::new();
    let held = pair.read(0, LEN, DEADLINE);
    pair.deliver_requests();
    assert_eq!(pair.deliver_next_held(), [ReplyVerdict::Write(held)]);
    assert_eq!(pair.owner.unmap(REGION), UnmapStatus::Waiting);
    pair.perform_owner_actions();
    assert!(pair.unmapped.is_empty(), "the transport still reads it");
    let late = pair.read(0, 64, DEADLINE);
    pair.settle();
    assert_eq!(pair.answer(late), Some(Err(RdmaError::RegionNotFound)));
    pair.finish_landing(held, true);
    assert_eq!(pair.unmapped, [REGION]);
    assert_eq!(pair.answer(held), Some(Ok(())));
    assert_eq!(pair.dest(held), pair.source(0, LEN));
    pair.assert_clean_end();
}

/// A consumer holds a single reply and a list reply open and never lets
/// them go. The owner's shutdown waits for them (no drain yet), but once
/// the transport is destroyed every send has ended: the unmap parked
/// behind them answers and the owner reports drained. A consumer can delay
/// an unmap, not a teardown.
#[test]
fn a_held_reply_cannot_stall_the_owners_teardown() {
    let mut pair = Pair::new();
    pair.raw_request(RAW, &wire::encode_request(&read_of(1, 0, LEN)));
    let entries: Vec<Read> = (2..10).map(|id| read_of(id, 0, 16 * KIB)).collect();
    pair.raw_list(RAW, &wire::encode_list_request(&entries).unwrap());
    pair.deliver_requests();
    assert_eq!(pair.owner.region_leases(REGION), Some(9));
    assert_eq!(pair.owner.unmap(REGION), UnmapStatus::Waiting);
    pair.owner.shutdown();
    pair.perform_owner_actions();
    assert!(pair.unmapped.is_empty() && !pair.drained);
    pair.owner.transport_closed();
    pair.perform_owner_actions();
    assert_eq!(pair.unmapped, [REGION]);
    assert!(pair.drained);
    assert_eq!(pair.owner.leases_in_flight(), 0);
    assert_eq!(pair.owner.endpoints(), 0);
}

/// Consumers holding their bound of replies (single and gathered) vanish:
/// their endpoint fails, which ends nothing by itself, and the transport
/// then fails each of their sends. Every count and lease is released, the
/// owner serves a full list to another consumer, and its unmap answers at
/// once.
#[test]
fn vanished_consumers_release_every_count() {
    let mut pair = Pair::with_bound(64);
    for raw in [RAW, RAW + 1] {
        for id in 0..32 {
            pair.raw_request(raw, &wire::encode_request(&read_of(id, 0, 16 * KIB)));
        }
        let entries: Vec<Read> = (100..132).map(|id| read_of(id, 0, 4 * KIB)).collect();
        pair.raw_list(raw, &wire::encode_list_request(&entries).unwrap());
    }
    pair.deliver_requests();
    assert_eq!(pair.owner.load(RAW).served, 64);
    for raw in [RAW, RAW + 1] {
        pair.owner.endpoint_failed(raw);
    }
    assert_eq!(
        pair.owner.leases_in_flight(),
        128,
        "a failure ends no lease"
    );
    for raw in [RAW, RAW + 1] {
        for send in sends_to(&pair, raw) {
            assert!(pair.owner.send_failed(send));
        }
        assert_eq!(pair.owner.load(raw), EndpointLoad::default());
    }
    assert_eq!(pair.owner.endpoints(), 0);
    let spans: Vec<(u64, u64)> = (0..60).map(|i| (i * KIB, 4 * KIB)).collect();
    let reads = pair.read_list(&spans, DEADLINE);
    pair.settle();
    assert!(reads.iter().all(|&r| pair.answer(r) == Some(Ok(()))));
    assert_eq!(pair.owner.unmap(REGION), UnmapStatus::Waiting);
    pair.perform_owner_actions();
    assert_eq!(pair.unmapped, [REGION]);
    pair.assert_clean_end();
}

/// A consumer sends many maximal lists and never reads the replies: they
/// hold the owner's leases, so the region's unmap waits, and another
/// consumer's list naming the region meanwhile is refused entry by entry;
/// the unmap answers once that consumer is gone (its sends failed).
#[test]
fn unread_replies_hold_the_unmap_until_the_reader_goes() {
    let mut pair = Pair::new();
    for list in 0..8 {
        let entries: Vec<Read> = (0..64)
            .map(|i| read_of(list * 64 + i, (i % 16) * 4 * KIB, 4 * KIB))
            .collect();
        pair.raw_list(RAW, &wire::encode_list_request(&entries).unwrap());
    }
    pair.deliver_requests();
    assert_eq!(pair.owner.region_leases(REGION), Some(8 * 64));
    assert_eq!(pair.owner.unmap(REGION), UnmapStatus::Waiting);
    let reads = pair.read_list(&[(0, KIB), (KIB, KIB), (2 * KIB, KIB)], DEADLINE);
    pair.settle();
    for &read in &reads {
        assert_eq!(pair.answer(read), Some(Err(RdmaError::RegionNotFound)));
        assert!(pair.untouched(read));
    }
    assert!(pair.unmapped.is_empty());
    pair.owner.endpoint_failed(RAW);
    for send in sends_to(&pair, RAW) {
        pair.owner.send_failed(send);
    }
    pair.perform_owner_actions();
    assert_eq!(pair.unmapped, [REGION]);
    pair.assert_clean_end();
}

/// The owner unmaps (or shuts down) while a read's first two pieces are
/// being sent: the later pieces are refused, the unmap answers only once
/// the pieces in flight ended — which land the region's bytes — and a
/// read asked after the unmap answered is not served.
#[test]
fn an_unmap_mid_read_in_pieces_waits_for_the_pieces_sent() {
    for shutdown in [false, true] {
        let mut pair = Pair::new();
        let piece = |i: u64| (i * 16 * KIB, 16 * KIB);
        let mut pieces: Vec<_> = (0..2)
            .map(|i| pair.read(piece(i).0, piece(i).1, DEADLINE))
            .collect();
        pair.deliver_requests();
        for &sent in &pieces {
            assert_eq!(pair.deliver_next_held(), [ReplyVerdict::Write(sent)]);
        }
        if shutdown {
            pair.owner.shutdown();
        } else {
            assert_eq!(pair.owner.unmap(REGION), UnmapStatus::Waiting);
        }
        for i in 2..4 {
            pieces.push(pair.read(piece(i).0, piece(i).1, DEADLINE));
        }
        pair.settle();
        for &late in &pieces[2..] {
            assert_eq!(pair.answer(late), Some(Err(RdmaError::RegionNotFound)));
            assert!(pair.untouched(late));
        }
        assert!(pair.unmapped.is_empty());
        pair.finish_landing(pieces[0], true);
        assert!(pair.unmapped.is_empty(), "one piece still sends");
        pair.finish_landing(pieces[1], true);
        assert_eq!(pair.unmapped, [REGION]);
        assert_eq!(pair.drained, shutdown);
        for (i, &piece) in pieces[..2].iter().enumerate() {
            assert_eq!(pair.dest(piece), pair.source(i as u64 * 16 * KIB, 16 * KIB));
        }
        let after = pair.read(0, 64, DEADLINE);
        pair.settle();
        assert_eq!(pair.answer(after), Some(Err(RdmaError::RegionNotFound)));
        pair.assert_clean_end();
    }
}

/// A consumer with posted receives whose requests failed to send (the
/// owner closed the connection) shuts down: nothing is answered while the
/// transport holds the receives, and each answers `ShuttingDown` once the
/// transport gave it back.
#[test]
fn a_shutdown_with_receives_pending_answers_on_release() {
    let now = Instant::now();
    let mut consumer = Consumer::<u32>::new();
    let reads: Vec<_> = (0..3)
        .map(|_| consumer.start_receiving(OWNER, 64, now + DEADLINE, ()))
        .collect();
    for &read in &reads {
        assert!(consumer.request_failed(read, RdmaError::backend("not connected")));
    }
    consumer.shutdown();
    assert_eq!(consumer.poll_completion(), None);
    for &read in &reads {
        consumer.released(read, Err(RdmaError::backend("cancelled")));
        let answer = consumer.poll_completion().expect("answered at release");
        assert_eq!(
            (answer.read, answer.outcome),
            (read, Err(RdmaError::ShuttingDown))
        );
    }
    assert_eq!(consumer.in_flight(), 0);
}

/// A read with a posted receive whose request failed to send, from an
/// owner then lost: the failure hands back the read so the driver cancels
/// its receive, and the read answers the send's error only once the
/// transport gave the receive back (or `Ok`, had the receive filled).
#[test]
fn a_lost_owner_with_a_request_unsent_answers_on_release() {
    let now = Instant::now();
    let mut consumer = Consumer::<u32>::new();
    let read = consumer.start_receiving(OWNER, 64, now + DEADLINE, ());
    let unsent = RdmaError::backend("not connected");
    assert!(consumer.request_failed(read, unsent.clone()));
    let lost = RdmaError::backend("owner unreachable");
    assert_eq!(consumer.endpoint_failed(OWNER, lost), [read]);
    assert_eq!(consumer.poll_completion(), None);
    assert_eq!(consumer.held_on(OWNER), 1, "keep the endpoint");
    consumer.released(read, Err(RdmaError::backend("cancelled")));
    let answer = consumer.poll_completion().expect("answered at release");
    assert_eq!(answer.outcome, Err(unsent));
    assert_eq!(consumer.in_flight(), 0);
}
