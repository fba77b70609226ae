//! Gathered lists and reads in pieces at the consumer: list replies from
//! hostile owners (entries named twice, strangers, wrong lengths, another
//! peer's list, replays, pieces crossed). The owner's side of lists is in
//! `owner_lists`.
//!
//! The consumer's rule is per read: a list entry, or a piece of a read cut
//! in pieces, is a read of its own with its own request id. How a driver
//! finds an entry's bytes in a list reply's payload is the driver's; the
//! harness walks the payload entry by entry as the UCX engine does.

use rdmareg_core::RdmaError;

use super::super::consumer::{DropReason, ReplyVerdict};
use super::super::owner::Refusal;
use super::*;

const KIB: u64 = 1024;

/// `length` bytes of `byte`.
fn fill(byte: u8, length: u64) -> Vec<u8> {
    vec![byte; length as usize]
}

/// Takes the next message off the consumer's queue and delivers it eager.
fn deliver_next(pair: &mut Pair) -> Vec<ReplyVerdict> {
    let message = pair.to_consumer.pop_front().expect("a reply on its way");
    pair.deliver(message, false)
}

/// A list reply sent again after its reads were answered — the same
/// reply, one with other bytes, and single replies for the same ids —
/// changes no destination byte: an answer is final.
#[test]
fn replayed_list_replies_change_no_byte() {
    let mut pair = Pair::new();
    let reads = pair.read_list(&[(0, KIB), (KIB, KIB), (2 * KIB, KIB)], DEADLINE);
    pair.settle();
    for (i, &read) in reads.iter().enumerate() {
        assert_eq!(pair.answer(read), Some(Ok(())));
        assert_eq!(pair.dest(read), pair.source(i as u64 * KIB, KIB));
        pair.scribble(read);
    }
    let ids: Vec<_> = reads.iter().map(|r| (r.0, Ok(KIB))).collect();
    pair.inject_list(OWNER, ids.clone(), pair.source(0, 3 * KIB));
    pair.inject_list(OWNER, ids, fill(0x66, 3 * KIB));
    for read in &reads {
        pair.inject(OWNER, header(read.0, Ok(KIB)), fill(0x77, KIB));
    }
    while !pair.to_consumer.is_empty() {
        let verdicts = deliver_next(&mut pair);
        assert!(
            verdicts
                .iter()
                .all(|v| *v == ReplyVerdict::Drop(DropReason::NotAwaited))
        );
    }
    assert!(reads.iter().all(|&read| pair.untouched(read)));
    pair.assert_clean_end();
}

/// A list reply naming one read twice lands it once, from its first
/// entry; the entries after the repeat still land their own bytes from
/// their own place; a later reply naming it again lands nothing.
#[test]
fn an_entry_named_twice_lands_once_from_the_first() {
    let mut pair = Pair::new();
    let [a, b, c] = pair.read_list(&[(0, KIB), (KIB, KIB), (2 * KIB, KIB)], DEADLINE)[..] else {
        unreachable!()
    };
    let mut payload = fill(0xA1, KIB);
    payload.extend(fill(0xB1, KIB));
    payload.extend(fill(0xB2, KIB));
    payload.extend(fill(0xC1, KIB));
    pair.inject_list(
        OWNER,
        vec![
            (a.0, Ok(KIB)),
            (b.0, Ok(KIB)),
            (b.0, Ok(KIB)),
            (c.0, Ok(KIB)),
        ],
        payload,
    );
    assert_eq!(
        deliver_next(&mut pair),
        [
            ReplyVerdict::Write(a),
            ReplyVerdict::Write(b),
            ReplyVerdict::Drop(DropReason::NotAwaited),
            ReplyVerdict::Write(c)
        ]
    );
    pair.inject_list(OWNER, vec![(b.0, Ok(KIB))], fill(0xB3, KIB));
    assert_eq!(
        deliver_next(&mut pair),
        [ReplyVerdict::Drop(DropReason::NotAwaited)]
    );
    assert_eq!(pair.dest(a), fill(0xA1, KIB));
    assert_eq!(pair.dest(b), fill(0xB1, KIB));
    assert_eq!(pair.dest(c), fill(0xC1, KIB));
    pair.assert_clean_end();
}

