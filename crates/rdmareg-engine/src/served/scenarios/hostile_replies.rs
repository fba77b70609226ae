//! Owners and third peers that send the consumer replies it must not take:
//! replies from an endpoint the read did not go to, of the wrong length,
//! malformed, replayed after the answer, refusals of every kind.

use std::time::Duration;

use rdmareg_core::RdmaError;

use super::super::consumer::{DropReason, ReplyVerdict, TimeoutAction};
use super::super::owner::Refusal;
use super::*;

/// Request ids are a counter a peer can guess. A third peer answers a read
/// the consumer sent to `OWNER`, with the right id and length: the reply
/// did not come on the owner's endpoint, so it is dropped, the read times
/// out at its deadline, and none of the third peer's bytes is written.
#[test]
fn a_third_peer_cannot_answer_a_read() {
    let mut pair = Pair::new();
    let read = pair.read(0, 4096, DEADLINE);
    // The owner never answers: its request stays undelivered.
    pair.inject(THIRD, header(read.0, Ok(4096)), vec![0x66; 4096]);
    let message = pair.to_consumer.pop_front().unwrap();
    assert_eq!(
        pair.deliver(message, false),
        [ReplyVerdict::Drop(DropReason::WrongEndpoint)]
    );
    assert_eq!(pair.answer(read), None, "still waits for its owner");
    pair.advance(DEADLINE);
    assert_eq!(pair.answer(read), Some(Err(RdmaError::Timeout)));
    assert!(pair.untouched(read));
    pair.assert_clean_end();
}

/// The third peer's reply comes as a rendezvous of the right length and
/// then stalls. Taken, it would hold the destination on a connection the
/// read's deadline cannot close; it is dropped before anything is
/// received, so the deadline answers the read at once, with nothing to
/// stop.
#[test]
fn a_spoofed_rendezvous_cannot_outlive_the_deadline() {
    let mut pair = Pair::new();
    let read = pair.read(0, 1 << 20, DEADLINE);
    pair.inject(THIRD, header(read.0, Ok(1 << 20)), vec![0x66; 1 << 20]);
    assert_eq!(
        pair.deliver_next_held(),
        [ReplyVerdict::Drop(DropReason::WrongEndpoint)]
    );
    assert_eq!(pair.consumer.held_on(THIRD), 0);
    assert_eq!(pair.advance(DEADLINE), [], "nothing to stop");
    assert_eq!(pair.answer(read), Some(Err(RdmaError::Timeout)));
    assert!(pair.untouched(read));
    pair.assert_clean_end();
}

/// A peer the consumer also reads from learns the id counter from the
/// request it got, and answers the consumer's next read — sent to `OWNER`
/// — over its own endpoint. Dropped: the true owner's reply then lands
/// the owner's bytes.
#[test]
fn another_owner_cannot_answer_a_read_sent_elsewhere() {
    let mut pair = Pair::new();
    let theirs = pair.read_with(THIRD, read_of(0, 0, 64), DEADLINE);
    let ours = pair.read(64, 64, DEADLINE);
    assert_eq!(ours.0, theirs.0 + 1, "the guess is right");
    pair.inject(THIRD, header(ours.0, Ok(64)), vec![0x66; 64]);
    pair.inject(THIRD, header(theirs.0, Ok(64)), vec![0x77; 64]);
    pair.deliver_replies();
    assert_eq!(pair.answer(theirs), Some(Ok(())));
    assert_eq!(pair.dest(theirs), [0x77; 64], "its own read it may answer");
    assert_eq!(pair.answer(ours), None);
    pair.settle();
    assert_eq!(pair.answer(ours), Some(Ok(())));
    assert_eq!(pair.dest(ours), pair.source(64, 64));
    pair.assert_clean_end();
}

