//! Hostile and failing owners: replies longer than asked, replies that
//! never come, refusals and duplicates, owners that stall mid-reply or
//! die. The consumer must answer each read once, typed, land nothing after
//! the answer, and keep no memory behind.

use super::*;

/// Attack: a hostile owner answers each of 32 reads of 8 MiB with 8 MiB
/// and one byte more. The provider truncates each reply into the receive
/// and fails it; the read answers a typed error. The reply has arrived, so
/// nothing of it is left to take: the consumer must not keep a scratch
/// receive of 8 MiB per read for it until its teardown (256 MiB here; it
/// may grow by less than 128 MiB).
/// Spawns a read of the whole of `dst_region` (`len` bytes) from the raw
/// owner's fixed address under `key`, due within `deadline`.
fn spawn_whole_read(
    rt: &tokio::runtime::Runtime,
    backend: &crate::OfiBackend,
    key: &bytes::Bytes,
    dst_region: &BackendRegion,
    len: usize,
    deadline: Duration,
) -> tokio::task::JoinHandle<Result<(), RdmaError>> {
    let backend = backend.clone();
    let request = get(
        PeerId(1),
        key,
        0x10_0000,
        dst_region,
        0,
        len as u64,
        deadline,
    );
    // SAFETY: nothing touches the destination until the read is answered.
    rt.spawn(async move { unsafe { backend.get(request) }.await })
}

#[test]
fn overlong_replies_of_a_hostile_owner_leave_the_consumer_no_memory_behind() {
    // It measures the whole process's address space.
    rdmareg_backend::own_process::in_own_process(|| {
        let rt = runtime();
        let config = config(Provider::Tcp);
        let mut owner = RawPeer::open(&config);
        let consumer = OfiEngine::start(config).expect("consumer starts");
        consumer.add_peer(PeerId(1), owner.address()).unwrap();
        let c = consumer.backend();
        let len = 8usize << 20;
        let dst = Memory::filled(len, 0);
        let dst_region = dst.map(&rt, &c);
        let key = raw_owner_key(owner.address(), len as u64);
        let to_consumer = owner.insert(&consumer.fabric_address());
        let before = virtual_size();
        let mut answers = Vec::new();
        for _ in 0..32 {
            let read = spawn_whole_read(&rt, &c, &key, &dst_region, len, Duration::from_secs(10));
            let request = ReadRequest::decode(&owner.take_request()).expect("a single read");
            let sent = owner.send(to_consumer, request.request_id, vec![0xAB; len + 1]);
            assert!(
                matches!(owner.wait(sent), Some(Ended::Done { .. })),
                "overlong reply sent"
            );
            answers.push(rt.block_on(read).expect("the read task"));
        }
        drop(owner);
        let grown = virtual_size().saturating_sub(before);
        let unmapped = rt.block_on(c.unmap(dst_region.backend_region_id));
        consumer.shutdown_blocking();
        dst.free_after(unmapped.is_ok());
        eprintln!(
            "the consumer's process grew by {} MiB of address space",
            grown >> 20
        );
        for answer in &answers {
            assert!(
                matches!(answer, Err(RdmaError::Backend(_))),
                "answered {answer:?}"
            );
        }
        assert!(grown < 128 << 20, "grew by {} MiB", grown >> 20);
        assert_eq!(unmapped, Ok(()));
        assert_eq!(consumer.live_registrations(), 0);
    });
}

