use std::time::{Duration, Instant};

use rdmareg_core::RdmaError;

use super::*;

const OWNER: u64 = 1;

fn target(length: u64) -> WriteTarget {
    WriteTarget {
        region: 3,
        capability: [7; 16],
        address: 0x1000,
        length,
    }
}

fn acknowledged(id: WriteId, length: u64) -> Reply {
    Reply {
        request_id: id.0,
        outcome: ReplyOutcome::Served { length },
    }
}

fn started(writer: &mut Writer<u64, u32>, at: Instant) -> WriteId {
    let posted = writer.start(OWNER, target(64), at + Duration::from_secs(1), 5);
    let request = posted.request.expect("a request to send");
    assert_eq!(request.request_id, posted.id.0);
    assert_eq!((request.region, request.length), (3, 64));
    posted.id
}

/// The owner says the bytes are in while the transport may still read the
/// source: the write completes `Ok` only when the send ended.
#[test]
fn a_write_completes_only_once_its_send_ended() {
    let now = Instant::now();
    let mut writer = Writer::new();
    let id = started(&mut writer, now);
    assert_eq!(writer.handle_reply(OWNER, &acknowledged(id, 64), 0), Ok(id));
    assert_eq!(writer.poll_completion(), None, "the source is still read");
    assert_eq!(writer.sending_on(OWNER), 1);
    writer.send_ended(id, Ok(()));
    let done = writer.poll_completion().expect("completed");
    assert_eq!((done.write, done.value, done.outcome), (id, 5, Ok(())));
    assert_eq!(writer.in_flight(), 0);
}

/// A send that ended well waits for the reply; the reply then completes
/// the write at once, and a second reply is dropped.
#[test]
fn a_reply_after_the_send_ended_completes_at_once() {
    let now = Instant::now();
    let mut writer = Writer::new();
    let id = started(&mut writer, now);
    writer.send_ended(id, Ok(()));
    assert_eq!(writer.poll_completion(), None, "no word from the owner");
    writer
        .handle_reply(OWNER, &acknowledged(id, 64), 0)
        .unwrap();
    assert_eq!(writer.poll_completion().unwrap().outcome, Ok(()));
    assert_eq!(
        writer.handle_reply(OWNER, &acknowledged(id, 64), 0),
        Err(DropReason::NotAwaited)
    );
}

/// A failed send with no reply yet completes with the send's error; a
/// refusal that came first wins over it.
#[test]
fn a_failed_send_without_a_reply_fails_the_write() {
    let now = Instant::now();
    let mut writer = Writer::new();
    let id = started(&mut writer, now);
    writer.send_ended(id, Err(RdmaError::backend("peer gone")));
    assert_eq!(
        writer.poll_completion().unwrap().outcome,
        Err(RdmaError::backend("peer gone"))
    );
    let id = started(&mut writer, now);
    let refusal = Reply {
        request_id: id.0,
        outcome: ReplyOutcome::Refused(RdmaError::AccessDenied { operation: "write" }),
    };
    writer.handle_reply(OWNER, &refusal, 0).unwrap();
    writer.send_ended(id, Err(RdmaError::backend("cancelled")));
    assert_eq!(
        writer.poll_completion().unwrap().outcome,
        Err(RdmaError::AccessDenied { operation: "write" })
    );
}

/// A third peer guessing a write's id cannot answer it; the owner's own
/// reply still can.
#[test]
fn a_reply_from_another_endpoint_is_dropped() {
    let now = Instant::now();
    let mut writer = Writer::new();
    let id = started(&mut writer, now);
    assert_eq!(
        writer.handle_reply(99, &acknowledged(id, 64), 0),
        Err(DropReason::WrongEndpoint)
    );
    writer.send_ended(id, Ok(()));
    assert_eq!(writer.poll_completion(), None);
    writer
        .handle_reply(OWNER, &acknowledged(id, 64), 0)
        .unwrap();
    assert_eq!(writer.poll_completion().unwrap().outcome, Ok(()));
}

/// An acknowledgement with payload bytes, or of another length, is not
/// the protocol: the write fails rather than pass for written.
#[test]
fn a_reply_claiming_a_payload_fails_the_write() {
    let now = Instant::now();
    let mut writer = Writer::new();
    for (length, payload) in [(64, 64), (63, 0), (65, 0)] {
        let id = started(&mut writer, now);
        writer.send_ended(id, Ok(()));
        writer
            .handle_reply(OWNER, &acknowledged(id, length), payload)
            .unwrap();
        let outcome = writer.poll_completion().unwrap().outcome;
        assert!(
            matches!(outcome, Err(RdmaError::Backend(_))),
            "{length}/{payload}: {outcome:?}"
        );
    }
}

