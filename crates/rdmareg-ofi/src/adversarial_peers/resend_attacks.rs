//! Attacks on the resend of a read request whose owner closed its
//! connection (`FI_ENOTCONN` over `tcp;ofi_rxm` with
//! `FI_AV_REMOVE_CLEANUP=1`; see `Engine::resend_on_new_connection`).
//!
//! Every test reruns itself in a child process with `FI_AV_REMOVE_CLEANUP`
//! set (libfabric reads it once, when it initialises). An owner keeping
//! few consumer addresses forgets a connected consumer when another one
//! reads, which closes that consumer's connection; the consumer's next
//! requests fail to send and are sent again. The attacks put shutdown, a
//! deadline, an unmap, a dying owner, concurrency and connections closed
//! again against that resend, and check the promise: an answer means the
//! provider let go of the destination (refilled after the answers, it
//! stays as refilled), a served read lands its own bytes, errors are typed
//! and come by the deadline, and no registration is left.

use std::io::Write;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use rdmareg_backend::RdmaBackend;
use rdmareg_core::{BackendGet, BackendRegion, PeerId, RdmaError};

use super::{
    HostileOwnerSetup, Memory, config, get, ran_in_child_with_connection_cleanup, runtime,
};
use crate::engine::OfiEngine;
use crate::{OfiBackend, Provider};

/// Bytes of one read.
const CHUNK: usize = 64;
/// Reads of a batch (each its own chunk of source and destination).
const CHUNKS: usize = 32;
/// Source and destination length.
const LEN: usize = CHUNK * CHUNKS;
/// What a destination is refilled with after its reads answered (the
/// source has no zero byte).
const REFILL: u8 = 0;
/// How long a refilled destination is watched for late bytes.
const WATCH: Duration = Duration::from_millis(400);

/// The engine's debug log of the child process.
static LOG: Mutex<Vec<u8>> = Mutex::new(Vec::new());

struct LogWriter;

impl Write for LogWriter {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        LOG.lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// How many log lines so far contain `text`.
fn logged(text: &str) -> usize {
    let log = LOG.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    String::from_utf8_lossy(&log).matches(text).count()
}

/// Requests sent again on a new connection so far in this process.
fn resends() -> usize {
    logged("sending a read request again on a new connection")
}

/// What the log tells of the resend so far: connections reset for a
/// closed one, requests sent again, sends failed.
fn resend_story() -> String {
    format!(
        "connections reset for FI_ENOTCONN: {}, requests sent again: {}, tagged sends failed: {}",
        logged("found its owner's connection closed"),
        resends(),
        logged("a tagged send failed"),
    )
}

/// Counts answers by kind.
fn tally(answers: &[Result<(), RdmaError>]) -> String {
    let mut kinds: std::collections::BTreeMap<String, usize> = Default::default();
    for answer in answers {
        let kind = match answer {
            Ok(()) => "Ok".to_string(),
            Err(RdmaError::Backend(text)) => format!("Backend({text})"),
            Err(err) => format!("{err:?}"),
        };
        *kinds.entry(kind).or_default() += 1;
    }
    format!("{kinds:?}")
}

/// The test that shuts the owner down around its consumer's failed sends.
const OWNER_SHUT_DOWN_AROUND_THE_FAILED_SEND: &str =
    "an_owner_shut_down_around_the_failed_send_and_its_resend_gives_typed_errors_by_the_deadline";

/// Runs `body` in a child process with `FI_AV_REMOVE_CLEANUP=1` (this
/// process, if it has it set), logging the engines' debug events.
fn with_connection_cleanup(name: &str, body: impl FnOnce()) {
    let exact = format!("adversarial_peers::resend_attacks::{name}");
    // Under AddressSanitizer, the test whose owner is shut down while its
    // consumer's sends to it fail leaks, in about one run in twenty, memory
    // that libfabric 1.17's `tcp` provider allocated and that no call open
    // to us frees. The consumer connects to the owner again; the owner's
    // progress (`fi_cq_read`, through `ofi_rxm`'s connection progress and
    // the event queue of rxm's own listener) accepts the socket, allocating
    // a 40-byte `tcpx_conn_handle` and the 336-byte `tcpx_cm_context` that
    // waits for the connection request (`tcpx_accept` and
    // `tcpx_alloc_cm_ctx`, prov/tcp/src/tcpx_conn_mgr.c:567 and :47 in
    // v1.17.0); then the owner shuts down before the request is read. Our
    // `fi_close` of the endpoint makes rxm close its listener and event
    // queue, and neither the listener's close nor the event queue's frees a
    // context still waiting there: the 376 bytes (336 + 40) reported. When
    // the request was read but rxm had not yet taken the `FI_CONNREQ` event,
    // the event queue's cleanup frees the event but not the `fi_info` and
    // handle it carries (678 bytes in 12 blocks, seen with a debug build of
    // v1.17.0). Both are the provider's: ours (endpoint, address vector,
    // completion queue, domain, fabric, regions) are all closed, and the
    // listener and its pending connections are rxm's, out of our reach.
    // The race is what the test is for, so leaks stay unchecked in its
    // child; memory errors are still checked there.
    if ran_in_child_with_connection_cleanup(&exact, name == OWNER_SHUT_DOWN_AROUND_THE_FAILED_SEND)
    {
        return;
    }
    let _ = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::DEBUG)
        .with_ansi(false)
        .with_writer(|| LogWriter)
        .try_init();
    body();
}

