use proptest::prelude::*;

use super::*;

/// Connections.
const A: u32 = 1;
const B: u32 = 2;

/// The reading engine's number most tests send as.
const READER: u64 = 0xDEAD_BEEF;

fn message(sequence: u64, text: &[u8]) -> Vec<u8> {
    wire::encode(READER, sequence, text).unwrap()
}

fn limits(queued: usize, queued_per_sender: usize) -> NoticeLimits {
    NoticeLimits {
        queued,
        queued_per_sender,
        queued_per_connection: queued,
        senders_remembered: 64,
    }
}

fn drain(inbox: &mut NoticeInbox<u32>) -> Vec<(u32, u64)> {
    std::iter::from_fn(|| inbox.pop())
        .map(|notice| (notice.from, notice.sequence))
        .collect()
}

#[test]
fn notices_come_out_in_arrival_order_with_their_bytes() {
    let mut inbox = NoticeInbox::new(NoticeLimits::default());
    inbox.receive(A, &message(1, b"first")).unwrap();
    inbox.receive(B, &message(1, b"other")).unwrap();
    inbox.receive(A, &message(2, b"second")).unwrap();
    let first = inbox.pop().unwrap();
    assert_eq!(
        (first.from, first.sender, first.sequence, &first.bytes[..]),
        (A, READER, 1, &b"first"[..])
    );
    assert_eq!(drain(&mut inbox), [(B, 1), (A, 2)]);
    assert_eq!(inbox.pop(), None);
}

/// A duplicate, a replay and a notice overtaken by a later one are all
/// dropped, so none is delivered twice or out of order; a gap is allowed.
#[test]
fn a_number_that_does_not_rise_is_dropped_as_a_replay() {
    let mut inbox = NoticeInbox::new(NoticeLimits::default());
    inbox.receive(A, &message(3, b"")).unwrap();
    for sequence in [3, 2, 0] {
        assert_eq!(
            inbox.receive(A, &message(sequence, b"")),
            Err(NoticeDrop::Replayed { sequence, last: 3 })
        );
    }
    inbox.receive(A, &message(7, b"")).unwrap();
    assert_eq!(drain(&mut inbox), [(A, 3), (A, 7)]);
    assert_eq!(inbox.drops().replayed, 3);
}

#[test]
fn number_zero_is_never_taken() {
    let mut inbox = NoticeInbox::new(NoticeLimits::default());
    assert_eq!(
        inbox.receive(A, &message(0, b"x")),
        Err(NoticeDrop::Replayed {
            sequence: 0,
            last: 0
        })
    );
    assert_eq!(inbox.senders(), 0, "a drop leaves no state behind");
}

/// A peer that names another reader's sender number on its own
/// connection, with a huge sequence, does not spend that reader's numbers.
#[test]
fn a_forged_sender_on_another_connection_harms_no_one() {
    let mut inbox = NoticeInbox::new(NoticeLimits::default());
    inbox.receive(A, &message(1, b"honest")).unwrap();
    let forged = wire::encode(READER, u64::MAX, b"forged").unwrap();
    inbox.receive(B, &forged).unwrap();
    inbox.receive(A, &message(2, b"honest")).unwrap();
    assert_eq!(drain(&mut inbox), [(A, 1), (B, u64::MAX), (A, 2)]);
}

/// Transports reuse a connection's name: a new reader behind it has its
/// own sender number and starts from 1.
#[test]
fn a_new_reader_on_a_reused_connection_starts_afresh() {
    let mut inbox = NoticeInbox::new(NoticeLimits::default());
    inbox.receive(A, &message(9, b"old reader")).unwrap();
    let new_reader = wire::encode(READER + 1, 1, b"new reader").unwrap();
    inbox.receive(A, &new_reader).unwrap();
    assert_eq!(drain(&mut inbox), [(A, 9), (A, 1)]);
}