/// Attack: a hostile owner takes 32 requests for 8 MiB and never answers.
/// Each read answers `Timeout` at its 100 ms deadline, and the consumer
/// posts a scratch receive for the late reply (so an honest owner's lease
/// would end) — which never comes. What the consumer keeps for one owner's
/// late replies must be bounded: 256 MiB here, and it may grow by less
/// than 128 MiB.
#[test]
fn an_owner_that_never_answers_cannot_make_its_consumer_hoard_scratch_memory() {
    // It measures the whole process's address space.
    rdmareg_backend::own_process::in_own_process(|| {
        let rt = runtime();
        let config = config(Provider::Tcp);
        let mut owner = RawPeer::open(&config);
        let consumer = OfiEngine::start(config).expect("consumer starts");
        consumer.add_peer(PeerId(1), owner.address()).unwrap();
        let c = consumer.backend();
        let len = 8usize << 20;
        let dst = Memory::filled(len, 0);
        let dst_region = dst.map(&rt, &c);
        let key = raw_owner_key(owner.address(), len as u64);
        let before = virtual_size();
        let mut answers = Vec::new();
        for _ in 0..32 {
            let read =
                spawn_whole_read(&rt, &c, &key, &dst_region, len, Duration::from_millis(100));
            ReadRequest::decode(&owner.take_request()).expect("a single read");
            answers.push(rt.block_on(read).expect("the read task"));
        }
        let grown = virtual_size().saturating_sub(before);
        let unmapped = rt.block_on(c.unmap(dst_region.backend_region_id));
        drop(owner);
        consumer.shutdown_blocking();
        dst.free_after(unmapped.is_ok());
        eprintln!(
            "the consumer's process grew by {} MiB of address space",
            grown >> 20
        );
        for answer in &answers {
            assert_eq!(answer, &Err(RdmaError::Timeout));
        }
        assert!(grown < 128 << 20, "grew by {} MiB", grown >> 20);
        assert_eq!(unmapped, Ok(()));
        assert_eq!(consumer.live_registrations(), 0);
    });
}

/// Guard: a hostile owner's answers to single reads — short, a refusal
/// that carries bytes, a refusal of a reason nobody knows, none at all
/// until the deadline, and a reply sent twice — each get a typed answer;
/// after each answer the destination stays as its caller leaves it (filled,
/// then 200 ms while the owner sends the late or second reply); a message
/// tagged for a read never asked changes nothing.
fn a_hostile_owners_single_replies_get_typed_answers_and_never_land_after_them(provider: Provider) {
    use crate::protocol::{Refusal, refusal_tag};
    let mut setup = HostileOwnerSetup::new(provider.clone(), 64 << 10);
    let len = 64u64 << 10;
    let mut outcomes = Vec::new();
    let mut untouched = Vec::new();
    for case in 0..5 {
        let deadline = if case == 3 {
            Duration::from_millis(300)
        } else {
            Duration::from_secs(10)
        };
        let task = setup.start(&[len], deadline);
        let request = ReadRequest::decode(&setup.owner.take_request()).expect("a single read");
        let id = request.request_id;
        let to = setup.to_consumer;
        match case {
            0 => drop(setup.owner.send(to, id, vec![1; len as usize - 1])),
            1 => drop(
                setup
                    .owner
                    .send(to, refusal_tag(id, Refusal::OutOfRange), vec![2; 64]),
            ),
            2 => drop(setup.owner.send(
                to,
                crate::protocol::REFUSAL_BIT | (200 << 48) | id,
                vec![],
            )),
            3 => {}
            _ => drop(setup.owner.send(to, id, vec![4; len as usize])),
        }
        outcomes.push(setup.answers(task).remove(0));
        untouched.push(setup.untouched_after(|owner, to| {
            owner.send(to, id, vec![0xEE; len as usize]);
            owner.send(to, id ^ 0x5555, vec![0xEE; len as usize]);
        }));
    }
    // The consumer still reads.
    let task = setup.start(&[64], Duration::from_secs(10));
    let request = ReadRequest::decode(&setup.owner.take_request()).expect("a single read");
    setup
        .owner
        .send(setup.to_consumer, request.request_id, vec![6; 64]);
    let last = setup.answers(task).remove(0);
    let landed = setup.dst.snapshot()[..64].to_vec();
    setup.finish();
    assert!(
        matches!(&outcomes[0], Err(RdmaError::Backend(text)) if text.contains("bytes for a read of")),
        "{provider:?} short: {:?}",
        outcomes[0]
    );
    assert_eq!(
        outcomes[1],
        Err(RdmaError::OutOfRange),
        "{provider:?} refusal with bytes"
    );
    assert!(
        matches!(&outcomes[2], Err(RdmaError::Backend(text)) if text.contains("code 200")),
        "{provider:?}: {:?}",
        outcomes[2]
    );
    assert_eq!(
        outcomes[3],
        Err(RdmaError::Timeout),
        "{provider:?} no answer"
    );
    assert_eq!(outcomes[4], Ok(()), "{provider:?} a reply sent twice");
    assert_eq!(
        untouched,
        vec![true; 5],
        "{provider:?}: destination untouched after each answer"
    );
    assert_eq!(last, Ok(()));
    assert!(landed.iter().all(|&b| b == 6));
}

