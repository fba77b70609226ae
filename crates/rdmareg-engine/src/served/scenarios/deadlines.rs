//! Deadlines that pass while a payload is being written, between the
//! pieces of a read, between the entries of a list, and while a posted
//! receive's request is being sent again: an answer comes only once the
//! transport let go of the destination, and a reply after the answer
//! lands nothing.

use std::time::{Duration, Instant};

use rdmareg_core::RdmaError;

use super::super::consumer::{Consumer, DropReason, ReplyVerdict, TimeoutAction};
use super::*;

const KIB: u64 = 1024;

/// A 64 KiB read whose payload is being written when its deadline passes:
/// the consumer asks to stop the transfer and answers nothing while the
/// transport still writes (here, a first part); `Timeout` comes once the
/// transport let go, and nothing is written after it.
#[test]
fn nothing_lands_after_a_deadline_answer() {
    let mut pair = Pair::new();
    let read = pair.read(0, 64 * KIB, DEADLINE);
    pair.deliver_requests();
    assert_eq!(pair.deliver_next_held(), [ReplyVerdict::Write(read)]);
    assert_eq!(pair.advance(DEADLINE).len(), 1);
    let part = pair.source(0, 1000);
    pair.write(read, &part);
    assert_eq!(pair.answer(read), None);
    pair.finish_landing(read, false);
    assert_eq!(pair.answer(read), Some(Err(RdmaError::Timeout)));
    pair.scribble(read);
    pair.settle();
    assert!(pair.untouched(read));
    pair.assert_clean_end();
}

/// A read in three pieces whose deadline passes with one piece landed,
/// one being written and one still asked: the asked piece answers
/// `Timeout` at once, the written one only once the transport let go, and
/// the last piece's reply, when it comes, lands nothing.
#[test]
fn a_deadline_between_pieces_lets_no_piece_land_after() {
    let mut pair = Pair::new();
    let pieces: Vec<_> = (0..3)
        .map(|i| pair.read(i * 16 * KIB, 16 * KIB, DEADLINE))
        .collect();
    pair.deliver_requests();
    let first = pair
        .to_consumer
        .pop_front()
        .expect("the first piece's reply");
    pair.deliver(first, false);
    assert_eq!(pair.deliver_next_held(), [ReplyVerdict::Write(pieces[1])]);
    let last = pair
        .to_consumer
        .pop_front()
        .expect("the last piece's reply");
    assert_eq!(pair.answer(pieces[0]), Some(Ok(())));
    assert_eq!(
        pair.advance(DEADLINE),
        [TimeoutAction::StopTransfer {
            read: pieces[1],
            endpoint: OWNER
        }]
    );
    assert_eq!(pair.answer(pieces[2]), Some(Err(RdmaError::Timeout)));
    assert_eq!(pair.answer(pieces[1]), None, "still being written");
    pair.finish_landing(pieces[1], false);
    assert_eq!(pair.answer(pieces[1]), Some(Err(RdmaError::Timeout)));
    assert_eq!(
        pair.deliver(last, false),
        [ReplyVerdict::Drop(DropReason::NotAwaited)]
    );
    assert!(pair.untouched(pieces[1]) && pair.untouched(pieces[2]));
    assert_eq!(pair.owner.leases_in_flight(), 0);
    pair.assert_clean_end();
}

/// The owner answers only the first piece of each of two reads; the
/// second pieces time out, the first ones hold exactly their bytes, and
/// the second pieces sent after the answers land nothing.
#[test]
fn unanswered_second_pieces_time_out_and_land_nothing_later() {
    let mut pair = Pair::new();
    let spans = [
        (0, 16 * KIB),
        (16 * KIB, 8 * KIB),
        (32 * KIB, 16 * KIB),
        (48 * KIB, 16 * KIB),
    ];
    let pieces = pair.read_list(&spans, DEADLINE);
    let answers = |ids: &[usize]| ids.iter().map(|&i| (pieces[i].0, Ok(spans[i].1))).collect();
    let bytes = |pair: &Pair, ids: &[usize]| {
        ids.iter()
            .flat_map(|&i| pair.source(spans[i].0, spans[i].1))
            .collect()
    };
    pair.inject_list(OWNER, answers(&[0, 2]), bytes(&pair, &[0, 2]));
    pair.deliver_replies();
    pair.advance(DEADLINE);
    for i in [1, 3] {
        assert_eq!(pair.answer(pieces[i]), Some(Err(RdmaError::Timeout)));
    }
    pair.inject_list(OWNER, answers(&[1, 3]), bytes(&pair, &[1, 3]));
    pair.deliver_replies();
    for i in [0, 2] {
        assert_eq!(pair.dest(pieces[i]), pair.source(spans[i].0, spans[i].1));
    }
    assert!(pair.untouched(pieces[1]) && pair.untouched(pieces[3]));
    pair.assert_clean_end();
}