/// The owner the read went to answers with a longer payload than the
/// header says, a longer read than asked (eager and by rendezvous), and a
/// short payload under a header claiming the full length: each read is
/// refused with a typed error before a byte is written.
#[test]
fn a_reply_of_the_wrong_length_lands_nothing() {
    for (header_len, payload_len, held) in [
        (4096, 8192, false),
        (8192, 8192, true),
        (8192, 8192, false),
        (4096, 2048, false),
        (2048, 2048, false),
        (4096, 0, false),
    ] {
        let mut pair = Pair::new();
        let read = pair.read(0, 4096, DEADLINE);
        pair.inject(
            OWNER,
            header(read.0, Ok(header_len)),
            vec![0x66; payload_len],
        );
        let message = pair.to_consumer.pop_front().unwrap();
        assert_eq!(
            pair.deliver(message, held),
            [ReplyVerdict::Refused(read)],
            "header {header_len}, payload {payload_len}"
        );
        assert!(
            matches!(pair.answer(read), Some(Err(RdmaError::Backend(_)))),
            "{:?}",
            pair.answer(read)
        );
        assert!(pair.untouched(read));
        pair.assert_clean_end();
    }
}

/// Headers of every length that are not a reply, a status nobody knows
/// carrying bytes, a refusal that claims a payload, and a reply to an id
/// never asked: none answers or writes anything, and the read times out.
/// Its owner's reply after the deadline, eager or by rendezvous, lands
/// nothing in the destination its caller owns again.
#[test]
fn malformed_and_late_replies_land_nothing() {
    let mut pair = Pair::new();
    let read = pair.read(0, 4096, Duration::from_millis(300));
    for n in 0..40usize {
        pair.inject(OWNER, vec![1u8; n], vec![0x66; 16]);
    }
    let mut unknown = header(read.0, Ok(4096));
    unknown[1] = 99;
    pair.inject(OWNER, unknown, vec![0x66; 4096]);
    let mut refusal_with_bytes = header(read.0, Ok(4096));
    refusal_with_bytes[1] = 3;
    pair.inject(OWNER, refusal_with_bytes, vec![0x66; 4096]);
    pair.inject(OWNER, header(u64::MAX, Ok(4096)), vec![0x66; 4096]);
    pair.deliver_replies();
    assert_eq!(pair.answer(read), None);
    assert!(pair.untouched(read));
    pair.advance(Duration::from_millis(300));
    assert_eq!(pair.answer(read), Some(Err(RdmaError::Timeout)));
    pair.scribble(read);
    pair.inject(OWNER, header(read.0, Ok(4096)), vec![0x66; 4096]);
    pair.deliver_replies();
    pair.inject(OWNER, header(read.0, Ok(4096)), vec![0x66; 4096]);
    assert_eq!(
        pair.deliver_next_held(),
        [ReplyVerdict::Drop(DropReason::NotAwaited)]
    );
    assert!(pair.untouched(read));
    pair.assert_clean_end();
}

/// An owner that refuses as busy, or with a code of a later release, ends
/// the read at once with a typed error — transient, so the caller knows a
/// retry may succeed — not a wait for the deadline.
#[test]
fn busy_or_unknown_refusals_answer_typed_at_once() {
    for refusal in [Refusal::Busy, Refusal::Unrecognized(200)] {
        let mut pair = Pair::new();
        let read = pair.read(0, 64, DEADLINE);
        pair.inject(OWNER, header(read.0, Err(refusal)), Vec::new());
        pair.deliver_replies();
        let answer = pair.answer(read).expect("answered before the deadline");
        assert!(
            answer.as_ref().is_err_and(RdmaError::is_transient),
            "{refusal:?}: {answer:?}"
        );
        assert!(pair.untouched(read));
        pair.assert_clean_end();
    }
}

