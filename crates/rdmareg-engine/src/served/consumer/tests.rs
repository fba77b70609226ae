//! The consumer's rules one at a time, then the simulator over many seeds.

use std::time::{Duration, Instant};

use rdmareg_core::RdmaError;

use super::*;

mod sim;

const OWNER: u32 = 1;
const OTHER: u32 = 2;

/// A completion as `(read, outcome)`.
fn pair<T>(completion: Completion<T>) -> (ReadId, Result<(), RdmaError>) {
    (completion.read, completion.outcome)
}

fn served(request_id: u64, length: u64) -> Reply {
    Reply {
        request_id,
        outcome: ReplyOutcome::Served { length },
    }
}

fn started(length: u64) -> (Consumer<u32>, ReadId, Instant) {
    let now = Instant::now();
    let mut consumer = Consumer::new();
    let read = consumer.start(OWNER, length, now + Duration::from_millis(10), ());
    (consumer, read, now)
}

#[test]
fn a_served_reply_completes_once_written() {
    let (mut consumer, read, _) = started(8);
    assert_eq!(
        consumer.handle_reply(OWNER, &served(read.0, 8), 8),
        ReplyVerdict::Write(read)
    );
    assert_eq!(
        consumer.poll_completion().map(pair),
        None,
        "not before the transport let go"
    );
    consumer.released(read, Ok(()));
    assert_eq!(consumer.poll_completion().map(pair), Some((read, Ok(()))));
    assert_eq!(consumer.in_flight(), 0);
}

#[test]
fn a_reply_from_another_endpoint_is_dropped() {
    let (mut consumer, read, _) = started(8);
    assert_eq!(
        consumer.handle_reply(OTHER, &served(read.0, 8), 8),
        ReplyVerdict::Drop(DropReason::WrongEndpoint)
    );
    assert_eq!(
        consumer.handle_reply(OWNER, &served(read.0, 8), 8),
        ReplyVerdict::Write(read)
    );
}

/// A third peer that guesses a request id cannot fail the read with a
/// refusal either: the owner's reply is still written.
#[test]
fn a_refusal_from_another_endpoint_is_dropped() {
    let (mut consumer, read, _) = started(8);
    let refusal = Reply {
        request_id: read.0,
        outcome: ReplyOutcome::Refused(RdmaError::RegionNotFound),
    };
    assert_eq!(
        consumer.handle_reply(OTHER, &refusal, 0),
        ReplyVerdict::Drop(DropReason::WrongEndpoint)
    );
    assert_eq!(consumer.poll_completion(), None);
    assert_eq!(
        consumer.handle_reply(OWNER, &served(read.0, 8), 8),
        ReplyVerdict::Write(read)
    );
}

#[test]
fn a_second_reply_to_the_same_read_is_dropped() {
    let (mut consumer, read, _) = started(8);
    assert_eq!(
        consumer.handle_reply(OWNER, &served(read.0, 8), 8),
        ReplyVerdict::Write(read)
    );
    assert_eq!(
        consumer.handle_reply(OWNER, &served(read.0, 8), 8),
        ReplyVerdict::Drop(DropReason::NotAwaited)
    );
}

#[test]
fn a_reply_of_the_wrong_length_is_refused_unwritten() {
    for (header, payload) in [(9, 9), (8, 9), (9, 8), (4, 4), (8, 4)] {
        let (mut consumer, read, _) = started(8);
        assert_eq!(
            consumer.handle_reply(OWNER, &served(read.0, header), payload),
            ReplyVerdict::Refused(read)
        );
        let (completed, outcome) = consumer.poll_completion().map(pair).unwrap();
        assert_eq!(completed, read);
        assert!(matches!(outcome, Err(RdmaError::Backend(text)) if text.contains("8-byte read")));
    }
}

#[test]
fn a_refusal_completes_with_its_error() {
    let (mut consumer, read, _) = started(8);
    let refusal = Reply {
        request_id: read.0,
        outcome: ReplyOutcome::Refused(RdmaError::RegionNotFound),
    };
    assert_eq!(
        consumer.handle_reply(OWNER, &refusal, 0),
        ReplyVerdict::Refused(read)
    );
    assert_eq!(
        consumer.poll_completion().map(pair),
        Some((read, Err(RdmaError::RegionNotFound)))
    );
}