/// One reader sending as fast as it can fills its own share of the queue
/// and then loses its notices; another reader still gets in.
#[test]
fn a_flooding_sender_fills_only_its_share() {
    let mut inbox = NoticeInbox::new(limits(4, 2));
    let flood: Vec<_> = (1..=5)
        .map(|sequence| inbox.receive(A, &message(sequence, b"flood")))
        .collect();
    assert_eq!(flood[..2], [Ok(()), Ok(())]);
    assert!(
        flood[2..]
            .iter()
            .all(|r| *r == Err(NoticeDrop::SenderQueueFull))
    );
    inbox.receive(B, &message(1, b"quiet")).unwrap();
    inbox.receive(B, &message(2, b"quiet")).unwrap();
    assert_eq!(inbox.queued(), 4);
    assert_eq!(inbox.drops().sender_queue_full, 3);
    // Room again once the application took one of A's.
    assert_eq!(inbox.pop().map(|n| n.sequence), Some(1));
    inbox.receive(A, &message(6, b"flood")).unwrap();
}

/// A peer naming a new sender number for each notice would get a fresh
/// share each time; its connection's share bounds it, and another
/// connection still gets in.
#[test]
fn rotating_sender_numbers_fill_only_the_connections_share() {
    let mut inbox = NoticeInbox::new(NoticeLimits {
        queued: 8,
        queued_per_sender: 4,
        queued_per_connection: 3,
        senders_remembered: 64,
    });
    let flood: Vec<_> = (0..10u64)
        .map(|sender| inbox.receive(A, &wire::encode(sender, 1, b"").unwrap()))
        .collect();
    assert_eq!(flood.iter().filter(|r| r.is_ok()).count(), 3);
    assert_eq!(inbox.drops().connection_queue_full, 7);
    inbox.receive(B, &message(1, b"quiet")).unwrap();
    assert_eq!(inbox.queued(), 4);
    // Room again on A once the application took one of its notices.
    inbox.pop();
    inbox
        .receive(A, &wire::encode(99, 1, b"").unwrap())
        .unwrap();
}

#[test]
fn the_whole_queue_is_bounded() {
    let mut inbox = NoticeInbox::new(limits(3, 3));
    for sequence in 1..=2 {
        inbox.receive(A, &message(sequence, b"")).unwrap();
    }
    inbox.receive(B, &message(1, b"")).unwrap();
    assert_eq!(
        inbox.receive(B, &message(2, b"")),
        Err(NoticeDrop::QueueFull)
    );
    assert_eq!(inbox.queued(), 3);
    // The dropped number was taken: it is not accepted later.
    inbox.pop();
    assert!(matches!(
        inbox.receive(B, &message(2, b"")),
        Err(NoticeDrop::Replayed { .. })
    ));
}

/// A peer that sends each notice under a new sender number makes the
/// inbox remember senders; it forgets the idle ones past its limit, so
/// memory stays bounded, and keeps the ones with notices queued.
#[test]
fn idle_senders_are_forgotten_past_the_limit() {
    let mut inbox = NoticeInbox::new(NoticeLimits {
        queued: 2,
        queued_per_sender: 2,
        queued_per_connection: 2,
        senders_remembered: 8,
    });
    inbox.receive(B, &message(1, b"kept")).unwrap();
    for sender in 0..100u64 {
        let _ = inbox.receive(A, &wire::encode(sender, 1, b"").unwrap());
        assert!(inbox.senders() <= 8 + 2, "{} senders", inbox.senders());
    }
    // B has a notice queued, so it is still remembered: its number 1 is
    // refused as a replay, and its notice is there.
    assert!(matches!(
        inbox.receive(B, &message(1, b"again")),
        Err(NoticeDrop::Replayed { .. })
    ));
    assert_eq!(
        inbox.pop().map(|n| (n.from, n.bytes)),
        Some((B, "kept".into()))
    );
}

#[test]
fn malformed_messages_are_counted_and_leave_no_state() {
    let mut inbox = NoticeInbox::new(NoticeLimits::default());
    let mut bad = message(1, b"abc");
    bad[0] = 9;
    assert_eq!(
        inbox.receive(A, &bad),
        Err(NoticeDrop::Malformed(NoticeFormatError::Version(9)))
    );
    assert!(matches!(
        inbox.receive(A, &[1, 2, 3]),
        Err(NoticeDrop::Malformed(_))
    ));
    assert_eq!(inbox.drops().malformed, 2);
    assert_eq!((inbox.queued(), inbox.senders()), (0, 0));
}