/// Past its deadline a write whose send runs asks the driver to stop the
/// send and is answered `Timeout` only once the send ended.
#[test]
fn a_deadline_waits_for_the_send_to_end() {
    let now = Instant::now();
    let mut writer = Writer::new();
    let id = started(&mut writer, now);
    assert_eq!(writer.poll_timeout(), Some(now + Duration::from_secs(1)));
    let actions = writer.handle_timeout(now + Duration::from_secs(2));
    assert_eq!(
        actions,
        [WriteTimeout::StopSend {
            write: id,
            endpoint: OWNER
        }]
    );
    assert_eq!(writer.poll_completion(), None, "the source is still read");
    assert_eq!(
        writer.handle_reply(OWNER, &acknowledged(id, 64), 0),
        Err(DropReason::NotAwaited),
        "a late reply does not turn a timeout into Ok"
    );
    writer.send_ended(id, Err(RdmaError::backend("cancelled")));
    assert_eq!(
        writer.poll_completion().unwrap().outcome,
        Err(RdmaError::Timeout)
    );
    assert_eq!(writer.poll_timeout(), None);
}

/// An endpoint failure and shutdown answer writes whose send ended at
/// once, and the others once their send ends; later writes are refused.
#[test]
fn failure_and_shutdown_answer_after_the_send_ended() {
    let now = Instant::now();
    let mut writer = Writer::new();
    let sent = started(&mut writer, now);
    writer.send_ended(sent, Ok(()));
    let sending = started(&mut writer, now);
    let held = writer.endpoint_failed(OWNER, RdmaError::backend("endpoint failed"));
    assert_eq!(held, [sending]);
    let done = writer.poll_completion().unwrap();
    assert_eq!(done.write, sent);
    assert_eq!(writer.poll_completion(), None);
    writer.send_ended(sending, Err(RdmaError::backend("flushed")));
    assert_eq!(
        writer.poll_completion().unwrap().outcome,
        Err(RdmaError::backend("endpoint failed"))
    );

    let sending = started(&mut writer, now);
    writer.shutdown();
    assert_eq!(writer.poll_completion(), None);
    writer.send_ended(sending, Ok(()));
    assert_eq!(
        writer.poll_completion().unwrap().outcome,
        Err(RdmaError::ShuttingDown)
    );
    let refused = writer.start(OWNER, target(8), now, 1);
    assert_eq!(refused.request, None);
    assert_eq!(
        writer.poll_completion().unwrap().outcome,
        Err(RdmaError::ShuttingDown)
    );
}

/// Write ids have the write bit, so a handler shared with reads routes a
/// reply by its id alone.
#[test]
fn write_ids_carry_the_write_bit() {
    let mut writer: Writer<u64> = Writer::new();
    let posted = writer.start(OWNER, target(1), Instant::now(), ());
    assert!(wire::is_write_request_id(posted.id.0));
    assert_eq!(writer.value(posted.id), Some(&()));
}

/// A write list's reply answers each of its writes by its own entry: an
/// `Ok`, a refusal as the caller's typed error, an entry for a write the
/// writer does not await dropped; a reply from another endpoint answers
/// none of them.
#[test]
fn a_list_reply_answers_each_write_by_its_entry() {
    let now = Instant::now();
    let mut writer = Writer::new();
    let first = started(&mut writer, now);
    let second = started(&mut writer, now);
    for id in [first, second] {
        writer.send_ended(id, Ok(()));
    }
    let header = wire::encode_list_reply_fields(
        [
            (first.0, 0, 64),
            (
                second.0,
                wire::refusal_code(crate::served::Refusal::AccessDenied),
                0,
            ),
            (WriteId(wire::WRITE_REQUEST_ID_BIT | 99).0, 0, 64),
        ]
        .into_iter(),
    )
    .unwrap();
    assert_eq!(
        writer.handle_list_reply(2, &header, 0).unwrap(),
        [
            Err(DropReason::WrongEndpoint),
            Err(DropReason::WrongEndpoint),
            Err(DropReason::NotAwaited)
        ]
    );
    assert_eq!(writer.poll_completion(), None);
    assert_eq!(
        writer.handle_list_reply(OWNER, &header, 0).unwrap(),
        [Ok(first), Ok(second), Err(DropReason::NotAwaited)]
    );
    let outcomes: Vec<_> = std::iter::from_fn(|| writer.poll_completion())
        .map(|done| (done.write, done.outcome))
        .collect();
    assert_eq!(
        outcomes,
        [
            (first, Ok(())),
            (second, Err(RdmaError::AccessDenied { operation: "write" }))
        ]
    );
    assert!(writer.handle_list_reply(OWNER, &header[1..], 0).is_err());
}

/// A write list's reply with payload bytes is not the protocol: every
/// write it acknowledges fails rather than pass for written.
#[test]
fn a_list_reply_with_a_payload_fails_its_writes() {
    let now = Instant::now();
    let mut writer = Writer::new();
    let id = started(&mut writer, now);
    writer.send_ended(id, Ok(()));
    let header = wire::encode_list_reply_fields([(id.0, 0, 64)].into_iter()).unwrap();
    writer.handle_list_reply(OWNER, &header, 64).unwrap();
    let outcome = writer.poll_completion().unwrap().outcome;
    assert!(matches!(outcome, Err(RdmaError::Backend(_))), "{outcome:?}");
}