/// An owner keeping `bound` consumer addresses, serving `src` (byte `i`
/// is `i % 251 + 1`), and consumers each with a destination of `LEN`.
struct Cluster {
    rt: tokio::runtime::Runtime,
    owner: Option<OfiEngine>,
    src: Memory,
    src_region: BackendRegion,
    consumers: Vec<OfiEngine>,
    dsts: Vec<Memory>,
    dst_regions: Vec<BackendRegion>,
}

impl Cluster {
    fn new(bound: usize, consumers: usize) -> Cluster {
        let rt = runtime();
        let mut config = config(Provider::Tcp);
        config.served_peers_bound = Some(bound);
        let owner = OfiEngine::start(config.clone()).expect("owner starts");
        let src = Memory::filled(LEN, 0);
        // SAFETY: nothing reads or writes the source yet (it is not
        // mapped); `src.raw` is this test's own allocation of `LEN` bytes.
        let bytes = unsafe { &mut *src.raw };
        for (i, byte) in bytes.iter_mut().enumerate() {
            *byte = (i % 251) as u8 + 1;
        }
        let src_region = src.map(&rt, &owner.backend());
        let consumers: Vec<OfiEngine> = (0..consumers)
            .map(|_| {
                let consumer = OfiEngine::start(config.clone()).expect("a consumer starts");
                consumer
                    .add_peer(PeerId(1), owner.fabric_address())
                    .unwrap();
                consumer
            })
            .collect();
        let dsts: Vec<Memory> = consumers
            .iter()
            .map(|_| Memory::filled(LEN, REFILL))
            .collect();
        let dst_regions = consumers
            .iter()
            .zip(&dsts)
            .map(|(consumer, dst)| dst.map(&rt, &consumer.backend()))
            .collect();
        Cluster {
            rt,
            owner: Some(owner),
            src,
            src_region,
            consumers,
            dsts,
            dst_regions,
        }
    }

    /// Read `chunk` of the source into the same chunk of consumer `c`'s
    /// destination.
    fn request(&self, c: usize, chunk: usize, deadline: Duration) -> BackendGet {
        get(
            PeerId(1),
            &self.src_region.packed_key,
            (self.src.addr() + chunk * CHUNK) as u64,
            &self.dst_regions[c],
            (chunk * CHUNK) as u64,
            CHUNK as u64,
            deadline,
        )
    }

    /// Consumer `c` reads one chunk and waits for the answer.
    fn read_one(&self, c: usize, chunk: usize) -> Result<(), RdmaError> {
        let backend = self.consumers[c].backend();
        let request = self.request(c, chunk, Duration::from_secs(2));
        // SAFETY: the destination is a `Memory` nobody touches until this
        // read answered.
        self.rt.block_on(unsafe { backend.get(request) })
    }