/// A peer that is not the owner a list went to, replying with the list's
/// request ids, lands nothing; the true owner's reply then lands its
/// bytes.
#[test]
fn another_peer_answering_a_lists_ids_lands_nothing() {
    let mut pair = Pair::new();
    let reads = pair.read_list(&[(0, KIB), (KIB, KIB)], DEADLINE);
    let entries = reads.iter().map(|r| (r.0, Ok(KIB))).collect();
    pair.inject_list(THIRD, entries, fill(0x66, 2 * KIB));
    assert_eq!(
        deliver_next(&mut pair),
        vec![ReplyVerdict::Drop(DropReason::WrongEndpoint); 2]
    );
    assert!(reads.iter().all(|&read| pair.untouched(read)));
    pair.settle();
    assert_eq!(pair.dest(reads[1]), pair.source(KIB, KIB));
    pair.assert_clean_end();
}

/// List replies that also name ids never asked (zero, `u64::MAX`, past the
/// list's) with bytes of their own: the strangers land nothing, and every
/// real entry lands its own bytes from its own place after them.
#[test]
fn strangers_in_a_list_reply_land_nothing() {
    let mut pair = Pair::new();
    let [a, b] = pair.read_list(&[(0, KIB), (KIB, KIB)], DEADLINE)[..] else {
        unreachable!()
    };
    let mut payload = fill(0x01, 100);
    payload.extend(fill(0xA1, KIB));
    payload.extend(fill(0x02, 7));
    payload.extend(fill(0x03, KIB));
    payload.extend(fill(0xB1, KIB));
    pair.inject_list(
        OWNER,
        vec![
            (0, Ok(100)),
            (a.0, Ok(KIB)),
            (u64::MAX, Ok(7)),
            (b.0 + 1, Ok(KIB)),
            (b.0, Ok(KIB)),
        ],
        payload,
    );
    let stranger = ReplyVerdict::Drop(DropReason::NotAwaited);
    assert_eq!(
        deliver_next(&mut pair),
        [
            stranger.clone(),
            ReplyVerdict::Write(a),
            stranger.clone(),
            stranger,
            ReplyVerdict::Write(b)
        ]
    );
    assert_eq!(pair.dest(a), fill(0xA1, KIB));
    assert_eq!(pair.dest(b), fill(0xB1, KIB));
    pair.assert_clean_end();
}

/// Entries carrying one byte more, one less, or none for a 4 KiB read
/// fail alone, typed, with nothing written; their neighbours in the same
/// reply land their own bytes.
#[test]
fn entries_of_the_wrong_length_fail_alone() {
    let mut pair = Pair::new();
    let spans: Vec<(u64, u64)> = (0..5).map(|i| (i * 4 * KIB, 4 * KIB)).collect();
    let reads = pair.read_list(&spans, DEADLINE);
    let lengths = [4 * KIB, 4 * KIB + 1, 4 * KIB, 4 * KIB - 1, 0];
    let mut payload = Vec::new();
    let mut entries = Vec::new();
    for (i, (&read, &length)) in reads.iter().zip(&lengths).enumerate() {
        payload.extend(fill(0x10 + i as u8, length));
        entries.push((read.0, Ok(length)));
    }
    pair.inject_list(OWNER, entries, payload);
    pair.deliver_replies();
    for (i, (&read, &length)) in reads.iter().zip(&lengths).enumerate() {
        if length == 4 * KIB {
            assert_eq!(pair.answer(read), Some(Ok(())));
            assert_eq!(pair.dest(read), fill(0x10 + i as u8, length));
        } else {
            assert!(matches!(
                pair.answer(read),
                Some(Err(RdmaError::Backend(_)))
            ));
            assert!(pair.untouched(read));
        }
    }
    pair.assert_clean_end();
}

