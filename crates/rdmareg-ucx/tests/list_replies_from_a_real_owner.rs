//! Lists answered in several replies, by an owner engine under churn.
//!
//! Over tcp a consumer asks a whole list (up to 64 reads, 256 KiB) in one
//! request and the owner answers it in replies of at most one fragment's
//! payload each; the consumer lands each entry by its request id, whichever
//! reply brings it. Each entry keeps its own lease, hold, deadline and
//! answer. These tests attack the seams between the replies of one list
//! of a real owner: deadlines passing between the replies; the owner
//! unmapping its source while the replies go out; either side going away
//! mid-list (a raw consumer closed or killed, an engine shut down, an
//! owner process killed); and lists of tiny, odd-sized, zero-length, stale
//! and over-the-bound entries, also where an operator shapes UCX's
//! protocols. (`list_replies_from_a_hostile_owner.rs` attacks the same
//! seams from the owner's side.)
//!
//! What every test holds the engines to: an entry is answered once, `Ok`
//! only with exactly its own bytes; an entry answered with an error holds
//! none of its bytes (an eager entry lands whole inside the reply handler
//! or not at all) and no byte of it changes afterwards; no byte lands
//! outside an entry's range; the owner's unmap waits for its leases; the
//! owner survives and serves on.
//!
//! The two tests with a child process start this test binary again,
//! filtered to themselves, with [`CHILD_ROLE`] naming them: the child
//! plays the role instead of the test.

mod common;

use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::list_scene::*;
use common::raw_am::Raw;
use common::scene::*;
use common::*;
use rdmareg_backend::RdmaBackend;
use rdmareg_core::{BackendGet, BackendRegion, Descriptor, RdmaError};
use rdmareg_ucx::read_list::{
    ListReply, ListRequest, MAX_LIST_ENTRIES, READ_LIST_REPLY_AM_ID, READ_LIST_REQUEST_AM_ID,
};
use rdmareg_ucx::read_protocol::{BUSY_TEXT, ReadRequest, RemoteRefusal, ReplyStatus, ServedKey};
use rdmareg_ucx::{Transport, UcxBackend, UcxConfig, UcxEngine};
use ucx_sys as sys;

/// The largest payload of one reply over tcp (one fragment).
const PIECE: usize = 60 * KIB;

/// Where entry `i` of a list reads in the source: odd offsets, spread out.
fn src_offset(i: usize) -> usize {
    7 + (i * 12_289) % (SOURCE_LEN - 32 * KIB)
}

/// What entry `i` of length `len` reads from a source whose bytes are
/// `want`.
fn wanted(want: &[u8], i: usize, len: usize) -> Vec<u8> {
    want[src_offset(i)..src_offset(i) + len].to_vec()
}

/// The requests of the list of `slots` from `source`, entry `i` at
/// [`src_offset`]`(i)`, due in `deadline(i)`.
fn requests_from(
    slots: &Slots,
    source: &Descriptor,
    deadline: impl Fn(usize) -> Option<Duration>,
) -> Vec<BackendGet> {
    (0..slots.lens.len())
        .map(|i| {
            slots.request(
                i,
                OWNER,
                source.addr() + src_offset(i) as u64,
                source.packed_key(),
                deadline(i),
            )
        })
        .collect()
}

/// The `n`th of the two maximal lists, by turns: 64 × 4 KiB, 16 × 16 KiB.
fn maximal_list(n: usize) -> Vec<usize> {
    if n % 2 == 0 {
        scatter_lens()
    } else {
        vec![16 * KIB; 16]
    }
}

/// Posts `requests` as one batch, and returns the answers with the
/// destination as it was when they came (taken before anything else
/// touches it).
async fn batch_with_snapshot(
    cb: &Arc<UcxBackend>,
    slots: &Slots,
    requests: Vec<BackendGet>,
) -> (Answers, Vec<u8>) {
    let answers = cb.get_batch_into_test_memory(requests).await;
    (answers, slots.buf.snapshot())
}

/// Waits [`WATCH`], then checks that no entry scribbled over after its
/// error answer changed since.
async fn assert_quiet(scribbled: &[(Slots, Vec<usize>)], what: &str) {
    tokio::time::sleep(WATCH).await;
    for (slots, failed) in scribbled {
        slots.assert_unchanged_since_scribbled(failed, what);
    }
}

// ---------------------------------------------------------------------------
// A consumer engine against an owner engine.
// ---------------------------------------------------------------------------