/// After a close the same reader may come back on the same connection
/// name and number from 1 again; what it sent before stays queued.
#[test]
fn a_closed_connection_is_forgotten_but_its_notices_stay() {
    let mut inbox = NoticeInbox::new(NoticeLimits::default());
    inbox.receive(A, &message(5, b"old")).unwrap();
    inbox.connection_closed(A);
    inbox.receive(A, &message(1, b"new")).unwrap();
    let bytes: Vec<_> = std::iter::from_fn(|| inbox.pop())
        .map(|notice| notice.bytes)
        .collect();
    assert_eq!(bytes, [&b"old"[..], &b"new"[..]]);
}

#[test]
fn closed_connections_leave_no_state_once_drained() {
    let mut inbox = NoticeInbox::new(NoticeLimits::default());
    inbox.receive(A, &message(1, b"")).unwrap();
    inbox.receive(B, &message(1, b"")).unwrap();
    inbox.pop();
    inbox.connection_closed(A);
    inbox.connection_closed(B);
    assert_eq!(inbox.senders(), 1, "B's notice is still queued");
    inbox.pop();
    assert_eq!(inbox.senders(), 0);
}

#[derive(Debug, Clone)]
enum Step {
    Send {
        connection: u8,
        sender: u8,
        sequence: u64,
    },
    Malformed {
        connection: u8,
    },
    Close {
        connection: u8,
    },
    Pop,
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        6 => (0..3u8, 0..3u8, 0..12u64).prop_map(|(connection, sender, sequence)| Step::Send {
            connection,
            sender,
            sequence,
        }),
        1 => (0..3u8).prop_map(|connection| Step::Malformed { connection }),
        1 => (0..3u8).prop_map(|connection| Step::Close { connection }),
        3 => Just(Step::Pop),
    ]
}

proptest! {
    /// Whatever peers send, in whatever order: every message is either
    /// delivered once or counted as dropped; the queue and the senders it
    /// remembers stay within their bounds; and unless it had to forget
    /// senders (a small `remembered`), delivered numbers rise per sender
    /// and connection.
    #[test]
    fn the_inbox_keeps_its_promises(
        steps in proptest::collection::vec(step(), 1..200),
        queued in 1..8usize,
        per_sender in 1..8usize,
        per_connection in 1..8usize,
        remembered in prop_oneof![1..6usize, Just(1_000)],
    ) {
        let forgets = remembered < 1_000;
        let mut inbox = NoticeInbox::new(NoticeLimits {
            queued,
            queued_per_sender: per_sender,
            queued_per_connection: per_connection,
            senders_remembered: remembered,
        });
        // Bumped when a connection closes; a notice's bytes say which
        // incarnation of its connection sent it.
        let mut epoch = [0u8; 3];
        let mut last_delivered = std::collections::HashMap::new();
        let mut sent = 0u64;
        let mut delivered = 0u64;
        for step in steps {
            match step {
                Step::Send { connection, sender, sequence } => {
                    sent += 1;
                    let bytes = [epoch[connection as usize]];
                    let message = wire::encode(u64::from(sender), sequence, &bytes).unwrap();
                    let _ = inbox.receive(u32::from(connection), &message);
                }
                Step::Malformed { connection } => {
                    sent += 1;
                    let _ = inbox.receive(u32::from(connection), &[0xFF; 3]);
                }
                Step::Close { connection } => {
                    inbox.connection_closed(u32::from(connection));
                    epoch[connection as usize] += 1;
                }
                Step::Pop => {
                    if let Some(notice) = inbox.pop() {
                        delivered += 1;
                        let key = (notice.from, notice.sender, notice.bytes[0]);
                        let previous = last_delivered.insert(key, notice.sequence);
                        prop_assert!(forgets || previous.is_none_or(|p| p < notice.sequence));
                    }
                }
            }
            prop_assert!(inbox.queued() <= queued);
            prop_assert!(inbox.senders() <= remembered + queued);
            prop_assert_eq!(sent, delivered + inbox.queued() as u64 + inbox.drops().total());
        }
    }
}