/// Two reads each cut in two pieces. The owner answers each piece of a
/// 32 KiB read under its sibling's id: the halves have one length, so they
/// land swapped inside their own read (the owner decides what its bytes
/// are). The pieces of a 24 KiB read (16 KiB and 8 KiB) swapped have the
/// other's length and are refused: nothing lands outside a piece, and the
/// right answers sent afterwards land nothing.
#[test]
fn pieces_under_each_others_ids_stay_inside_their_read() {
    let mut pair = Pair::new();
    let [p1, p2, q1, q2] = pair.read_list(
        &[
            (0, 16 * KIB),
            (16 * KIB, 16 * KIB),
            (32 * KIB, 16 * KIB),
            (48 * KIB, 8 * KIB),
        ],
        DEADLINE,
    )[..] else {
        unreachable!()
    };
    let mut payload = pair.source(16 * KIB, 16 * KIB);
    payload.extend(pair.source(0, 16 * KIB));
    payload.extend(pair.source(48 * KIB, 8 * KIB));
    payload.extend(pair.source(32 * KIB, 16 * KIB));
    pair.inject_list(
        OWNER,
        vec![
            (p1.0, Ok(16 * KIB)),
            (p2.0, Ok(16 * KIB)),
            (q1.0, Ok(8 * KIB)),
            (q2.0, Ok(16 * KIB)),
        ],
        payload,
    );
    pair.deliver_replies();
    assert_eq!(pair.answer(p1), Some(Ok(())));
    assert_eq!(pair.dest(p1), pair.source(16 * KIB, 16 * KIB));
    assert_eq!(pair.dest(p2), pair.source(0, 16 * KIB));
    for q in [q1, q2] {
        assert!(matches!(pair.answer(q), Some(Err(RdmaError::Backend(_)))));
        assert!(pair.untouched(q));
    }
    pair.settle();
    assert!(pair.untouched(q1) && pair.untouched(q2));
    assert_eq!(pair.dest(p1), pair.source(16 * KIB, 16 * KIB));
    pair.assert_clean_end();
}

/// Pieces answered out of order across replies: second pieces first, one
/// twice with other bytes, among strangers; then the first pieces in
/// reverse, one twice, and the second pieces again with foreign bytes.
/// Each piece lands once, from the first answer naming it, and a replay of
/// the whole list after the answers lands nothing.
#[test]
fn pieces_out_of_order_land_once_from_the_first() {
    let mut pair = Pair::new();
    let spans: Vec<(u64, u64)> = (0..6).map(|i| (i * 8 * KIB, 8 * KIB)).collect();
    let pieces = pair.read_list(&spans, DEADLINE);
    let (firsts, seconds): (Vec<_>, Vec<_>) =
        pieces.iter().enumerate().partition(|(i, _)| i % 2 == 0);
    let own = |pair: &Pair, i: usize| pair.source(i as u64 * 8 * KIB, 8 * KIB);
    let mut entries = vec![(9999, Ok(8))];
    let mut payload = fill(0x01, 8);
    for &(i, read) in &seconds {
        entries.push((read.0, Ok(8 * KIB)));
        payload.extend(own(&pair, i));
    }
    entries.push((seconds[0].1.0, Ok(8 * KIB)));
    payload.extend(fill(0x66, 8 * KIB));
    pair.inject_list(OWNER, entries, payload);
    let mut entries = Vec::new();
    let mut payload = Vec::new();
    for &(i, read) in firsts.iter().rev() {
        entries.push((read.0, Ok(8 * KIB)));
        payload.extend(own(&pair, i));
    }
    entries.push((firsts[1].1.0, Ok(8 * KIB)));
    payload.extend(fill(0x67, 8 * KIB));
    for &(_, read) in &seconds {
        entries.push((read.0, Ok(8 * KIB)));
        payload.extend(fill(0x68, 8 * KIB));
    }
    pair.inject_list(OWNER, entries, payload);
    pair.deliver_replies();
    for (i, &read) in pieces.iter().enumerate() {
        assert_eq!(pair.answer(read), Some(Ok(())));
        assert_eq!(pair.dest(read), own(&pair, i), "piece {i}");
    }
    pair.settle();
    for (i, &read) in pieces.iter().enumerate() {
        assert_eq!(pair.dest(read), own(&pair, i), "piece {i} after the replay");
    }
    pair.assert_clean_end();
}

