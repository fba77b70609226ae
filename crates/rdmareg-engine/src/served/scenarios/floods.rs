//! The owner's per-endpoint bounds under floods: a consumer that asks and
//! never takes, floods of requests from one peer and from many reply
//! addresses, lists counted with single reads, and an honest deep batch
//! that must never meet the bound.

use rdmareg_core::RdmaError;

use super::super::owner::{Action, EndpointLoad, SendId};
use super::*;

/// A raw consumer, as the owner names it.
const RAW: u32 = 20;

/// The sends of the owner's actions in `elsewhere` (to raw consumers).
fn sends(actions: &[Action<u32>]) -> Vec<SendId> {
    actions
        .iter()
        .filter_map(|action| match action {
            Action::Serve { send, .. }
            | Action::Refuse { send, .. }
            | Action::ServeList { send, .. } => Some(*send),
            _ => None,
        })
        .collect()
}

/// A consumer that asks for 100 reads and never takes a reply holds
/// exactly the owner's bound of served replies (4 here) and as many
/// refusals; the rest are dropped. When its endpoint dies and the
/// transport fails its sends, every count and lease is released and the
/// endpoint forgotten.
#[test]
fn a_consumer_holds_at_most_its_bound_of_replies() {
    let mut pair = Pair::with_bound(4);
    for id in 0..100 {
        pair.raw_request(RAW, &wire::encode_request(&read_of(id, 0, 4096)));
    }
    pair.deliver_requests();
    let served = pair
        .elsewhere
        .iter()
        .filter(|a| matches!(a, Action::Serve { .. }))
        .count();
    assert_eq!(served, 4);
    assert_eq!(
        pair.owner.load(RAW),
        EndpointLoad {
            served: 4,
            refusals: 4
        }
    );
    assert_eq!(pair.owner.dropped_requests(), 92);
    assert_eq!(pair.owner.region_leases(REGION), Some(4));
    pair.owner.endpoint_failed(RAW);
    for send in sends(&pair.elsewhere) {
        assert!(pair.owner.send_failed(send));
    }
    assert_eq!(pair.owner.load(RAW), EndpointLoad::default());
    assert_eq!(pair.owner.endpoints(), 0);
    assert_eq!(pair.owner.leases_in_flight(), 0);
}

/// Under a bound of one unfinished reply, a consumer's reads meet one
/// served reply still landing: each further read is answered busy at once
/// (transient, without waiting for its deadline), and the same reads
/// asked again once the first landed are served.
#[test]
fn reads_past_the_bound_answer_busy_and_pass_retried() {
    let mut pair = Pair::with_bound(1);
    let mut reads = vec![pair.read(0, 4096, DEADLINE)];
    pair.deliver_requests();
    assert_eq!(
        pair.deliver_next_held(),
        [super::super::consumer::ReplyVerdict::Write(reads[0])]
    );
    for i in 1..4 {
        let read = pair.read(i * 4096, 4096, DEADLINE);
        pair.settle();
        let answer = pair.answer(read).expect("answered at once");
        assert!(answer.is_err_and(|e| e.is_transient() && e != RdmaError::Timeout));
        assert!(pair.untouched(read));
        reads.push(read);
    }
    pair.finish_landing(reads[0], true);
    assert_eq!(pair.answer(reads[0]), Some(Ok(())));
    for i in 1..4 {
        let again = pair.read(i * 4096, 4096, DEADLINE);
        pair.settle();
        assert_eq!(pair.answer(again), Some(Ok(())));
        assert_eq!(pair.dest(again), pair.source(i * 4096, 4096));
    }
    assert_eq!(
        pair.owner.endpoints(),
        0,
        "the bound counts what is unfinished"
    );
    pair.assert_clean_end();
}

/// The deepest batch an honest consumer of this workspace posts — 1024
/// single reads all asked before any reply is taken, then 1000 reads of
/// 4 KiB gathered 64 to a list — is never refused under the default
/// bound, and leaves nothing counted at the owner.
#[test]
fn an_honest_deep_batch_is_never_refused() {
    let mut pair = Pair::new();
    let singles: Vec<_> = (0..1024)
        .map(|i| pair.read((i % 16) * 4096, 4096, DEADLINE))
        .collect();
    pair.deliver_requests();
    let mut gathered = Vec::new();
    for chunk in (0..1000u64).collect::<Vec<_>>().chunks(64) {
        let entries: Vec<(u64, u64)> = chunk.iter().map(|i| ((i % 16) * 4096, 4096)).collect();
        gathered.extend(pair.read_list(&entries, DEADLINE));
    }
    pair.deliver_requests();
    assert_eq!(pair.owner.load(CONSUMER).refusals, 0);
    assert_eq!(pair.owner.leases_in_flight(), 2024);
    pair.settle();
    for read in singles.iter().chain(&gathered) {
        assert_eq!(pair.answer(*read), Some(Ok(())), "{read:?}");
    }
    assert_eq!(pair.owner.refused_requests(), 0);
    assert_eq!(pair.owner.endpoints(), 0);
    assert_eq!(pair.owner.leases_in_flight(), 0);
    pair.assert_clean_end();
}

