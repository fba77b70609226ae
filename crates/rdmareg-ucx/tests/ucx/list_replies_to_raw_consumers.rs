//! Lists answered in several replies, by an owner engine, to raw
//! consumers.
//!
//! Over tcp a consumer asks a whole list (up to 64 reads, 256 KiB) in one
//! request and the owner answers it in replies of at most one fragment's
//! payload each, cut by payload only; each entry is answered on its own.
//! These tests play the consumer with a raw UCX peer (`common::raw_am`),
//! which asks lists by hand and reads the owner's replies as they come:
//! consumers vanishing mid-list (closed at once or after a moment, with
//! and without peer error handling, or a consumer process killed), and an
//! owner whose operator shapes UCX's protocols.
//! (`list_replies_from_a_real_owner.rs` reads from an owner engine with a
//! consumer engine; how the owner judges a list's entries and cuts its
//! replies is the engine kit's, in its deterministic scenarios,
//! `rdmareg-engine`'s `served::scenarios::owner_lists`.)
//!
//! What every test holds the owner engine to: the owner lets go of every
//! reply, however its consumer went away, its unmap answers, and it
//! survives and serves a consumer engine on.
//!
//! The test with a child process starts this test binary again, filtered
//! to itself, with [`CHILD_ROLE`] naming it: the child plays the consumer
//! instead of the test.

use crate::common;

use std::time::{Duration, Instant};

use common::child_process::*;
use common::list_reads::*;
use common::list_scene::*;
use common::raw_am::Raw;
use common::scene::*;
use common::*;
use rdmareg_backend::RdmaBackend;
use rdmareg_core::BackendRegion;
use rdmareg_ucx::read_list::{
    ListReply, ListRequest, MAX_LIST_ENTRIES, READ_LIST_REPLY_AM_ID, READ_LIST_REQUEST_AM_ID,
};
use rdmareg_ucx::read_protocol::{ReadRequest, ReplyStatus, ServedKey};
use rdmareg_ucx::{Transport, UcxConfig, UcxEngine};
use ucx_sys as sys;

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
///
/// Run over `tcp` and over a transport list that is not `Transport::Tcp`
/// but leaves only tcp lanes: an owner that asked UCX about each list
/// request's endpoint crashed there now and then (UCX handed the handler an
/// endpoint whose configuration was gone; about 1 run in 17 of 400 rounds).
#[test]
fn raw_consumers_vanishing_mid_list_leave_the_owner_serving_and_unmappable() {
    for transport in [
        Transport::Tcp,
        Transport::Custom {
            tls: "tcp,self".into(),
        },
    ] {
        consumers_vanish_mid_list(transport, 48);
    }
}

/// `rounds` raw consumers vanish mid-list from one owner over `transport`.
fn consumers_vanish_mid_list(transport: Transport, rounds: u64) {
    let what = format!("{transport:?}");
    let scene = RawScene::new(config(transport));
    let address = scene.owner.worker_address();
    for round in 0..rounds {
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
    scene.assert_serves(
        &[scatter_lens()],
        &format!("{what}: after vanished consumers"),
    );
    scene.end(&format!("{what}: vanished consumers"));
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
// A consumer killed mid-list: a child process of this test binary.
// ---------------------------------------------------------------------------

const CHILD_OWNER: &str = "RDMAREG_LIST_REPLIES_OWNER";
const CHILD_KEY: &str = "RDMAREG_LIST_REPLIES_KEY";
const CHILD_BASE: &str = "RDMAREG_LIST_REPLIES_BASE";
/// What the consumer child prints once the owner's replies reach it.
const ASKING: &str = "CHILD-ASKING";

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
            module_path!(),
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