#[test]
fn a_read_awaiting_its_reply_times_out_at_its_deadline() {
    let (mut consumer, read, now) = started(8);
    assert!(
        consumer
            .handle_timeout(now + Duration::from_millis(9))
            .is_empty()
    );
    assert_eq!(consumer.poll_completion().map(pair), None);
    assert_eq!(
        consumer.poll_timeout(),
        Some(now + Duration::from_millis(10))
    );
    assert!(
        consumer
            .handle_timeout(now + Duration::from_millis(10))
            .is_empty()
    );
    assert_eq!(
        consumer.poll_completion().map(pair),
        Some((read, Err(RdmaError::Timeout)))
    );
    assert_eq!(
        consumer.handle_reply(OWNER, &served(read.0, 8), 8),
        ReplyVerdict::Drop(DropReason::NotAwaited),
        "a late reply finds nothing to write into"
    );
    assert_eq!(consumer.poll_timeout(), None);
}

#[test]
fn a_held_read_past_its_deadline_waits_for_release() {
    let (mut consumer, read, now) = started(8);
    consumer.handle_reply(OWNER, &served(read.0, 8), 8);
    let actions = consumer.handle_timeout(now + Duration::from_secs(1));
    assert_eq!(
        actions,
        vec![TimeoutAction::StopTransfer {
            read,
            endpoint: OWNER
        }]
    );
    assert_eq!(
        consumer.poll_completion().map(pair),
        None,
        "the transport may still write"
    );
    assert_eq!(consumer.held_on(OWNER), 1);
    consumer.released(read, Err(RdmaError::backend("closed")));
    assert_eq!(
        consumer.poll_completion().map(pair),
        Some((read, Err(RdmaError::Timeout)))
    );
}

#[test]
fn bytes_that_arrive_after_the_deadline_still_complete_ok() {
    let (mut consumer, read, now) = started(8);
    consumer.handle_reply(OWNER, &served(read.0, 8), 8);
    consumer.handle_timeout(now + Duration::from_secs(1));
    consumer.released(read, Ok(()));
    assert_eq!(consumer.poll_completion().map(pair), Some((read, Ok(()))));
}

#[test]
fn a_failed_endpoint_completes_only_reads_awaiting_replies() {
    let now = Instant::now();
    let mut consumer = Consumer::new();
    let waiting = consumer.start(OWNER, 8, now + Duration::from_secs(1), ());
    let held = consumer.start(OWNER, 8, now + Duration::from_secs(1), ());
    let elsewhere = consumer.start(OTHER, 8, now + Duration::from_secs(1), ());
    consumer.handle_reply(OWNER, &served(held.0, 8), 8);
    let failure = RdmaError::backend("endpoint failed");
    assert_eq!(consumer.endpoint_failed(OWNER, failure.clone()), [held]);
    assert_eq!(
        consumer.poll_completion().map(pair),
        Some((waiting, Err(failure.clone())))
    );
    assert_eq!(consumer.poll_completion().map(pair), None);
    consumer.released(held, Err(failure.clone()));
    assert_eq!(
        consumer.poll_completion().map(pair),
        Some((held, Err(failure)))
    );
    assert_eq!(consumer.in_flight(), 1, "{elsewhere:?} still waits");
}

#[test]
fn shutdown_completes_waiting_reads_and_refuses_new_ones() {
    let now = Instant::now();
    let mut consumer = Consumer::new();
    let waiting = consumer.start(OWNER, 8, now + Duration::from_secs(1), ());
    let held = consumer.start(OWNER, 8, now + Duration::from_secs(1), ());
    consumer.handle_reply(OWNER, &served(held.0, 8), 8);
    consumer.shutdown();
    assert_eq!(
        consumer.poll_completion().map(pair),
        Some((waiting, Err(RdmaError::ShuttingDown)))
    );
    let refused = consumer.start(OWNER, 8, now + Duration::from_secs(1), ());
    assert_eq!(
        consumer.poll_completion().map(pair),
        Some((refused, Err(RdmaError::ShuttingDown)))
    );
    consumer.released(held, Err(RdmaError::backend("worker destroyed")));
    assert_eq!(
        consumer.poll_completion().map(pair),
        Some((held, Err(RdmaError::ShuttingDown)))
    );
}