/// A consumer holding its bound of large replies open gets every entry of
/// a gathered list refused busy: a list is no way around the bound, and
/// nothing more is leased.
#[test]
fn list_entries_count_against_the_bound() {
    let mut pair = Pair::with_bound(4);
    for id in 0..4 {
        pair.raw_request(RAW, &wire::encode_request(&read_of(id, 0, LEN)));
    }
    let entries: Vec<Read> = (10..18).map(|id| read_of(id, 0, 4096)).collect();
    pair.raw_list(RAW, &wire::encode_list_request(&entries).unwrap());
    pair.deliver_requests();
    let Some(Action::ServeList {
        entry_replies: answers,
        ..
    }) = pair.elsewhere.last()
    else {
        panic!("a list reply");
    };
    assert_eq!(answers.len(), 8);
    assert!(answers.iter().all(|a| a.outcome == Err(Refusal::Busy)));
    assert_eq!(pair.owner.region_leases(REGION), Some(4));
}

/// One peer floods the owner with 10,000 requests for a region that does
/// not exist and never takes the refusals: the owner holds at most its
/// bound of them and drops the rest, and a consumer reading meanwhile is
/// served every read.
#[test]
fn a_flood_from_one_peer_does_not_starve_another() {
    let mut pair = Pair::new();
    let bound = u64::from(OwnerConfig::default().max_replies_per_endpoint);
    let mut reads = Vec::new();
    for round in 0..20u64 {
        for id in 0..500 {
            let bogus = Read {
                region: 404,
                ..read_of(round * 500 + id, 0, 8)
            };
            pair.raw_request(RAW, &wire::encode_request(&bogus));
        }
        reads.push(pair.read(round * 64, 64, DEADLINE));
        pair.settle();
    }
    for (round, read) in reads.into_iter().enumerate() {
        assert_eq!(pair.answer(read), Some(Ok(())));
        assert_eq!(pair.dest(read), pair.source(round as u64 * 64, 64));
    }
    assert_eq!(u64::from(pair.owner.load(RAW).refusals), bound);
    assert_eq!(pair.owner.dropped_requests(), 10_000 - bound);
    assert_eq!(pair.owner.leases_in_flight(), 0);
    pair.assert_clean_end();
}

/// Requests naming 4096 made-up reply addresses (nobody takes a reply
/// there) are each refused to their address; a consumer reading meanwhile
/// is served; once the transport ended those sends (the peers declared
/// unreachable), the owner remembers none of the addresses.
#[test]
fn made_up_reply_addresses_are_forgotten_once_ended() {
    let mut pair = Pair::new();
    for address in 1000..1000 + 4096 {
        let bogus = Read {
            region: 404,
            ..read_of(1, 0, 8)
        };
        pair.raw_request(address, &wire::encode_request(&bogus));
    }
    let read = pair.read(0, 64, DEADLINE);
    pair.settle();
    assert_eq!(pair.answer(read), Some(Ok(())));
    assert_eq!(pair.owner.endpoints(), 4096);
    for send in sends(&pair.elsewhere) {
        pair.owner.send_failed(send);
    }
    assert_eq!(pair.owner.endpoints(), 0);
    let later = pair.read(64, 64, DEADLINE);
    pair.settle();
    assert_eq!(pair.answer(later), Some(Ok(())));
    pair.assert_clean_end();
}

/// Sixteen other reply addresses each hold their bound of gathered
/// replies open: a consumer that takes its replies is still served its
/// list, each entry its own bytes. The bound is per endpoint, not shared.
#[test]
fn others_at_their_bound_do_not_make_a_consumer_busy() {
    let mut pair = Pair::with_bound(64);
    for address in 100..116 {
        let entries: Vec<Read> = (0..64).map(|id| read_of(id, 0, 4096)).collect();
        pair.raw_list(address, &wire::encode_list_request(&entries).unwrap());
    }
    pair.deliver_requests();
    assert_eq!(pair.owner.leases_in_flight(), 16 * 64);
    let entries: Vec<(u64, u64)> = (0..16).map(|i| (i * 4096, 4096)).collect();
    let reads = pair.read_list(&entries, DEADLINE);
    pair.settle();
    for (i, read) in reads.into_iter().enumerate() {
        assert_eq!(pair.answer(read), Some(Ok(())));
        assert_eq!(pair.dest(read), pair.source(i as u64 * 4096, 4096));
    }
    pair.assert_clean_end();
}

/// A read cut in four pieces meets an owner bound of two unfinished
/// replies: two pieces are served, two refused busy at once with a
/// transient error, and the served replies the owner might send for the
/// refused pieces afterwards land nothing.
#[test]
fn busy_pieces_answer_transient_and_land_nothing_later() {
    let mut pair = Pair::with_bound(2);
    let pieces: Vec<_> = (0..4)
        .map(|i| pair.read(i * 16 * 1024, 16 * 1024, DEADLINE))
        .collect();
    pair.deliver_requests();
    for &piece in &pieces[..2] {
        assert_eq!(
            pair.deliver_next_held(),
            [super::super::consumer::ReplyVerdict::Write(piece)]
        );
    }
    pair.deliver_replies();
    for &piece in &pieces[2..] {
        let answer = pair.answer(piece).expect("answered at once");
        assert!(answer.is_err_and(|e| e.is_transient() && e != RdmaError::Timeout));
    }
    for &piece in &pieces[..2] {
        pair.finish_landing(piece, true);
    }
    for (i, &piece) in pieces.iter().enumerate().skip(2) {
        let bytes = pair.source(i as u64 * 16 * 1024, 16 * 1024);
        pair.inject(OWNER, header(piece.0, Ok(16 * 1024)), bytes);
    }
    pair.deliver_replies();
    assert!(pair.untouched(pieces[2]) && pair.untouched(pieces[3]));
    pair.assert_clean_end();
}