/// Batches of lists — 64 × 4 KiB, 16 × 16 KiB, and runs of many such
/// lists — whose entries' deadlines (1 µs to 2 ms, the same for a whole
/// batch or later down it) pass while the owner's fragment replies stream
/// in, so that one list ends partly `Ok` and partly `Timeout`. Every entry
/// answers `Ok` with exactly its bytes or `Timeout` with none of them, and
/// no byte of a timed-out entry changes after the answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deadlines_passing_between_the_replies_of_a_list_let_nothing_land_after_their_answer() {
    let scene = Scene::new(engines(Transport::Tcp)).await;
    // Connected first, so that no deadline runs out during the wire-up.
    let warm = Slots::new(&scene.cb, &[8]).await;
    let requests = requests_from(&warm, &scene.source, |_| None);
    let (answers, _) = batch_with_snapshot(&scene.cb, &warm, requests).await;
    assert_eq!(answers, vec![Ok(())]);
    let deadlines_us = [1u64, 5, 10, 20, 35, 50, 75, 100, 150, 200, 400, 800, 2000];
    let (mut ok, mut timeouts, mut split_lists) = (0usize, 0usize, 0usize);
    let mut scribbled = Vec::new();
    for round in 0..2 * deadlines_us.len() {
        let us = deadlines_us[round % deadlines_us.len()];
        let (lens, per_list) = match round % 4 {
            0 => (scatter_lens(), MAX_LIST_ENTRIES),
            1 => (vec![16 * KIB; 16], 16),
            2 => (vec![4 * KIB; 8 * MAX_LIST_ENTRIES], MAX_LIST_ENTRIES),
            _ => (vec![16 * KIB; 8 * 16], 16),
        };
        let slots = Slots::new(&scene.cb, &lens).await;
        // Half the rounds: each entry due a little later than the one
        // before it, so that deadlines fall between replies.
        let step = if round % 3 == 0 {
            0
        } else {
            1 + round as u64 % 4
        };
        let requests = requests_from(&slots, &scene.source, |i| {
            Some(Duration::from_micros(us + step * i as u64))
        });
        let (answers, snapshot) = batch_with_snapshot(&scene.cb, &slots, requests).await;
        let what = format!("round {round}, {us} µs + {step} µs per entry");
        let want = |i| wanted(&scene.want, i, lens[i]);
        let landed = slots.judge(&snapshot, &answers, want, &what);
        for answer in answers.iter().filter(|a| a.is_err()) {
            assert_eq!(answer, &Err(RdmaError::Timeout), "{what}");
        }
        ok += landed;
        timeouts += answers.len() - landed;
        for list in answers.chunks(per_list) {
            let landed = list.iter().filter(|a| a.is_ok()).count();
            if landed > 0 && landed < list.len() {
                split_lists += 1;
            }
        }
        let failed = slots.scribble_failed(&answers);
        scribbled.push((slots, failed));
    }
    tracing::info!(ok, timeouts, split_lists, "deadline rounds");
    assert!(timeouts > 0, "no deadline passed ({ok} Ok)");
    assert_quiet(&scribbled, "deadlines").await;
    for (slots, _) in &scribbled {
        assert_eq!(scene.cb.unmap(slots.region).await, Ok(()));
    }
    // The consumer still reads whole lists afterwards.
    let slots = Slots::new(&scene.cb, &scatter_lens()).await;
    let requests = requests_from(&slots, &scene.source, |_| None);
    let (answers, snapshot) = batch_with_snapshot(&scene.cb, &slots, requests).await;
    assert_eq!(
        slots.judge(
            &snapshot,
            &answers,
            |i| wanted(&scene.want, i, 4 * KIB),
            "after"
        ),
        MAX_LIST_ENTRIES
    );
    assert_eq!(scene.cb.unmap(slots.region).await, Ok(()));
    scene.end("deadlines").await;
}

/// The owner unmaps its source while consumers stream long lists from it
/// (each answered in several replies), and zeroes the source the moment the
/// unmap confirms: the unmap confirms only with no reply in flight, an `Ok`
/// entry holds exactly the source's bytes (never the zeros), a refused one
/// holds nothing, and no list posted after the confirmation is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_owners_unmap_while_a_lists_replies_go_out_confirms_only_after_they_finished() {
    let until = Instant::now() + Duration::from_millis(2500);
    let (mut served_total, mut refused_total) = (0usize, 0usize);
    for (round, delay_us) in [0u64, 100, 300, 700, 1500, 3000].iter().cycle().enumerate() {
        let scene = Scene::new(engines(Transport::Tcp)).await;
        let want = Arc::new(scene.want.clone());
        let unmapped = Arc::new(AtomicBool::new(false));
        let mut readers = Vec::new();
        for reader in 0..3usize {
            let lens = maximal_list(reader);
            let slots = Slots::new(&scene.cb, &lens).await;
            let requests = requests_from(&slots, &scene.source, |_| Some(Duration::from_secs(5)));
            let (cb, unmapped, want) = (scene.cb.clone(), Arc::clone(&unmapped), Arc::clone(&want));
            readers.push(tokio::spawn(async move {
                let (mut served, mut refused) = (0usize, 0usize);
                loop {
                    let last = unmapped.load(Ordering::Acquire);
                    slots.buf.fill(0);
                    let (answers, snapshot) =
                        batch_with_snapshot(&cb, &slots, requests.clone()).await;
                    let what = format!("reader {reader}, last {last}");
                    let ok = slots.judge(&snapshot, &answers, |i| wanted(&want, i, lens[i]), &what);
                    for answer in &answers {
                        match answer {
                            Ok(()) => assert!(!last, "{what}: served after the unmap confirmed"),
                            Err(RdmaError::RegionNotFound) => {}
                            Err(other) => panic!("{what}: unexpected {other:?}"),
                        }
                    }
                    served += ok;
                    refused += answers.len() - ok;
                    if last {
                        return (served, refused, slots);
                    }
                }
            }));
        }
        tokio::time::sleep(Duration::from_micros(*delay_us)).await;
        assert_eq!(
            scene.ob.unmap(scene.src_region.backend_region_id).await,
            Ok(())
        );
        assert_eq!(
            scene.owner.served_replies_in_flight(),
            0,
            "round {round}: the unmap confirmed with replies in flight"
        );
        scene.src.fill(0);
        unmapped.store(true, Ordering::Release);
        for reader in readers {
            let (served, refused, slots) = reader.await.expect("a reader task");
            served_total += served;
            refused_total += refused;
            assert_eq!(scene.cb.unmap(slots.region).await, Ok(()));
        }
        scene.shut_down(&format!("unmap round {round}")).await;
        if Instant::now() > until && round >= 5 {
            break;
        }
    }
    assert!(served_total > 0, "no entry was served before an unmap");
    assert!(refused_total > 0, "no entry was refused after an unmap");
}

