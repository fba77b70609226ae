//! The owner's side of gathered lists: hostile lists judged entry by
//! entry, and the answers cut into replies within the list limits,
//! wherever the cuts fall.

use super::super::owner::{Action, ListEntryReply, Refusal, SendId, UnmapStatus};
use super::*;

const KIB: u64 = 1024;

/// The list replies the owner sent to `endpoint` (a raw consumer), with
/// their sends.
fn list_replies_to(pair: &Pair, endpoint: u32) -> Vec<(SendId, Vec<ListEntryReply>)> {
    pair.elsewhere
        .iter()
        .filter_map(|action| match action {
            Action::ServeList {
                endpoint: e,
                send,
                entry_replies: answers,
            } if *e == endpoint => Some((*send, answers.clone())),
            _ => None,
        })
        .collect()
}

/// A raw consumer's maximal list naming huge lengths, wrapping addresses,
/// zero lengths, entries past the gathering bound and past the list's
/// total: the owner serves only what lies inside the region and the
/// bounds, refuses every other entry on its own, answers each entry once
/// in order, and no reply carries more than one reply's payload.
#[test]
fn a_maximal_hostile_list_is_judged_entry_by_entry() {
    let mut pair = Pair::new();
    pair.limits = ListLimits {
        payload_per_reply: 64 * KIB - 100,
        ..ListLimits::default()
    };
    let mut entries = Vec::new();
    let mut expected = Vec::new();
    // 20 entries of 16 KiB ask 320 KiB of the 256 KiB a list may serve:
    // from there on every entry, whatever else is wrong with it, is past
    // the list's total.
    let mut total = 0;
    for id in 0..64u64 {
        let (read, inherent) = match id % 6 {
            0 => (read_of(id, 0, u64::MAX), Err(Refusal::OutOfRange)),
            1 => (
                Read {
                    address: u64::MAX - 8,
                    ..read_of(id, 0, 16)
                },
                Err(Refusal::OutOfRange),
            ),
            2 => (read_of(id, 0, 0), Err(Refusal::OutOfRange)),
            3 => (read_of(id, 0, 16 * KIB + 1), Err(Refusal::OutOfRange)),
            _ => (read_of(id, 0, 16 * KIB), Ok(16 * KIB)),
        };
        let within = read.length <= 16 * KIB && total + read.length <= 256 * KIB;
        let answer = if within {
            inherent
        } else {
            Err(Refusal::Malformed)
        };
        if let Ok(length) = answer {
            total += length;
        }
        entries.push(read);
        expected.push((id, answer));
    }
    assert_eq!(total, 256 * KIB);
    pair.raw_list(20, &wire::encode_list_request(&entries).unwrap());
    pair.deliver_requests();
    let replies = list_replies_to(&pair, 20);
    let answered: Vec<_> = replies
        .iter()
        .flat_map(|(_, answers)| answers.iter())
        .map(|a| (a.request_id, a.outcome.map(|p| p.length)))
        .collect();
    assert_eq!(answered, expected);
    for (_, answers) in &replies {
        let payload: u64 = answers
            .iter()
            .filter_map(|a| a.outcome.ok())
            .map(|p| p.length)
            .sum();
        assert!(payload <= pair.limits.payload_per_reply, "{payload}");
    }
}

/// Entries are cut into replies by count and bytes only: 64 entries of
/// 8 B go in one reply; 64 of 4 KiB in five (15 to a reply of one tcp
/// fragment); a mix of 16 KiB, 1000 B and 1 B entries in replies none of
/// which passes a fragment, and never cut where the next entry would
/// still have fit. Every entry is answered once, in order, with its own
/// bytes at its own place.
#[test]
fn a_list_is_cut_by_its_payload_only() {
    let fragment = 64 * KIB - 100;
    for (lengths, replies) in [
        (vec![8u64; 64], Some(1)),
        (vec![4 * KIB; 64], Some(5)),
        (
            (0..45)
                .map(|i| [16 * KIB, 1000, 1][i % 3])
                .collect::<Vec<_>>(),
            None,
        ),
    ] {
        let mut pair = Pair::new();
        pair.limits = ListLimits {
            payload_per_reply: fragment,
            ..ListLimits::default()
        };
        let spans: Vec<(u64, u64)> = lengths
            .iter()
            .enumerate()
            .map(|(i, &n)| (i as u64 * 8, n))
            .collect();
        let reads = pair.read_list(&spans, DEADLINE);
        pair.deliver_requests();
        // (payload length, first entry's served length) per reply.
        let sent: Vec<(u64, u64)> = pair
            .to_consumer
            .iter()
            .map(|m| match m {
                Message::List(list) => (
                    list.payload.len() as u64,
                    list.entries[0].1.expect("served"),
                ),
                Message::Single(_) => panic!("a single reply to a list"),
            })
            .collect();
        if let Some(count) = replies {
            assert_eq!(sent.len(), count, "{sent:?}");
        }
        assert!(sent.iter().all(|&(n, _)| n <= fragment), "{sent:?}");
        for cut in sent.windows(2) {
            assert!(
                cut[0].0 + cut[1].1 > fragment,
                "cut before an entry that fit: {sent:?}"
            );
        }
        pair.deliver_replies();
        for (&read, &(offset, length)) in reads.iter().zip(&spans) {
            assert_eq!(pair.answer(read), Some(Ok(())));
            assert_eq!(pair.dest(read), pair.source(offset, length));
        }
        pair.assert_clean_end();
    }
}