/// Each refusal an honest owner can send reaches the caller as the typed
/// error its driver maps it to, and a third peer's refusal of the same
/// read is not one of them: the read waits for its own owner.
#[test]
fn only_the_owners_refusal_ends_a_read() {
    for (refusal, error) in [
        (Refusal::RegionUnknown, RdmaError::RegionNotFound),
        (Refusal::CapabilityMismatch, RdmaError::RegionNotFound),
        (Refusal::OutOfRange, RdmaError::OutOfRange),
        (Refusal::Deregistering, RdmaError::RegionNotFound),
        (Refusal::Malformed, RdmaError::InvalidKey),
    ] {
        let mut pair = Pair::new();
        let read = pair.read(0, 64, DEADLINE);
        pair.inject(THIRD, header(read.0, Err(refusal)), Vec::new());
        pair.deliver_replies();
        assert_eq!(pair.answer(read), None, "{refusal:?} from a third peer");
        pair.inject(OWNER, header(read.0, Err(refusal)), Vec::new());
        pair.deliver_replies();
        assert_eq!(pair.answer(read), Some(Err(error)));
        pair.assert_clean_end();
    }
}

/// The owner answers, the read answers `Ok`, the caller takes its buffer
/// back; then the owner sends the very same reply again, eager and by
/// rendezvous. A read is answered once: the replays land nothing.
#[test]
fn a_replayed_reply_lands_nothing_after_the_answer() {
    let mut pair = Pair::new();
    let read = pair.read(0, 4096, DEADLINE);
    pair.settle();
    assert_eq!(pair.answer(read), Some(Ok(())));
    assert_eq!(pair.dest(read), pair.source(0, 4096));
    pair.scribble(read);
    for held in [false, true] {
        pair.inject(OWNER, header(read.0, Ok(4096)), pair.source(0, 4096));
        let message = pair.to_consumer.pop_front().unwrap();
        assert_eq!(
            pair.deliver(message, held),
            [ReplyVerdict::Drop(DropReason::NotAwaited)]
        );
    }
    assert!(pair.untouched(read));
    pair.assert_clean_end();
}

/// The owner the read went to starts its reply's rendezvous and stalls.
/// Past the deadline the consumer asks to stop that very endpoint's
/// transfer, answers nothing while the transport holds the destination,
/// and answers `Timeout` once the transport let go; the owner's lease ends
/// with its send.
#[test]
fn the_owner_stalling_its_rendezvous_is_timed_out() {
    let mut pair = Pair::new();
    let read = pair.read(0, 1 << 16, DEADLINE);
    pair.deliver_requests();
    assert_eq!(pair.deliver_next_held(), [ReplyVerdict::Write(read)]);
    assert_eq!(
        pair.advance(DEADLINE),
        [TimeoutAction::StopTransfer {
            read,
            endpoint: OWNER
        }]
    );
    assert_eq!(pair.answer(read), None, "the transport may still write");
    assert_eq!(pair.owner.region_leases(REGION), Some(1));
    pair.finish_landing(read, false);
    assert_eq!(pair.answer(read), Some(Err(RdmaError::Timeout)));
    assert!(pair.untouched(read));
    assert_eq!(pair.owner.leases_in_flight(), 0);
    pair.assert_clean_end();
}

/// While the owner's reply is still being written (a rendezvous), the same
/// owner sends the read's reply again, once served with other bytes and
/// once refused. Neither may race the first: both are dropped, the read
/// answers `Ok` with the first reply's bytes once the transport let go.
#[test]
fn a_second_reply_cannot_race_the_first() {
    let mut pair = Pair::new();
    let read = pair.read(0, 4096, DEADLINE);
    pair.deliver_requests();
    assert_eq!(pair.deliver_next_held(), [ReplyVerdict::Write(read)]);
    pair.inject(OWNER, header(read.0, Ok(4096)), vec![0x66; 4096]);
    pair.inject(OWNER, header(read.0, Err(Refusal::OutOfRange)), Vec::new());
    for _ in 0..2 {
        assert_eq!(
            pair.deliver_next_held(),
            [ReplyVerdict::Drop(DropReason::NotAwaited)]
        );
    }
    assert_eq!(pair.answer(read), None);
    pair.finish_landing(read, true);
    assert_eq!(pair.answer(read), Some(Ok(())));
    assert_eq!(pair.dest(read), pair.source(0, 4096));
    pair.assert_clean_end();
}