/// Either engine shut down while long lists stream: every entry of every
/// list answers once, `Ok` with exactly its bytes or an error with none,
/// and nothing lands after an error.
async fn shutdown_mid_list(gone: Gone) {
    let (mut ok, mut failed) = (0usize, 0usize);
    let mut scribbled = Vec::new();
    for round in 0..6u64 {
        let scene = Scene::new(engines(Transport::Tcp)).await;
        let mut tasks = Vec::new();
        for n in 0..4usize {
            let slots = Slots::new(&scene.cb, &maximal_list(n)).await;
            let requests = requests_from(&slots, &scene.source, |_| Some(Duration::from_secs(5)));
            let cb = scene.cb.clone();
            tasks.push(tokio::spawn(async move {
                let (answers, snapshot) = batch_with_snapshot(&cb, &slots, requests).await;
                let failed = slots.scribble_failed(&answers);
                (slots, answers, snapshot, failed)
            }));
        }
        tokio::time::sleep(Duration::from_micros(round * 150)).await;
        match gone {
            Gone::Consumer => scene.consumer.shutdown().await,
            Gone::Owner => scene.owner.shutdown().await,
        }
        for task in tasks {
            let (slots, answers, snapshot, failures) = task.await.expect("a list task");
            let what = format!("{gone:?} gone, round {round}");
            let want = |i| wanted(&scene.want, i, slots.lens[i]);
            let landed = slots.judge(&snapshot, &answers, want, &what);
            ok += landed;
            failed += answers.len() - landed;
            scribbled.push((slots, failures));
        }
        scene.shut_down(&format!("{gone:?} gone")).await;
    }
    tracing::info!(?gone, ok, failed, "shutdown rounds");
    assert_quiet(&scribbled, &format!("{gone:?} gone")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_shut_down_mid_list_answers_every_entry_once_and_lands_nothing_after() {
    shutdown_mid_list(Gone::Consumer).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_owner_shut_down_mid_list_answers_every_entry_once_and_lands_nothing_after() {
    shutdown_mid_list(Gone::Owner).await;
}

/// An owner whose bound of unfinished replies per connection (20) is below
/// a list's 64 entries serves the first 20 (across two replies) and
/// answers the rest busy, a transient error; each busy entry holds
/// nothing, the served ones hold their bytes, and once the replies are
/// taken the bound is free again: the busy entries succeed when retried.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_list_longer_than_the_owners_bound_is_served_up_to_it_and_the_rest_retried() {
    let scene = Scene::new(engines_with(
        config(Transport::Tcp).with_max_served_replies_per_connection(20),
    ))
    .await;
    let slots = Slots::new(&scene.cb, &scatter_lens()).await;
    let requests = requests_from(&slots, &scene.source, |_| Some(Duration::from_secs(5)));
    let (answers, snapshot) = batch_with_snapshot(&scene.cb, &slots, requests.clone()).await;
    let want = |i| wanted(&scene.want, i, 4 * KIB);
    let ok = slots.judge(&snapshot, &answers, want, "bounded");
    assert_eq!(ok, 20, "{answers:?}");
    for (i, answer) in answers.iter().enumerate() {
        if i < 20 {
            assert_eq!(answer, &Ok(()), "entry {i}");
        } else {
            match answer {
                Err(err @ RdmaError::Backend(text)) => {
                    assert_eq!(text, BUSY_TEXT, "entry {i}");
                    assert!(err.is_transient(), "entry {i}: busy is transient");
                }
                other => panic!("entry {i}: {other:?}"),
            }
        }
    }
    owner_settles(&scene.owner, "bounded").await;
    // Retry what was busy until everything landed.
    let mut left: Vec<usize> = (20..MAX_LIST_ENTRIES).collect();
    for _ in 0..10 {
        if left.is_empty() {
            break;
        }
        let retry: Vec<BackendGet> = left.iter().map(|&i| requests[i].clone()).collect();
        let answers = scene.cb.get_batch_into_test_memory(retry).await;
        let mut still = Vec::new();
        for (&i, answer) in left.iter().zip(&answers) {
            match answer {
                Ok(()) => {}
                Err(RdmaError::Backend(text)) if text == BUSY_TEXT => still.push(i),
                other => panic!("entry {i} retried: {other:?}"),
            }
        }
        left = still;
        owner_settles(&scene.owner, "bounded retry").await;
    }
    assert!(left.is_empty(), "entries still busy: {left:?}");
    let all = vec![Ok(()); MAX_LIST_ENTRIES];
    slots.judge(&slots.buf.snapshot(), &all, want, "retried");
    assert_eq!(scene.cb.unmap(slots.region).await, Ok(()));
    scene.end("bounded").await;
}

/// Entries of every length from 1 byte to the gathering bound at odd
/// offsets, batched so that lists reach their bounds and replies are cut
/// wherever the lengths fall (zero-copy and copied ones alike): every entry
/// lands exactly its bytes and nothing else.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn entries_of_every_length_up_to_the_gathering_bound_land_exactly_whatever_the_cut() {
    let scene = Scene::new(engines(Transport::Tcp)).await;
    let mut seed = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    for round in 0..12 {
        let count = 2 + (next() % 120) as usize;
        let lens: Vec<usize> = (0..count)
            .map(|_| match next() % 4 {
                0 => 1 + (next() % 64) as usize,
                1 => 4 * KIB + (next() % 3) as usize - 1,
                2 => 16 * KIB - (next() % 2) as usize,
                _ => 1 + (next() % (16 * KIB as u64)) as usize,
            })
            .collect();
        let slots = Slots::new(&scene.cb, &lens).await;
        let requests = requests_from(&slots, &scene.source, |_| None);
        let (answers, snapshot) = batch_with_snapshot(&scene.cb, &slots, requests).await;
        let what = format!("round {round}");
        let ok = slots.judge(
            &snapshot,
            &answers,
            |i| wanted(&scene.want, i, lens[i]),
            &what,
        );
        assert_eq!(ok, count, "round {round}: {answers:?}");
        assert_eq!(scene.cb.unmap(slots.region).await, Ok(()));
    }
    scene.end("every length").await;
}

// ---------------------------------------------------------------------------
// Raw consumers against an owner engine.
// ---------------------------------------------------------------------------

/// A raw consumer's list request over the owner's source.
fn list_over(key: ServedKey, base: u64, first_id: u64, lens: &[usize]) -> ListRequest {
    ListRequest {
        entries: lens
            .iter()
            .enumerate()
            .map(|(i, &len)| ReadRequest {
                request_id: first_id + i as u64,
                key,
                address: base + src_offset(i) as u64,
                length: len as u64,
            })
            .collect(),
    }
}

/// Sends `request` on `ep` as a list request that asks for replies;
/// returns UCX's request (or null, or an error status).
fn send_list(consumer: &Raw, ep: sys::ucp_ep_h, request: &ListRequest) -> sys::ucs_status_ptr_t {
    consumer.send(
        ep,
        READ_LIST_REQUEST_AM_ID,
        &request.encode().unwrap(),
        &[],
        sys::UCP_AM_SEND_FLAG_REPLY,
    )
}

/// A list reply a raw consumer received, decoded, with its payload and
/// rendezvous length.
type Reply = (ListReply, Vec<u8>, usize);

/// An owner and its source, for raw consumers.
struct RawScene {
    rt: tokio::runtime::Runtime,
    owner: UcxEngine,
    src: PageBuf,
    want: Vec<u8>,
    region: BackendRegion,
    key: ServedKey,
}

impl RawScene {
    fn new(config: UcxConfig) -> RawScene {
        init_tracing();
        let rt = runtime();
        let owner = UcxEngine::start(config).expect("owner engine starts");
        let src = PageBuf::filled(SOURCE_LEN, pattern);
        let want = src.snapshot();
        let region = rt.block_on(map(&owner.backend(), &src));
        let key = ServedKey::decode(&region.packed_key).unwrap();
        RawScene {
            rt,
            owner,
            src,
            want,
            region,
            key,
        }
    }

    fn base(&self) -> u64 {
        self.src.addr() as u64
    }

    /// A raw consumer asks `request` and waits until every entry was
    /// answered; returns the owner's replies.
    fn ask(&self, request: &ListRequest, what: &str) -> Vec<Reply> {
        let consumer = Raw::new(false);
        consumer.ask_list(&self.owner.worker_address(), request);
        assert!(
            consumer.progress_until(Duration::from_secs(5), |r| {
                r.list_entries_answered() >= request.entries.len()
            }),
            "{what}: not every entry answered"
        );
        consumer.progress_for(Duration::from_millis(20));
        let replies: Vec<Reply> = consumer
            .messages(READ_LIST_REPLY_AM_ID)
            .iter()
            .map(|m| {
                (
                    ListReply::decode(&m.header).expect("a well-formed list reply"),
                    m.data.clone(),
                    m.rndv_len,
                )
            })
            .collect();
        drop(consumer);
        replies
    }

    /// Checks `replies` answer `request` entry by entry: each served entry
    /// once, with its own bytes at its place in its reply's payload, each
    /// payload the served entries' and at most one fragment, all eager.
    /// Returns every entry's status by request id order of `request`.
    fn check_replies(&self, request: &ListRequest, replies: &[Reply]) -> Vec<ReplyStatus> {
        let mut status: Vec<Option<ReplyStatus>> = vec![None; request.entries.len()];
        let first_id = request.entries[0].request_id;
        for (reply, data, rendezvous) in replies {
            assert_eq!(*rendezvous, 0, "every reply is eager");
            assert!(data.len() <= PIECE, "a reply of {} bytes", data.len());
            let mut at = 0;
            for entry in &reply.entries {
                let i = (entry.request_id - first_id) as usize;
                assert!(status[i].is_none(), "entry {i} answered twice");
                status[i] = Some(entry.status);
                if entry.status == ReplyStatus::Served {
                    let asked = &request.entries[i];
                    assert_eq!(entry.length, asked.length, "entry {i}: its own length");
                    let from = (asked.address - self.base()) as usize;
                    let len = asked.length as usize;
                    assert_eq!(
                        differing_bytes(&data[at..at + len], &self.want[from..from + len]),
                        0,
                        "entry {i}: its own bytes"
                    );
                    at += len;
                }
            }
            assert_eq!(at, data.len(), "the payload is the served entries'");
        }
        status
            .into_iter()
            .enumerate()
            .map(|(i, s)| s.unwrap_or_else(|| panic!("entry {i} never answered")))
            .collect()
    }

    /// A consumer engine with the default settings reads each list of
    /// `lists` from the source and gets exactly its bytes.
    fn assert_serves(&self, lists: &[Vec<usize>], what: &str) {
        let consumer = tcp_engine();
        consumer
            .add_peer(OWNER, self.owner.worker_address())
            .unwrap();
        let cb = consumer.backend();
        let source = describe(&self.src, &self.region);
        self.rt.block_on(async {
            for lens in lists {
                let slots = Slots::new(&cb, lens).await;
                let requests = requests_from(&slots, &source, |_| None);
                let (answers, snapshot) = batch_with_snapshot(&cb, &slots, requests).await;
                let want = |i| wanted(&self.want, i, lens[i]);
                let ok = slots.judge(&snapshot, &answers, want, what);
                assert_eq!(ok, lens.len(), "{what}: {answers:?}");
                assert_eq!(cb.unmap(slots.region).await, Ok(()));
            }
            consumer.shutdown().await;
        });
    }

    /// Checks the owner lets go of every reply, unmaps the source `Ok` and
    /// shuts down with nothing registered.
    fn end(self, what: &str) {
        let RawScene {
            rt,
            owner,
            region,
            src,
            ..
        } = self;
        rt.block_on(owner_settles(&owner, what));
        let unmapped = rt.block_on(async {
            tokio::time::timeout(
                Duration::from_secs(5),
                owner.backend().unmap(region.backend_region_id),
            )
            .await
        });
        assert_eq!(unmapped, Ok(Ok(())), "{what}: the source unmaps");
        rt.block_on(owner.shutdown());
        assert_eq!(owner.live_registrations(), Some(0), "{what}");
        drop(src);
    }
}

/// Raw consumers ask maximal lists — 64 × 4 KiB and 16 × 16 KiB, several at
/// once — and vanish while the owner cuts its replies: with and without peer
/// error handling on their endpoint, closed at once or after a moment. The
/// owner survives, lets go of every reply (its unmap answers), and serves a
/// full list to another consumer.
#[test]
fn raw_consumers_vanishing_mid_list_leave_the_owner_serving_and_unmappable() {
    let scene = RawScene::new(config(Transport::Tcp));
    let address = scene.owner.worker_address();
    for round in 0..12u64 {
        let consumer = Raw::new(false);
        let ep = consumer.connect_mode(&address, round % 2 == 0);
        let mut pending = Vec::new();
        for n in 0..8u64 {
            let request = list_over(scene.key, scene.base(), n * 100, &maximal_list(n as usize));
            let sent = send_list(&consumer, ep, &request);
            if !sent.is_null() && !common::raw_am::is_err(sent) {
                pending.push(sent);
            }
        }
        match round % 3 {
            0 => {}
            1 => consumer.progress_for(Duration::from_micros(300)),
            _ => {
                consumer.progress_until(Duration::from_secs(2), |r| {
                    !r.messages(READ_LIST_REPLY_AM_ID).is_empty()
                });
            }
        }
        for request in pending {
            // SAFETY: requests of this raw consumer's worker, returned once
            // (UCX frees an unfinished one when it ends).
            unsafe { sys::ucp_request_free(request.cast()) };
        }
        drop(consumer);
    }
    scene.assert_serves(&[scatter_lens()], "after vanished consumers");
    scene.end("vanished consumers");
}

/// Tiny entries are cut by count and bytes, not by anything else: 64 × 8 B
/// come back as one reply; 64 × 4 KiB as five of at most one fragment (15
/// entries each); a list mixing 16 KiB, 1000 B and 1-byte entries in replies
/// none of which passes one fragment. Every entry is answered once with its
/// own bytes.
#[test]
fn a_list_is_cut_by_its_payload_only_whatever_the_mix_of_entry_sizes() {
    let scene = RawScene::new(config(Transport::Tcp));
    let mixed: Vec<usize> = (0..MAX_LIST_ENTRIES)
        .map(|i| [16 * KIB, 1, 1000, 3, 2000][i % 5])
        .collect();
    let cases: [(&str, Vec<usize>, Option<usize>); 3] = [
        ("64 x 8 B", vec![8; MAX_LIST_ENTRIES], Some(1)),
        ("64 x 4 KiB", scatter_lens(), Some(5)),
        ("mixed", mixed, None),
    ];
    for (what, lens, replies_expected) in cases {
        let request = list_over(scene.key, scene.base(), 1000, &lens);
        let replies = scene.ask(&request, what);
        let status = scene.check_replies(&request, &replies);
        assert!(
            status.iter().all(|s| *s == ReplyStatus::Served),
            "{what}: {status:?}"
        );
        if let Some(expected) = replies_expected {
            assert_eq!(replies.len(), expected, "{what}: replies");
        }
        // Never cut where the next entry would still have fit.
        for pair in replies.windows(2) {
            let (this, next) = (&pair[0], &pair[1]);
            let first_next = next.0.entries[0].length as usize;
            assert!(
                this.1.len() + first_next > PIECE,
                "{what}: a reply of {} B cut before an entry of {first_next} B",
                this.1.len()
            );
        }
    }
    scene.end("cuts");
}

/// A raw consumer's list mixing every way an entry can be wrong — zero
/// bytes, a stale region id (unmapped), a live region of another buffer, a
/// forged capability, one byte past the registration's end — with good
/// entries, long enough to be answered in several replies: each bad entry
/// is refused on its own with the refusal that fits, and every good one is
/// served its own bytes, wherever the cuts fall.
#[test]
fn a_list_mixing_stale_forged_empty_and_live_entries_refuses_each_bad_one_on_its_own() {
    let scene = RawScene::new(config(Transport::Tcp));
    let ob = scene.owner.backend();
    // A region mapped and unmapped again: its id is stale.
    let stale_buf = PageBuf::filled(64 * KIB, pattern);
    let stale = scene.rt.block_on(map(&ob, &stale_buf));
    assert_eq!(scene.rt.block_on(ob.unmap(stale.backend_region_id)), Ok(()));
    let stale_key = ServedKey::decode(&stale.packed_key).unwrap();
    let forged = ServedKey {
        capability: [0xAB; 16],
        ..scene.key
    };
    let mut request = list_over(scene.key, scene.base(), 5000, &scatter_lens());
    let end = scene.base() + SOURCE_LEN as u64;
    let mut expected = vec![ReplyStatus::Served; MAX_LIST_ENTRIES];
    for (i, (entry, expected)) in request.entries.iter_mut().zip(&mut expected).enumerate() {
        let refusal = match i % 7 {
            1 => {
                entry.length = 0;
                Some(RemoteRefusal::OutOfRange)
            }
            3 => {
                entry.key = stale_key;
                entry.address = stale_buf.addr() as u64;
                Some(RemoteRefusal::RegionUnknown)
            }
            4 => {
                entry.key = forged;
                Some(RemoteRefusal::CapabilityMismatch)
            }
            6 => {
                entry.address = end - entry.length + 1;
                Some(RemoteRefusal::OutOfRange)
            }
            _ => None,
        };
        if let Some(refusal) = refusal {
            *expected = ReplyStatus::Refused(refusal);
        }
    }
    let replies = scene.ask(&request, "mixed entries");
    let status = scene.check_replies(&request, &replies);
    assert!(replies.len() > 1, "one reply: the cut was not exercised");
    for (i, (got, want)) in status.iter().zip(&expected).enumerate() {
        // A capability mismatch may be reported as an unknown region: both
        // say "not yours".
        let fits = got == want
            || (*want == ReplyStatus::Refused(RemoteRefusal::CapabilityMismatch)
                && *got == ReplyStatus::Refused(RemoteRefusal::RegionUnknown));
        assert!(fits, "entry {i}: {got:?}, expected {want:?}");
    }
    scene.end("mixed entries");
    drop(stale_buf);
}

/// Where the owner's operator shapes UCX's protocols (a rendezvous
/// threshold, a tcp segment size, UCX's older protocols), the owner does
/// not cut: it answers a consumer's maximal list (256 KiB, asked in one
/// request whatever the owner's settings) in one eager reply, and a
/// consumer engine with the default settings lands every entry of lists
/// of every shape from it exactly.
#[test]
fn an_owner_whose_operator_shapes_ucx_protocols_answers_a_maximal_list_whole_and_it_lands() {
    for (key, value) in [
        ("RNDV_THRESH", "8K"),
        ("TCP_TX_SEG_SIZE", "16K"),
        ("PROTO_ENABLE", "n"),
    ] {
        let what = format!("UCX_{key}={value}");
        let scene = RawScene::new(config(Transport::Tcp).with_ucx_setting(key, value));
        let request = list_over(scene.key, scene.base(), 1, &scatter_lens());
        let replies = scene.ask(&request, &what);
        assert_eq!(replies.len(), 1, "{what}: the owner cut its reply");
        let (reply, data, rendezvous) = &replies[0];
        assert_eq!(*rendezvous, 0, "{what}: eager");
        assert_eq!(data.len(), MAX_LIST_ENTRIES * 4 * KIB, "{what}");
        let mut at = 0;
        for (entry, asked) in reply.entries.iter().zip(&request.entries) {
            assert_eq!(entry.request_id, asked.request_id, "{what}: in order");
            assert_eq!(entry.status, ReplyStatus::Served, "{what}");
            let from = (asked.address - scene.base()) as usize;
            assert_eq!(
                differing_bytes(&data[at..at + 4 * KIB], &scene.want[from..from + 4 * KIB]),
                0,
                "{what}: entry {} bytes",
                asked.request_id
            );
            at += 4 * KIB;
        }
        // A consumer engine with the default settings reads from it.
        let odd = (0..MAX_LIST_ENTRIES).map(|i| 1 + i * 61).collect();
        scene.assert_serves(&[scatter_lens(), vec![16 * KIB; 16], odd], &what);
        scene.end(&what);
    }
}

// ---------------------------------------------------------------------------
// Either side killed mid-list: a child process of this test binary.
// ---------------------------------------------------------------------------

/// The test a child process plays the role of, by name.
const CHILD_ROLE: &str = "RDMAREG_LIST_REPLIES_CHILD";
const CHILD_OWNER: &str = "RDMAREG_LIST_REPLIES_OWNER";
const CHILD_KEY: &str = "RDMAREG_LIST_REPLIES_KEY";
const CHILD_BASE: &str = "RDMAREG_LIST_REPLIES_BASE";
/// What the consumer child prints once the owner's replies reach it.
const ASKING: &str = "CHILD-ASKING";
/// What the owner child prints: its worker address and its source's
/// descriptor, hex.
const OWNER_LINE: &str = "CHILD-OWNER";

/// Whether this process is the child the test `name` started.
fn is_child(name: &str) -> bool {
    std::env::var(CHILD_ROLE).as_deref() == Ok(name)
}

/// Starts this test binary again, filtered to the test `name` and in its
/// child role, with `env` set, its stdout piped and its stderr discarded.
fn spawn_child(name: &str, env: &[(&str, String)]) -> Child {
    Command::new(std::env::current_exe().expect("the test binary"))
        .args([name, "--exact", "--nocapture", "--test-threads", "1"])
        .env(CHILD_ROLE, name)
        .envs(env.iter().map(|(key, value)| (key, value)))
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("the child process starts")
}

/// In the child: asks lists as fast as the owner answers, never letting
/// go, and says so on stdout once the first replies came.
fn child_consumer() {
    use std::io::Write;
    let address = unhex(&std::env::var(CHILD_OWNER).unwrap());
    let key = ServedKey::decode(&unhex(&std::env::var(CHILD_KEY).unwrap())).unwrap();
    let base: u64 = std::env::var(CHILD_BASE).unwrap().parse().unwrap();
    let consumer = Raw::new(false);
    let ep = consumer.connect(&address);
    let mut said = false;
    let started = Instant::now();
    for n in 0u64.. {
        if started.elapsed() > Duration::from_secs(5) {
            eprintln!("the child gives up after 5 s: nobody killed it");
            std::process::exit(3);
        }
        let request = list_over(key, base, n * 100, &maximal_list(n as usize));
        // Never freed: the process is killed with them outstanding.
        let _ = send_list(&consumer, ep, &request);
        consumer.progress_for(Duration::from_micros(200));
        if !said && !consumer.messages(READ_LIST_REPLY_AM_ID).is_empty() {
            said = true;
            // On a line of its own: the harness's "test … " has no newline.
            println!("\n{ASKING}");
            std::io::stdout().flush().unwrap();
        }
    }
}

/// A consumer process asking maximal lists back to back is killed
/// (`SIGKILL`) while the owner is cutting its replies, several times: the
/// owner survives, lets go of every reply (its unmap answers) and serves a
/// full list to another consumer.
#[test]
fn a_consumer_process_killed_mid_list_leaves_the_owner_serving_and_unmappable() {
    use std::io::BufRead;
    const NAME: &str = "a_consumer_process_killed_mid_list_leaves_the_owner_serving_and_unmappable";
    if is_child(NAME) {
        child_consumer();
        return;
    }
    let scene = RawScene::new(config(Transport::Tcp));
    for round in 0..3u64 {
        let mut child = spawn_child(
            NAME,
            &[
                (CHILD_OWNER, hex(&scene.owner.worker_address())),
                (CHILD_KEY, hex(&scene.key.encode())),
                (CHILD_BASE, scene.base().to_string()),
            ],
        );
        let stdout = child.stdout.take().unwrap();
        let mut lines = std::io::BufReader::new(stdout).lines();
        let asking = lines.any(|line| line.is_ok_and(|l| l.trim() == ASKING));
        assert!(
            asking,
            "round {round}: the consumer process never got a reply"
        );
        std::thread::sleep(Duration::from_millis(5 + 20 * round));
        child.kill().expect("SIGKILL");
        let status = child.wait().expect("the child's status");
        assert!(!status.success(), "round {round}: killed, not exited");
    }
    scene.assert_serves(&[scatter_lens()], "after killed consumers");
    scene.end("killed consumers");
}

/// In the child: an owner engine over tcp serving a [`pattern`] source
/// until it is killed (or gives up after 10 s).
fn child_owner() {
    use std::io::Write;
    let rt = runtime();
    let owner = tcp_engine();
    let src = PageBuf::filled(SOURCE_LEN, pattern);
    let region = rt.block_on(map(&owner.backend(), &src));
    let descriptor = describe(&src, &region);
    println!(
        "\n{OWNER_LINE} {} {}",
        hex(&owner.worker_address()),
        hex(&descriptor.encode())
    );
    std::io::stdout().flush().unwrap();
    std::thread::sleep(Duration::from_secs(10));
    eprintln!("the owner process gives up after 10 s: nobody killed it");
    std::process::exit(3);
}

/// An owner process is killed (`SIGKILL`) while a consumer engine streams
/// batches of maximal lists from it, at a different moment each round:
/// every entry of every list answers once — `Ok` with exactly its bytes, or
/// a typed error (the connection failed, or its deadline) with none — no
/// byte of a failed entry changes afterwards, and the consumer lets go of
/// every destination.
#[test]
fn an_owner_process_killed_mid_list_answers_every_entry_once_and_lands_nothing_after() {
    use std::io::BufRead;
    const NAME: &str =
        "an_owner_process_killed_mid_list_answers_every_entry_once_and_lands_nothing_after";
    if is_child(NAME) {
        child_owner();
        return;
    }
    let rt = runtime();
    let want = PageBuf::filled(SOURCE_LEN, pattern).snapshot();
    let (mut ok, mut failed) = (0usize, 0usize);
    let mut scribbled = Vec::new();
    let started = Instant::now();
    for round in 0..2u64 {
        let mut child = spawn_child(NAME, &[]);
        let stdout = child.stdout.take().unwrap();
        let line = std::io::BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
            .find(|line| line.starts_with(OWNER_LINE))
            .expect("the owner process says where it is");
        let mut words = line.split_whitespace().skip(1);
        let address = Bytes::from(unhex(words.next().unwrap()));
        let source = Descriptor::decode(&unhex(words.next().unwrap())).unwrap();
        let consumer = tcp_engine();
        consumer.add_peer(OWNER, address).unwrap();
        let cb = consumer.backend();
        let (round_ok, round_failed, round_scribbled) = rt.block_on(async {
            let mut tasks = Vec::new();
            for n in 0..4usize {
                let lens = if n % 2 == 0 {
                    vec![4 * KIB; 4 * MAX_LIST_ENTRIES]
                } else {
                    vec![16 * KIB; 4 * 16]
                };
                let slots = Slots::new(&cb, &lens).await;
                let requests = requests_from(&slots, &source, |_| Some(Duration::from_secs(3)));
                let cb = cb.clone();
                tasks.push(tokio::spawn(async move {
                    let mut outcomes = Vec::new();
                    // Lists back to back until one fails.
                    for _ in 0..200 {
                        slots.buf.fill(0);
                        let (answers, snapshot) =
                            batch_with_snapshot(&cb, &slots, requests.clone()).await;
                        let done = answers.iter().any(|a| a.is_err());
                        outcomes.push((answers, snapshot));
                        if done {
                            break;
                        }
                    }
                    let failures = slots.scribble_failed(&outcomes.last().unwrap().0);
                    (slots, outcomes, failures)
                }));
            }
            tokio::time::sleep(Duration::from_millis(20 + 40 * round)).await;
            child.kill().expect("SIGKILL");
            let (mut ok, mut failed, mut scribbled) = (0usize, 0usize, Vec::new());
            for task in tasks {
                let (slots, outcomes, failures) = task.await.expect("a list task");
                for (n, (answers, snapshot)) in outcomes.iter().enumerate() {
                    let what = format!("round {round}, batch {n}");
                    let expected = |i| wanted(&want, i, slots.lens[i]);
                    let landed = slots.judge(snapshot, answers, expected, &what);
                    ok += landed;
                    failed += answers.len() - landed;
                    for answer in answers.iter().filter(|a| a.is_err()) {
                        assert!(
                            matches!(answer, Err(RdmaError::Backend(_) | RdmaError::Timeout)),
                            "{what}: {answer:?}"
                        );
                    }
                }
                scribbled.push((slots, failures));
            }
            (ok, failed, scribbled)
        });
        tracing::info!(round, round_ok, round_failed, elapsed = ?started.elapsed(), "owner killed");
        let status = child.wait().expect("the owner's status");
        assert!(!status.success(), "round {round}: killed, not exited");
        ok += round_ok;
        failed += round_failed;
        rt.block_on(async {
            assert_quiet(&round_scribbled, &format!("round {round}")).await;
            for (slots, _) in &round_scribbled {
                assert_eq!(cb.unmap(slots.region).await, Ok(()));
            }
            consumer.shutdown().await;
        });
        assert_eq!(consumer.live_registrations(), Some(0));
        scribbled.extend(round_scribbled);
    }
    assert!(
        failed > 0,
        "no entry failed: the owner was never killed mid-list ({ok} Ok)"
    );
    drop(scribbled);
}