    /// Makes the owner forget consumer `target`, connected: it reads, then
    /// every other consumer reads (the owner keeps fewer addresses than
    /// there are consumers, and forgets the one idle longest).
    fn forget(&self, target: usize) {
        let _ = self.read_one(target, 0);
        for c in 0..self.consumers.len() {
            if c != target {
                let _ = self.read_one(c, 0);
            }
        }
    }

    /// Starts a batch on consumer `c` of `deadlines.len()` reads, read
    /// `k` into chunk `k`, with its deadline.
    fn start(&self, c: usize, deadlines: &[Duration]) -> ReadTask {
        let requests: Vec<BackendGet> = deadlines
            .iter()
            .enumerate()
            .map(|(chunk, &deadline)| self.request(c, chunk, deadline))
            .collect();
        // Each read on its own (a batch would go as one gathered request).
        let reads: Vec<_> = requests
            .into_iter()
            .map(|request| {
                let backend: OfiBackend = self.consumers[c].backend();
                self.rt.spawn(async move {
                    // SAFETY: nothing touches the destination until every
                    // read answered (the checks read it only after).
                    unsafe { backend.get(request) }.await
                })
            })
            .collect();
        self.rt.spawn(async move {
            let mut answers = Vec::new();
            for read in reads {
                answers.push(read.await.expect("a read task"));
            }
            answers
        })
    }

    fn wait(&self, task: ReadTask, within: Duration) -> Vec<Result<(), RdmaError>> {
        let until = Instant::now() + within;
        while !task.is_finished() && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(task.is_finished(), "the batch answered within {within:?}");
        self.rt.block_on(task).expect("the batch task")
    }

    /// Checks consumer `c`'s answers (read `k` into chunk `k`): a served
    /// read holds exactly its own chunk of the source, a failed one is
    /// among `typed`; then refills the destination, watches it, and
    /// asserts no byte changed. Answers how many were served.
    fn check(
        &self,
        c: usize,
        answers: &[Result<(), RdmaError>],
        typed: fn(&RdmaError) -> bool,
    ) -> usize {
        let landed = self.dsts[c].snapshot();
        let source = self.src.snapshot();
        for (chunk, answer) in answers.iter().enumerate() {
            let range = chunk * CHUNK..(chunk + 1) * CHUNK;
            match answer {
                Ok(()) => assert_eq!(
                    landed[range.clone()],
                    source[range],
                    "read {chunk} answered Ok without its own bytes"
                ),
                Err(err) => assert!(typed(err), "read {chunk} answered {err:?}"),
            }
        }
        eprintln!("consumer {c}: {}; {}", tally(answers), resend_story());
        self.untouched_after_refill(c);
        answers.iter().filter(|answer| answer.is_ok()).count()
    }

    /// Refills consumer `c`'s destination, watches it, and asserts no
    /// byte changed.
    fn untouched_after_refill(&self, c: usize) {
        self.dsts[c].fill(REFILL);
        std::thread::sleep(WATCH);
        let changed: Vec<usize> = self.dsts[c]
            .snapshot()
            .iter()
            .enumerate()
            .filter(|&(_, &b)| b != REFILL)
            .map(|(i, _)| i)
            .collect();
        assert!(
            changed.is_empty(),
            "bytes landed in consumer {c}'s destination after its reads answered (or its unmap confirmed): {} bytes from offset {:?}",
            changed.len(),
            changed.first()
        );
    }