#[test]
fn a_hostile_owners_single_replies_get_typed_answers_and_never_land_after_them_over_tcp() {
    a_hostile_owners_single_replies_get_typed_answers_and_never_land_after_them(Provider::Tcp);
}

#[test]
fn a_hostile_owners_single_replies_get_typed_answers_and_never_land_after_them_over_shm() {
    a_hostile_owners_single_replies_get_typed_answers_and_never_land_after_them(Provider::Shm);
}

/// Over `tcp;ofi_rxm` a reply longer than the provider's eager size moves
/// by rendezvous, which only the sender's progress completes. An owner
/// (hostile, or merely wedged) that starts such a reply and then never
/// progresses held the consumer's read past its deadline: the matched
/// receive is not withdrawn by `fi_cancel`, and the probe finds the owner
/// reachable. libfabric 1.17 withdraws it only with its connection, which
/// `fi_av_remove` closes when the process runs with `FI_AV_REMOVE_CLEANUP`
/// set; the engine then resets a connection whose read is held 100 ms
/// past its deadline, and the read answers `Timeout` (deadline 1 s; the
/// answer within 2 s), and nothing lands once the owner moves again. The test runs in a child process of its own with
/// that variable set: libfabric reads it once, when it initialises.
#[test]
fn a_read_whose_owner_stalls_mid_reply_still_answers_at_its_deadline() {
    const NAME: &str = "adversarial_peers::hostile_owners::a_read_whose_owner_stalls_mid_reply_still_answers_at_its_deadline";
    if ran_in_child_with_connection_cleanup(NAME, false) {
        return;
    }
    let mut setup = HostileOwnerSetup::new(Provider::Tcp, 1 << 20);
    let started = Instant::now();
    let task = setup.start(&[1 << 20], Duration::from_secs(1));
    let request = ReadRequest::decode(&setup.owner.take_request()).expect("a single read");
    let to = setup.to_consumer;
    setup.owner.send(to, request.request_id, vec![7; 1 << 20]);
    // The owner now stalls: five seconds without progress.
    let until = Instant::now() + Duration::from_secs(5);
    while !task.is_finished() && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(10));
    }
    let answered_in = started.elapsed();
    let answered_in_time = task.is_finished();
    let answer = setup.answers(task).remove(0);
    // The owner moves again: nothing of its reply may land after the answer.
    let untouched = setup.untouched_after(|owner, _| {
        owner.progress_for(Duration::from_millis(300));
    });
    setup.finish();
    assert!(
        answered_in_time,
        "no answer 4 s past the deadline (later: {answer:?})"
    );
    assert_eq!(answer, Err(RdmaError::Timeout));
    assert!(untouched, "the reply landed after the answer");
    assert!(
        answered_in < Duration::from_secs(2),
        "answered after {answered_in:?}"
    );
}

/// Guard: a gathered list whose owner answers only after the list's
/// deadline answers `Timeout` for every entry, and the late reply lands
/// nowhere; a list in flight when the consumer's engine shuts
/// down answers `ShuttingDown` for every entry, and the destination is not
/// written after that; everything is unregistered. (Over `shm` the raw
/// owner is a second endpoint of this process, so the consumer's teardown
/// parks its endpoint with the list cancelled.)
fn a_late_or_abandoned_gathered_list_never_lands_after_its_answer(provider: Provider) {
    let mut setup = HostileOwnerSetup::new(provider.clone(), 4096);
    let lens = [64u64; 8];
    let task = setup.start(&lens, Duration::from_millis(300));
    let list = ListRequest::decode(&setup.owner.take_request()).expect("a list");
    let expired = setup.answers(task);
    let mut late = vec![0u8; 8];
    late.extend(std::iter::repeat_n(0xEE, 8 * 64));
    let untouched_after_timeout = setup.untouched_after(|owner, to| {
        owner.send(to, list.request_id, late);
    });
    assert_eq!(expired, vec![Err(RdmaError::Timeout); 8], "{provider:?}");
    assert!(
        untouched_after_timeout,
        "{provider:?}: a late list reply landed"
    );
    let task = setup.start(&lens, Duration::from_secs(10));
    let list = ListRequest::decode(&setup.owner.take_request()).expect("a list");
    setup.consumer.shutdown_blocking();
    let abandoned = setup.answers(task);
    let mut reply = vec![0u8; 8];
    reply.extend(std::iter::repeat_n(0xEE, 8 * 64));
    let untouched_after_shutdown = setup.untouched_after(|owner, to| {
        // The consumer's endpoint is gone: the provider may refuse it.
        owner.try_send(to, list.request_id, reply);
    });
    let live = setup.consumer.live_registrations();
    drop(setup.owner);
    // The engine's teardown ended the destination's registration.
    setup.dst.free_after(live == 0);
    assert_eq!(
        abandoned,
        vec![Err(RdmaError::ShuttingDown); 8],
        "{provider:?}"
    );
    assert!(
        untouched_after_shutdown,
        "{provider:?}: a reply landed after shutdown"
    );
    assert_eq!(live, 0);
}