/// Two reads of one list with different deadlines: the first expires
/// before the owner answers, so the list reply that then serves both
/// lands only the second, and the expired read's destination stays as it
/// was at its `Timeout`.
#[test]
fn a_list_member_past_its_deadline_keeps_its_bytes() {
    let mut pair = Pair::new();
    let due = [Duration::from_secs(1), Duration::from_secs(5)];
    let [early, late] = pair.read_list_due(&[(0, KIB), (KIB, KIB)], &due)[..] else {
        unreachable!()
    };
    pair.deliver_requests();
    pair.advance(Duration::from_secs(1));
    assert_eq!(pair.answer(early), Some(Err(RdmaError::Timeout)));
    assert_eq!(pair.answer(late), None);
    pair.deliver_replies();
    assert!(pair.untouched(early));
    assert_eq!(pair.dest(late), pair.source(KIB, KIB));
    assert_eq!(pair.owner.leases_in_flight(), 0, "the reply's send ended");
    pair.assert_clean_end();
}

/// A list whose even entries are due in 150 ms and odd ones in 5 s: the
/// owner answers the first 21 entries at once and the rest after the even
/// deadlines passed, then every entry again. The late reply lands only
/// the odd entries; the expired ones hold nothing and never change.
#[test]
fn late_list_replies_land_only_the_live_entries() {
    let mut pair = Pair::new();
    let spans: Vec<(u64, u64)> = (0..64).map(|i| (i * KIB, KIB)).collect();
    let due: Vec<Duration> = (0..64)
        .map(|i| Duration::from_millis(if i % 2 == 0 { 150 } else { 5000 }))
        .collect();
    let reads = pair.read_list_due(&spans, &due);
    let reply = |pair: &mut Pair, range: std::ops::Range<usize>| {
        let entries = range.clone().map(|i| (reads[i].0, Ok(KIB))).collect();
        let payload = range
            .flat_map(|i| pair.source(i as u64 * KIB, KIB))
            .collect();
        pair.inject_list(OWNER, entries, payload);
        pair.deliver_replies();
    };
    reply(&mut pair, 0..21);
    pair.advance(Duration::from_millis(150));
    reply(&mut pair, 21..64);
    reply(&mut pair, 0..64);
    for (i, &read) in reads.iter().enumerate() {
        if i < 21 || i % 2 == 1 {
            assert_eq!(pair.answer(read), Some(Ok(())), "entry {i}");
            assert_eq!(pair.dest(read), pair.source(i as u64 * KIB, KIB));
        } else {
            assert_eq!(pair.answer(read), Some(Err(RdmaError::Timeout)));
            assert!(pair.untouched(read), "entry {i}");
        }
    }
    pair.assert_clean_end();
}

/// A gathered read the owner answers with a single rendezvous reply that
/// it then never completes: the read is answered only when the transport
/// lets go of its destination, after its deadline asked to stop it.
#[test]
fn a_stalled_rendezvous_to_a_list_entry_answers_after_release() {
    let mut pair = Pair::new();
    let [read] = pair.read_list(&[(0, 4 * KIB)], DEADLINE)[..] else {
        unreachable!()
    };
    pair.inject(OWNER, header(read.0, Ok(4 * KIB)), pair.source(0, 4 * KIB));
    assert_eq!(pair.deliver_next_held(), [ReplyVerdict::Write(read)]);
    assert_eq!(pair.advance(DEADLINE).len(), 1);
    assert_eq!(pair.advance(DEADLINE), [], "asked to stop once");
    assert_eq!(pair.answer(read), None);
    pair.finish_landing(read, false);
    assert_eq!(pair.answer(read), Some(Err(RdmaError::Timeout)));
    pair.settle();
    assert!(pair.untouched(read));
    pair.assert_clean_end();
}

/// A read whose receive is posted into its destination before the request
/// goes out (libfabric), whose request fails to send (a connection the
/// owner closed) while its deadline passes: the consumer asks to cancel
/// the receive, and the read is answered `Timeout` only when the transport
/// gave the receive back — or `Ok` if the receive filled meanwhile.
#[test]
fn a_posted_receive_past_its_deadline_answers_on_release() {
    for filled in [false, true] {
        let now = Instant::now();
        let mut consumer = Consumer::<u32>::new();
        let read = consumer.start_receiving(OWNER, 64, now + DEADLINE, ());
        assert!(consumer.request_failed(read, RdmaError::backend("not connected")));
        assert_eq!(
            consumer.handle_timeout(now + DEADLINE),
            [TimeoutAction::StopTransfer {
                read,
                endpoint: OWNER
            }]
        );
        assert_eq!(
            consumer.poll_completion(),
            None,
            "the receive may still fill"
        );
        let result = if filled {
            Ok(())
        } else {
            Err(RdmaError::backend("cancelled"))
        };
        consumer.released(read, result);
        let answer = consumer.poll_completion().expect("answered at release");
        let expected = if filled {
            Ok(())
        } else {
            Err(RdmaError::Timeout)
        };
        assert_eq!(answer.outcome, expected);
        assert_eq!(consumer.poll_completion(), None);
        assert_eq!(consumer.in_flight(), 0);
    }
}