    /// Unmaps everything, shuts every engine down, and asserts no
    /// registration is left.
    fn finish(mut self) {
        let mut unmapped: Vec<Result<(), RdmaError>> = Vec::new();
        for (consumer, region) in self.consumers.iter().zip(&self.dst_regions) {
            if consumer.live_registrations() > 0 {
                unmapped.push(
                    self.rt
                        .block_on(consumer.backend().unmap(region.backend_region_id)),
                );
            }
        }
        if let Some(owner) = &self.owner {
            unmapped.push(
                self.rt
                    .block_on(owner.backend().unmap(self.src_region.backend_region_id)),
            );
        }
        let mut live = 0;
        for consumer in &self.consumers {
            consumer.shutdown_blocking();
            live += consumer.live_registrations();
        }
        if let Some(owner) = self.owner.take() {
            owner.shutdown_blocking();
            live += owner.live_registrations();
        }
        let all = unmapped.iter().all(Result::is_ok) && live == 0;
        for dst in self.dsts {
            dst.free_after(all);
        }
        self.src.free_after(all);
        assert!(unmapped.iter().all(Result::is_ok), "unmaps {unmapped:?}");
        assert_eq!(live, 0, "registrations left");
    }
}

fn timeout_or_backend(err: &RdmaError) -> bool {
    matches!(err, RdmaError::Timeout | RdmaError::Backend(_))
}

fn any_answer_of_teardown(err: &RdmaError) -> bool {
    matches!(
        err,
        RdmaError::Timeout | RdmaError::Backend(_) | RdmaError::ShuttingDown
    )
}

fn deadlines(deadline: Duration) -> Vec<Duration> {
    vec![deadline; CHUNKS]
}

/// Batch answers, in read order.
type ReadTask = tokio::task::JoinHandle<Vec<Result<(), RdmaError>>>;

/// Runs `round` once per delay, each on a new cluster whose owner forgot
/// consumer 0 just as that consumer started reads with 2 s deadlines,
/// `delay_us` into them: before the sends fail, while the cancelled
/// receives are pending, after the resends. The cluster is finished (and
/// checked to hold nothing) after each round.
fn each_delay_into_pending_resends(mut round: impl FnMut(&Cluster, ReadTask, u64)) {
    for delay_us in [0u64, 300, 1_000, 3_000, 10_000] {
        let cluster = Cluster::new(2, 3);
        cluster.forget(0);
        let task = cluster.start(0, &deadlines(Duration::from_secs(2)));
        std::thread::sleep(Duration::from_micros(delay_us));
        round(&cluster, task, delay_us);
        cluster.finish();
    }
}

#[test]
fn many_concurrent_reads_to_a_forgotten_owner_each_land_only_their_own_bytes_and_nothing_after_their_answers()
 {
    with_connection_cleanup(
        "many_concurrent_reads_to_a_forgotten_owner_each_land_only_their_own_bytes_and_nothing_after_their_answers",
        || {
            let cluster = Cluster::new(2, 3);
            let before = resends();
            let mut served = 0;
            let mut asked = 0;
            for _ in 0..4 {
                cluster.forget(0);
                let deadline = Duration::from_secs(2);
                let started = Instant::now();
                let task = cluster.start(0, &deadlines(deadline));
                let answers = cluster.wait(task, deadline + Duration::from_secs(3));
                assert!(started.elapsed() < deadline + Duration::from_secs(3));
                served += cluster.check(0, &answers, timeout_or_backend);
                asked += answers.len();
            }
            let sent_again = resends() - before;
            eprintln!("served {served} of {asked}; requests sent again: {sent_again}");
            // Most are served: the resend makes the closed connection no
            // reason to fail.
            assert!(served * 4 > asked * 3, "served {served} of {asked}");
            cluster.finish();
        },
    );
}

#[test]
fn reads_whose_deadline_passes_while_their_resend_is_pending_answer_by_it_and_nothing_lands_after()
{
    with_connection_cleanup(
        "reads_whose_deadline_passes_while_their_resend_is_pending_answer_by_it_and_nothing_lands_after",
        || {
            let cluster = Cluster::new(2, 3);
            let before = resends();
            for round in 0..6u64 {
                cluster.forget(0);
                // Deadlines from 200 µs to 30 ms, spread over the batch:
                // some pass before, some while, some after the resend.
                let deadlines: Vec<Duration> = (0..CHUNKS as u64)
                    .map(|k| Duration::from_micros(200 + (k * 937 + round * 311) % 30_000))
                    .collect();
                let started = Instant::now();
                let task = cluster.start(0, &deadlines);
                let answers = cluster.wait(task, Duration::from_secs(3));
                assert!(started.elapsed() < Duration::from_secs(3));
                cluster.check(0, &answers, |err| {
                    matches!(err, RdmaError::Timeout | RdmaError::Backend(_))
                });
            }
            eprintln!("requests sent again: {}", resends() - before);
            cluster.finish();
        },
    );
}