/// One reply refuses one read's second piece and another's first, and
/// serves pieces of two more with one byte too many and one too few. Each
/// of those pieces fails with its own error and holds nothing; every other
/// piece lands in place.
#[test]
fn refused_or_missized_pieces_fail_only_their_own() {
    let mut pair = Pair::new();
    let spans: Vec<(u64, u64)> = (0..8).map(|i| (i * 4 * KIB, 4 * KIB)).collect();
    let pieces = pair.read_list(&spans, DEADLINE);
    let answers: Vec<Result<u64, Refusal>> = vec![
        Ok(4 * KIB),
        Err(Refusal::OutOfRange),
        Err(Refusal::RegionUnknown),
        Ok(4 * KIB),
        Ok(4 * KIB + 1),
        Ok(4 * KIB),
        Ok(4 * KIB),
        Ok(4 * KIB - 1),
    ];
    let mut payload = Vec::new();
    for (i, answer) in answers.iter().enumerate() {
        if let Ok(length) = answer {
            let mut bytes = pair.source(i as u64 * 4 * KIB, 4 * KIB);
            bytes.resize(*length as usize, 0x66);
            payload.extend(bytes);
        }
    }
    let entries = pieces
        .iter()
        .zip(&answers)
        .map(|(r, a)| (r.0, *a))
        .collect();
    pair.inject_list(OWNER, entries, payload);
    pair.deliver_replies();
    for (i, &read) in pieces.iter().enumerate() {
        let answer = pair.answer(read).unwrap();
        match i {
            1 => assert_eq!(answer, Err(RdmaError::OutOfRange)),
            2 => assert_eq!(answer, Err(RdmaError::RegionNotFound)),
            4 | 7 => assert!(matches!(answer, Err(RdmaError::Backend(_)))),
            _ => {
                assert_eq!(answer, Ok(()));
                assert_eq!(pair.dest(read), pair.source(i as u64 * 4 * KIB, 4 * KIB));
                continue;
            }
        }
        assert!(pair.untouched(read), "piece {i}");
    }
    pair.assert_clean_end();
}

/// A read sent alone answered through a list reply's entry, and a gathered
/// read answered by a single reply, land when the length is the read's
/// own; an entry with another length fails its read and lands nothing.
#[test]
fn crossed_reply_formats_land_only_with_the_reads_length() {
    let mut pair = Pair::new();
    let alone = pair.read(0, 64 * KIB, DEADLINE);
    let [g1, g2] = pair.read_list(&[(0, KIB), (KIB, KIB)], DEADLINE)[..] else {
        unreachable!()
    };
    pair.inject_list(
        OWNER,
        vec![(alone.0, Ok(64 * KIB)), (g2.0, Ok(2 * KIB))],
        [pair.source(0, 64 * KIB), fill(0x66, 2 * KIB)].concat(),
    );
    pair.inject(OWNER, header(g1.0, Ok(KIB)), pair.source(0, KIB));
    pair.deliver_replies();
    assert_eq!(pair.answer(alone), Some(Ok(())));
    assert_eq!(pair.dest(alone), pair.source(0, 64 * KIB));
    assert_eq!(pair.answer(g1), Some(Ok(())));
    assert_eq!(pair.dest(g1), pair.source(0, KIB));
    assert!(matches!(pair.answer(g2), Some(Err(RdmaError::Backend(_)))));
    assert!(pair.untouched(g2));
    pair.assert_clean_end();
}