#[test]
fn a_late_or_abandoned_gathered_list_never_lands_after_its_answer_over_tcp() {
    a_late_or_abandoned_gathered_list_never_lands_after_its_answer(Provider::Tcp);
}

#[test]
fn a_late_or_abandoned_gathered_list_never_lands_after_its_answer_over_shm() {
    a_late_or_abandoned_gathered_list_never_lands_after_its_answer(Provider::Shm);
}

/// Guard of the liveness probe over tcp (`unreachable_after` 1 s): an owner
/// that took a read's request and then stalls — its endpoint open, never
/// progressed — is not declared unreachable: the read answers `Timeout` at
/// its 2.5 s deadline. An owner whose endpoint is gone is: a read from it
/// answers the unreachable error within 5 s, not at its 20 s deadline.
#[test]
fn the_probe_spares_a_stalled_owner_and_finds_a_dead_one() {
    let mut setup = HostileOwnerSetup::new(Provider::Tcp, 64 << 10);
    let started = Instant::now();
    let task = setup.start(&[64 << 10], Duration::from_millis(2500));
    ReadRequest::decode(&setup.owner.take_request()).expect("a single read");
    while !task.is_finished() && started.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(10));
    }
    let stalled = setup.rt.block_on(task).expect("the read task");
    let stalled_after = started.elapsed();
    // The owner's endpoint goes away; a new read from it.
    let HostileOwnerSetup {
        rt,
        owner,
        consumer,
        dst,
        dst_region,
        key,
        ..
    } = setup;
    drop(owner);
    let started = Instant::now();
    let c = consumer.backend();
    let dead = single(
        &rt,
        &c,
        get(
            PeerId(1),
            &key,
            0x10_0000,
            &dst_region,
            0,
            64,
            Duration::from_secs(20),
        ),
    );
    let dead_after = started.elapsed();
    let unmapped = rt.block_on(c.unmap(dst_region.backend_region_id));
    consumer.shutdown_blocking();
    dst.free_after(unmapped.is_ok());
    eprintln!("stalled: {stalled:?} after {stalled_after:?}; dead: {dead:?} after {dead_after:?}");
    assert_eq!(stalled, vec![Err(RdmaError::Timeout)]);
    assert!(stalled_after >= Duration::from_millis(2500));
    // Dead: the probe declares it unreachable, unless the provider already
    // saw the connection gone when the request was sent (reset, or not
    // connected: a race with the endpoint's close) and the send failed at
    // once. A prompt typed failure either way.
    assert!(
        matches!(&dead, Err(RdmaError::Backend(text))
            if text.contains("unreachable") || text.contains("sending the read request failed")),
        "{dead:?}"
    );
    assert!(dead_after < Duration::from_secs(5), "{dead_after:?}");
    assert_eq!(unmapped, Ok(()));
    assert_eq!(consumer.live_registrations(), 0);
}