#[test]
fn shutting_a_consumer_down_while_its_resends_are_pending_answers_every_read_and_nothing_lands_after()
 {
    with_connection_cleanup(
        "shutting_a_consumer_down_while_its_resends_are_pending_answers_every_read_and_nothing_lands_after",
        || {
            each_delay_into_pending_resends(|cluster, task, delay_us| {
                let started = Instant::now();
                cluster.consumers[0].shutdown_blocking();
                let answers = cluster.wait(task, Duration::from_secs(5));
                assert!(started.elapsed() < Duration::from_secs(5));
                eprintln!("shut down after {delay_us} µs:");
                cluster.check(0, &answers, any_answer_of_teardown);
                assert_eq!(
                    cluster.consumers[0].live_registrations(),
                    0,
                    "the shut-down consumer left its destination registered"
                );
            });
        },
    );
}

#[test]
fn unmapping_the_destination_while_resends_are_pending_confirms_only_once_nothing_can_land() {
    with_connection_cleanup(
        "unmapping_the_destination_while_resends_are_pending_confirms_only_once_nothing_can_land",
        || {
            each_delay_into_pending_resends(|cluster, task, delay_us| {
                let id = cluster.dst_regions[0].backend_region_id;
                let unmapped = cluster
                    .rt
                    .block_on(cluster.consumers[0].backend().unmap(id));
                assert_eq!(unmapped, Ok(()));
                // Confirmed: nothing may write the destination any more.
                eprintln!("unmapped after {delay_us} µs: {}", resend_story());
                cluster.untouched_after_refill(0);
                let answers = cluster.wait(task, Duration::from_secs(1));
                assert!(
                    // (A read submitted after the unmap began finds no
                    // region.)
                    answers.iter().all(|answer| match answer {
                        Ok(()) => true,
                        Err(RdmaError::RegionNotFound) => true,
                        Err(err) => timeout_or_backend(err),
                    }),
                    "answers {answers:?}"
                );
                eprintln!("answers {}", tally(&answers));
                assert_eq!(cluster.consumers[0].live_registrations(), 0);
            });
        },
    );
}

#[test]
fn an_owner_shut_down_around_the_failed_send_and_its_resend_gives_typed_errors_by_the_deadline() {
    with_connection_cleanup(OWNER_SHUT_DOWN_AROUND_THE_FAILED_SEND, || {
        let mut cluster = Cluster::new(2, 3);
        let before = resends();
        cluster.forget(0);
        // The owner goes while the batch's requests fail and are sent
        // again.
        // (Its source stays mapped: teardown deregisters it.)
        let owner = cluster.owner.take().expect("the owner");
        let deadline = Duration::from_millis(1500);
        let started = Instant::now();
        let task = cluster.start(0, &deadlines(deadline));
        let stopper = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_micros(200));
            owner.shutdown_blocking();
            owner.live_registrations()
        });
        let answers = cluster.wait(task, deadline + Duration::from_secs(3));
        assert!(started.elapsed() < deadline + Duration::from_secs(3));
        assert_eq!(stopper.join().expect("the owner's shutdown"), 0);
        cluster.check(0, &answers, timeout_or_backend);
        // Reads after the owner is gone fail, typed, by their deadline.
        let started = Instant::now();
        let task = cluster.start(0, &deadlines(deadline));
        let answers = cluster.wait(task, deadline + Duration::from_secs(3));
        assert!(started.elapsed() < deadline + Duration::from_secs(3));
        assert!(
            answers.iter().all(Result::is_err),
            "served by a shut-down owner: {answers:?}"
        );
        cluster.check(0, &answers, timeout_or_backend);
        eprintln!("requests sent again: {}", resends() - before);
        cluster.finish();
    });
}

