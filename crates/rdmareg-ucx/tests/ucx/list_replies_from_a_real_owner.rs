//! Lists answered in several replies, by an owner engine under churn, to a
//! consumer engine.
//!
//! Over tcp a consumer asks a whole list (up to 64 reads, 256 KiB) in one
//! request and the owner answers it in replies of at most one fragment's
//! payload each; the consumer lands each entry by its request id, whichever
//! reply brings it. Each entry keeps its own lease, hold, deadline and
//! answer. These tests attack the seams between the replies of one list
//! of a real owner to a consumer engine: deadlines passing between the
//! replies; the owner unmapping its source while the replies go out;
//! either side going away mid-list (an engine shut down, an owner process
//! killed); lists longer than the owner's bound of unfinished replies; and
//! lists of entries of every length, cut wherever the lengths fall.
//! (`list_replies_to_raw_consumers.rs` asks an owner engine lists by hand;
//! `list_replies_from_a_hostile_owner.rs` attacks the same seams from the
//! owner's side.)
//!
//! What every test holds the engines to: an entry is answered once, `Ok`
//! only with exactly its own bytes; an entry answered with an error holds
//! none of its bytes (an eager entry lands whole inside the reply handler
//! or not at all) and no byte of it changes afterwards; no byte lands
//! outside an entry's range; the owner's unmap waits for its leases; the
//! owner survives and serves on.
//!
//! The test with a child process starts this test binary again, filtered
//! to itself, with [`CHILD_ROLE`] naming it: the child plays the owner
//! instead of the test.

use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::child_process::*;
use common::list_reads::*;
use common::list_scene::*;
use common::scene::*;
use common::*;
use rdmareg_backend::RdmaBackend;
use rdmareg_core::{BackendGet, Descriptor, RdmaError};
use rdmareg_ucx::Transport;
use rdmareg_ucx::read_list::MAX_LIST_ENTRIES;
use rdmareg_ucx::read_protocol::BUSY_TEXT;

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
        let mut warmed = Vec::new();
        for reader in 0..3usize {
            let lens = maximal_list(reader);
            let slots = Slots::new(&scene.cb, &lens).await;
            let requests = requests_from(&slots, &scene.source, |_| Some(Duration::from_secs(5)));
            let (cb, unmapped, want) = (scene.cb.clone(), Arc::clone(&unmapped), Arc::clone(&want));
            let (warm, warm_done) = tokio::sync::oneshot::channel();
            warmed.push(warm_done);
            readers.push(tokio::spawn(async move {
                let (mut served, mut refused) = (0usize, 0usize);
                // One whole list before the unmap may start, so that every
                // round streams lists when it comes, however slow the
                // machine (under AddressSanitizer a round's first list can
                // take longer than the longest delay below).
                let (answers, snapshot) = batch_with_snapshot(&cb, &slots, requests.clone()).await;
                let what = format!("reader {reader}, warm-up");
                served += slots.judge(&snapshot, &answers, |i| wanted(&want, i, lens[i]), &what);
                assert_eq!(answers, vec![Ok(()); lens.len()], "{what}");
                let _ = warm.send(());
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
        for warm_done in warmed {
            warm_done.await.expect("a reader warmed up");
        }
        tokio::time::sleep(Duration::from_micros(*delay_us)).await;
        let region = scene.src_region.backend_region_id;
        let what = format!("round {round}");
        unmap_and_zero_source(&scene.owner, region, &scene.src, &unmapped, &what).await;
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
// An owner killed mid-list: a child process of this test binary.
// ---------------------------------------------------------------------------

/// What the owner child prints: its worker address and its source's
/// descriptor, hex.
const OWNER_LINE: &str = "CHILD-OWNER";

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
        let mut child = spawn_child(module_path!(), NAME, &[]);
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