/// With `FI_AV_REMOVE_CLEANUP=1` a consumer resets the connection of an
/// owner whose rendezvous reply stalled past the read's deadline. Reads of
/// another owner running meanwhile (64 KiB, back to back) must all answer
/// `Ok` with that owner's bytes, and once the stalled read answered
/// `Timeout` the same owner, moving again, must be readable on the next
/// read: "the next read connects anew".
#[test]
fn after_a_stalled_connection_is_reset_the_same_owner_is_read_again_and_others_were_never_disturbed()
 {
    if ran_in_child_with_connection_cleanup(
        "adversarial_peers::hostile_owners::after_a_stalled_connection_is_reset_the_same_owner_is_read_again_and_others_were_never_disturbed",
        false,
    ) {
        return;
    }
    let mut setup = HostileOwnerSetup::new(Provider::Tcp, 1 << 20);
    assert!(setup.consumer.resets_stalled_connections());
    // A second, honest owner engine.
    let honest = OfiEngine::start(config(Provider::Tcp)).expect("owner starts");
    setup
        .consumer
        .add_peer(PeerId(2), honest.fabric_address())
        .unwrap();
    let src = Memory::filled(64 << 10, 0x33);
    let src_region = src.map(&setup.rt, &honest.backend());
    let side = Memory::filled(64 << 10, 0);
    let side_region = side.map(&setup.rt, &setup.consumer.backend());
    let task = setup.start(&[1 << 20], Duration::from_secs(1));
    let request = ReadRequest::decode(&setup.owner.take_request()).expect("a single read");
    let to = setup.to_consumer;
    setup.owner.send(to, request.request_id, vec![7; 1 << 20]);
    // The stalled owner does not progress; the honest owner is read back
    // to back until the stalled read answered (or 5 s).
    let c = setup.consumer.backend();
    let mut honest_answers = Vec::new();
    let until = Instant::now() + Duration::from_secs(5);
    while !task.is_finished() && Instant::now() < until {
        honest_answers.push(single(
            &setup.rt,
            &c,
            get(
                PeerId(2),
                &src_region.packed_key,
                src.addr() as u64,
                &side_region,
                0,
                64 << 10,
                Duration::from_secs(10),
            ),
        ));
    }
    let stalled = setup.answers(task).remove(0);
    let honest_bytes_right = side.snapshot().iter().all(|&b| b == 0x33);
    // The raw owner moves again and serves a new read of its own.
    setup.owner.progress_for(Duration::from_millis(300));
    let again = setup.start(&[64], Duration::from_secs(5));
    // Liveness probes sent while it stalled come first; then the request.
    let served = Requests::default()
        .next(&mut setup.owner, Duration::from_secs(5))
        .and_then(|bytes| ReadRequest::decode(&bytes));
    if let Some(request) = &served {
        setup.owner.send(to, request.request_id, vec![8; 64]);
    }
    let answer_again = setup.answers(again).remove(0);
    let landed_again = setup.dst.snapshot()[..64].to_vec();
    let unmapped_side = setup.rt.block_on(c.unmap(side_region.backend_region_id));
    let unmapped_src = setup
        .rt
        .block_on(honest.backend().unmap(src_region.backend_region_id));
    honest.shutdown_blocking();
    side.free_after(unmapped_side.is_ok());
    src.free_after(unmapped_src.is_ok());
    setup.finish();
    eprintln!(
        "stalled: {stalled:?}; honest reads meanwhile: {}; request after reset reached the \
         owner: {}; answer: {answer_again:?}",
        honest_answers.len(),
        served.is_some()
    );
    assert_eq!(stalled, Err(RdmaError::Timeout));
    assert!(
        honest_answers.iter().all(Result::is_ok),
        "another owner's reads failed during the reset: {:?}",
        honest_answers
            .iter()
            .filter(|a| a.is_err())
            .collect::<Vec<_>>()
    );
    assert!(honest_bytes_right);
    assert!(
        served.is_some(),
        "the read after the reset never reached the owner"
    );
    assert_eq!(answer_again, Ok(()), "the same owner read after the reset");
    assert!(landed_again.iter().all(|&b| b == 8));
    assert_eq!(unmapped_side, Ok(()));
    assert_eq!(unmapped_src, Ok(()));
}

/// The request-tagged messages a raw owner takes, one receive kept
/// posted at a time (a receive left posted takes the next message).
#[derive(Default)]
struct Requests {
    posted: Option<(usize, usize)>,
}

impl Requests {
    /// The next request (not a liveness probe) the owner takes within
    /// `span`.
    fn next(&mut self, owner: &mut RawPeer, span: Duration) -> Option<Vec<u8>> {
        let until = Instant::now() + span;
        loop {
            let (context, index) = *self.posted.get_or_insert_with(|| {
                owner.receive(
                    crate::fabric::ADDR_UNSPEC,
                    crate::protocol::REQUEST_TAG,
                    0,
                    crate::protocol::RECEIVE_MAX,
                )
            });
            owner.poll();
            match owner.ended.get(&context) {
                Some(Ended::Done { len, .. }) => {
                    self.posted = None;
                    let bytes = owner.buffers[index][..*len].to_vec();
                    if bytes != PROBE {
                        return Some(bytes);
                    }
                }
                Some(Ended::Failed(_)) => self.posted = None,
                None if Instant::now() >= until => return None,
                None => std::thread::sleep(Duration::from_micros(200)),
            }
        }
    }
}