#[test]
fn reads_whose_resends_land_on_connections_closed_again_answer_typed_and_nothing_lands_after() {
    with_connection_cleanup(
        "reads_whose_resends_land_on_connections_closed_again_answer_typed_and_nothing_lands_after",
        || {
            // One address kept, three consumers reading at once: each
            // request of one may make the owner forget another.
            let cluster = Cluster::new(1, 3);
            let before = resends();
            let deadline = Duration::from_secs(2);
            let mut served = 0;
            let mut asked = 0;
            for _ in 0..6 {
                let started = Instant::now();
                let tasks: Vec<_> = (0..3)
                    .map(|c| cluster.start(c, &deadlines(deadline)))
                    .collect();
                let answers: Vec<Vec<Result<(), RdmaError>>> = tasks
                    .into_iter()
                    .map(|task| cluster.wait(task, deadline + Duration::from_secs(3)))
                    .collect();
                assert!(started.elapsed() < deadline + Duration::from_secs(3));
                for (c, answers) in answers.iter().enumerate() {
                    served += cluster.check(c, answers, timeout_or_backend);
                    asked += answers.len();
                }
            }
            eprintln!(
                "served {served} of {asked}; requests sent again: {}",
                resends() - before
            );
            cluster.finish();
        },
    );
}

#[test]
fn reads_from_an_owner_that_keeps_closing_their_connection_answer_typed_by_the_deadline_and_nothing_lands_after()
 {
    with_connection_cleanup(
        "reads_from_an_owner_that_keeps_closing_their_connection_answer_typed_by_the_deadline_and_nothing_lands_after",
        || {
            // A raw owner that never answers and closes the consumer's
            // connection every millisecond (removing its address, with
            // FI_AV_REMOVE_CLEANUP set): requests find it closed again and
            // again, resends run out.
            let mut setup = HostileOwnerSetup::new(Provider::Tcp, LEN);
            let consumer_address = setup.consumer.fabric_address();
            let exhausted_before = logged("it was sent again on a new connection");
            let before = resends();
            let deadline = Duration::from_secs(1);
            for _ in 0..4 {
                let started = Instant::now();
                let reads: Vec<_> = (0..CHUNKS)
                    .map(|chunk| {
                        let request = get(
                            PeerId(1),
                            &setup.key,
                            0x10_0000 + (chunk * CHUNK) as u64,
                            &setup.dst_region,
                            (chunk * CHUNK) as u64,
                            CHUNK as u64,
                            deadline,
                        );
                        let backend: OfiBackend = setup.consumer.backend();
                        setup.rt.spawn(async move {
                            // SAFETY: nothing touches the destination until
                            // every read answered.
                            unsafe { backend.get(request) }.await
                        })
                    })
                    .collect();
                let until = started + deadline + Duration::from_secs(3);
                while !reads.iter().all(|read| read.is_finished()) && Instant::now() < until {
                    setup.owner.fabric.remove_peer(setup.to_consumer);
                    setup.to_consumer = setup.owner.insert(&consumer_address);
                    setup.owner.progress_for(Duration::from_millis(1));
                }
                assert!(
                    reads.iter().all(|read| read.is_finished()),
                    "every read answered by its deadline and 3 s"
                );
                let answers: Vec<Result<(), RdmaError>> = reads
                    .into_iter()
                    .map(|read| setup.rt.block_on(read).expect("a read task"))
                    .collect();
                eprintln!("answers {}; {}", tally(&answers), resend_story());
                assert!(
                    answers
                        .iter()
                        .all(|answer| matches!(answer, Err(err) if timeout_or_backend(err))),
                    "an owner that never answers served or answered otherwise: {answers:?}"
                );
                let untouched = setup.untouched_after(|owner, _| {
                    owner.progress_for(WATCH);
                });
                assert!(untouched, "bytes landed after every read answered");
            }
            eprintln!(
                "requests sent again: {}, reads whose resends ran out: {}",
                resends() - before,
                logged("it was sent again on a new connection") - exhausted_before
            );
            setup.finish();
        },
    );
}