/// A raw consumer's list mixing every way an entry can be wrong — zero
/// bytes, a stale region (unmapped), a live region of another buffer under
/// this one's capability, a forged capability, one byte past the end —
/// with good entries, long enough to be answered in several replies: each
/// bad entry is refused on its own with the refusal that fits, and every
/// good one served, wherever the cuts fall.
#[test]
fn bad_entries_among_good_ones_are_refused_alone() {
    let mut pair = Pair::new();
    pair.owner.register(8, [0x11; 16], 0x90_0000, LEN).unwrap();
    pair.owner.register(9, [0x22; 16], 0xA0_0000, LEN).unwrap();
    assert_eq!(pair.owner.unmap(9), UnmapStatus::Waiting);
    pair.limits = ListLimits {
        payload_per_reply: 8 * KIB,
        ..ListLimits::default()
    };
    let mut forged = CAP;
    forged[7] ^= 4;
    let bad = [
        (read_of(0, 0, 0), Refusal::OutOfRange),
        (
            Read {
                region: 9,
                capability: [0x22; 16],
                address: 0xA0_0000,
                ..read_of(0, 0, 8)
            },
            Refusal::RegionUnknown,
        ),
        (
            Read {
                region: 8,
                address: 0x90_0000,
                ..read_of(0, 0, 8)
            },
            Refusal::CapabilityMismatch,
        ),
        (
            Read {
                capability: forged,
                ..read_of(0, 0, 8)
            },
            Refusal::CapabilityMismatch,
        ),
        (read_of(0, LEN - 8, 9), Refusal::OutOfRange),
    ];
    let mut entries = Vec::new();
    let mut expected = Vec::new();
    for id in 0..40u64 {
        let (read, answer) = if id % 4 == 3 {
            let (read, refusal) = bad[(id / 4) as usize % bad.len()];
            (read, Err(refusal))
        } else {
            (read_of(0, id * KIB, 3 * KIB), Ok(3 * KIB))
        };
        entries.push(Read {
            request_id: id,
            ..read
        });
        expected.push((id, answer));
    }
    pair.raw_list(20, &wire::encode_list_request(&entries).unwrap());
    pair.deliver_requests();
    let replies = list_replies_to(&pair, 20);
    assert!(replies.len() > 1, "answered in several replies");
    let answered: Vec<_> = replies
        .iter()
        .flat_map(|(_, answers)| answers.iter())
        .map(|a| (a.request_id, a.outcome.map(|p| p.length)))
        .collect();
    assert_eq!(answered, expected);
}

/// An owner whose transport bounds a reply header below a full list's
/// (small segments: 1 KiB holds 42 entries) answers a full list of 64 in
/// replies whose headers fit, together answering every entry once, in
/// order, with its own bytes.
#[test]
fn a_full_list_is_answered_in_headers_that_fit() {
    let mut pair = Pair::new();
    let segment = 1024;
    pair.limits = ListLimits {
        entries_per_reply: (segment - 8) / wire::LIST_REPLY_ENTRY_LEN,
        ..ListLimits::default()
    };
    let spans: Vec<(u64, u64)> = (0..64).map(|i| (i * KIB, KIB)).collect();
    let reads = pair.read_list(&spans, DEADLINE);
    pair.deliver_requests();
    let lists: Vec<(usize, usize)> = pair
        .to_consumer
        .iter()
        .map(|m| match m {
            Message::List(list) => (list.entries.len(), list.header_len.unwrap()),
            Message::Single(_) => panic!("a single reply to a list"),
        })
        .collect();
    assert_eq!(lists.iter().map(|l| l.0).collect::<Vec<_>>(), [42, 22]);
    assert!(
        lists.iter().all(|&(_, header)| header <= segment),
        "{lists:?}"
    );
    pair.deliver_replies();
    for (&read, &(offset, length)) in reads.iter().zip(&spans) {
        assert_eq!(pair.dest(read), pair.source(offset, length));
    }
    pair.assert_clean_end();
}