/// Over tcp an owner answers "ask again" (`Unverified`) when its provider
/// cannot name a request's sender, and the consumer asks again with the
/// same id, at most [`ASKS_AGAIN`](crate::progress::ASKS_AGAIN) times. A
/// hostile owner abuses that: (a) it answers `Unverified` to every ask —
/// the read must answer the typed `Backend` error after exactly that many
/// requests and one, not loop; (b) it answers `Unverified`, then
/// nothing until the read's deadline, then the bytes for that id — the read
/// answers `Timeout` and nothing lands after it; (c) it answers
/// `Unverified` only after the deadline — the read answers `Timeout` and
/// the consumer does not ask again for a read it already answered.
#[test]
fn an_owner_that_keeps_answering_ask_again_gets_a_typed_answer_and_no_endless_asking() {
    use crate::protocol::{Refusal, UNVERIFIED_TEXT, refusal_tag};
    let mut setup = HostileOwnerSetup::new(Provider::Tcp, 64 << 10);
    let len = 64u64 << 10;
    let to = setup.to_consumer;
    let unverified = |id| refusal_tag(id, Refusal::Unverified);
    let mut requests = Requests::default();
    let mut next = |owner: &mut RawPeer, span| {
        requests
            .next(owner, span)
            .and_then(|bytes| ReadRequest::decode(&bytes))
    };
    // (a) ask again, forever.
    let task = setup.start(&[len], Duration::from_secs(10));
    let first = next(&mut setup.owner, Duration::from_secs(5)).expect("a single read");
    setup.owner.send(to, unverified(first.request_id), vec![]);
    let mut asked_again = Vec::new();
    for _ in 0..crate::progress::ASKS_AGAIN {
        let again = next(&mut setup.owner, Duration::from_secs(5)).expect("asked again");
        setup.owner.send(to, unverified(again.request_id), vec![]);
        asked_again.push(again.request_id);
    }
    let forever = setup.answers(task).remove(0);
    let one_more = next(&mut setup.owner, Duration::from_millis(300));
    // (b) ask again, then silence past the deadline, then the bytes. The
    // deadline outlasts the hops before the consumer asks again on a busy
    // host (a read past its deadline is not asked again).
    let task = setup.start(&[len], Duration::from_secs(3));
    let asked = next(&mut setup.owner, Duration::from_secs(5)).expect("a single read");
    setup.owner.send(to, unverified(asked.request_id), vec![]);
    let again = next(&mut setup.owner, Duration::from_secs(5)).expect("asked again");
    let silent = setup.answers(task).remove(0);
    let untouched_b = setup.untouched_after(|owner, to| {
        owner.send(to, again.request_id, vec![0xEE; len as usize]);
    });
    // (c) ask again only after the deadline.
    let task = setup.start(&[len], Duration::from_millis(300));
    let late = next(&mut setup.owner, Duration::from_secs(5)).expect("a single read");
    let expired = setup.answers(task).remove(0);
    setup.owner.send(to, unverified(late.request_id), vec![]);
    let asked_after_answer = next(&mut setup.owner, Duration::from_millis(300));
    let untouched_c = setup.untouched_after(|owner, _| {
        owner.progress_for(Duration::from_millis(100));
    });
    setup.finish();
    assert_eq!(forever, Err(RdmaError::backend(UNVERIFIED_TEXT)));
    assert!(
        asked_again.iter().all(|&id| id == first.request_id),
        "asked again, same id"
    );
    assert_eq!(one_more, None, "a request after the last ask again");
    assert_eq!(asked.request_id, again.request_id);
    assert_eq!(silent, Err(RdmaError::Timeout));
    assert!(untouched_b, "a reply landed after the Timeout");
    assert_eq!(expired, Err(RdmaError::Timeout));
    assert!(untouched_c);
    assert_eq!(
        asked_after_answer, None,
        "asked again for a read already answered"
    );
}