#[test]
fn a_failed_request_send_completes_a_waiting_read() {
    let (mut consumer, read, _) = started(8);
    assert!(!consumer.request_failed(read, RdmaError::backend("send failed")));
    assert_eq!(
        consumer.poll_completion().map(pair),
        Some((read, Err(RdmaError::backend("send failed"))))
    );
    assert!(!consumer.request_failed(read, RdmaError::Timeout));
    assert_eq!(consumer.poll_completion().map(pair), None, "completed once");
}

#[test]
fn request_ids_are_never_reused() {
    let now = Instant::now();
    let mut consumer = Consumer::<u32>::new();
    let ids: Vec<ReadId> = (0..100)
        .map(|_| consumer.start(OWNER, 1, now, ()))
        .collect();
    let mut sorted = ids.clone();
    sorted.dedup();
    assert_eq!(sorted.len(), ids.len());
}

#[test]
fn each_completion_carries_the_drivers_value() {
    let now = Instant::now();
    let mut consumer = Consumer::<u32, &str>::new();
    let read = consumer.start(OWNER, 8, now + Duration::from_secs(1), "slot 7");
    assert_eq!(consumer.payload(read), Some(&"slot 7"));
    consumer.handle_reply(OWNER, &served(read.0, 8), 8);
    consumer.released(read, Ok(()));
    let completion = consumer.poll_completion().unwrap();
    assert_eq!(
        (completion.read, completion.payload, completion.outcome),
        (read, "slot 7", Ok(()))
    );
    assert_eq!(consumer.payload(read), None);
}

/// A transport that receives straight into the destination holds it from
/// the start: no reply header is taken for such a read, and only the
/// receive's end completes it.
#[test]
fn a_posted_receive_completes_only_when_it_ends() {
    let now = Instant::now();
    let mut consumer = Consumer::<u32>::new();
    let read = consumer.start_receiving(OWNER, 8, now + Duration::from_millis(10), ());
    assert_eq!(
        consumer.handle_reply(OWNER, &served(read.0, 8), 8),
        ReplyVerdict::Drop(DropReason::NotAwaited)
    );
    assert_eq!(consumer.endpoint_failed(OWNER, RdmaError::Timeout), [read]);
    assert_eq!(consumer.poll_completion().map(pair), None);
    let actions = consumer.handle_timeout(now + Duration::from_millis(10));
    assert_eq!(
        actions,
        vec![TimeoutAction::StopTransfer {
            read,
            endpoint: OWNER
        }]
    );
    assert_eq!(consumer.poll_completion().map(pair), None);
    consumer.released(read, Err(RdmaError::backend("cancelled")));
    assert_eq!(
        consumer.poll_completion().map(pair),
        Some((read, Err(RdmaError::Timeout)))
    );
}

#[test]
fn an_unsent_request_ends_its_posted_receive_with_the_send_error() {
    let now = Instant::now();
    let mut consumer = Consumer::<u32>::new();
    let read = consumer.start_receiving(OWNER, 8, now + Duration::from_secs(1), ());
    let failure = RdmaError::backend("send failed");
    assert!(
        consumer.request_failed(read, failure.clone()),
        "cancel the receive"
    );
    assert_eq!(consumer.poll_completion().map(pair), None);
    consumer.released(read, Err(RdmaError::backend("cancelled")));
    assert_eq!(
        consumer.poll_completion().map(pair),
        Some((read, Err(failure)))
    );
}

#[test]
fn a_posted_receive_that_filled_completes_ok() {
    let now = Instant::now();
    let mut consumer = Consumer::<u32>::new();
    let read = consumer.start_receiving(OWNER, 8, now + Duration::from_secs(1), ());
    consumer.released(read, Ok(()));
    assert_eq!(consumer.poll_completion().map(pair), Some((read, Ok(()))));
}

/// A loop that never sleeps calls only `handle_timeout`: the deadlines of
/// reads completed long before theirs passes must still leave the queue, or
/// it grows with every read.
#[test]
fn completed_reads_leave_the_deadline_queue_without_a_park() {
    let now = Instant::now();
    let mut consumer = Consumer::<u32>::new();
    for _ in 0..10_000 {
        let read = consumer.start(OWNER, 8, now + Duration::from_secs(10), ());
        consumer.handle_reply(OWNER, &served(read.0, 8), 8);
        consumer.released(read, Ok(()));
        assert!(consumer.poll_completion().is_some());
        assert!(consumer.handle_timeout(now).is_empty());
    }
    assert!(
        consumer.queued_deadlines() <= 1,
        "{}",
        consumer.queued_deadlines()
    );
}
