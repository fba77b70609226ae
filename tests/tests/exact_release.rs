//! Exact release across two processes: once the owner's release of a
//! region has resolved (`unregister_owned` gave the buffer back, a lent
//! pool buffer was withdrawn, a freed one's unmap was confirmed), a
//! consumer's read of a descriptor it still holds answers an error — never
//! `Ok`, never the bytes the owner wrote there since.
//!
//! Each scenario runs on [`Transport::Auto`] (the default) and
//! [`Transport::SameHost`], whose engines open the same-host direct-read
//! lane, and on [`Transport::Tcp`], where the owner serves every read. The
//! test process is the consumer; it starts this test binary again, filtered
//! to the same test, as the owner ([`Owner`]), which takes one command a
//! line on stdin and answers on stdout.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use rdmareg::{Config, DescribedBuf, Descriptor, PeerId, PinnedBuf, Rdma, RdmaError, Transport};

/// Set in the owner's process to the transport it runs on.
const OWNER_ROLE: &str = "RDMAREG_EXACT_RELEASE_OWNER";
/// What starts the owner's answers on stdout (libtest prints there too).
const ANSWER: &str = "owner: ";
const OWNER_PEER: PeerId = PeerId(1);
const LIMIT: Duration = Duration::from_secs(10);
/// The owner's bytes while described.
const LIVE: u8 = 0x11;
/// What the owner writes into memory once its release resolved.
const NEW: u8 = 0xDD;

/// `name::over_auto`, `name::over_same_host` and `name::over_tcp` for
/// each `async fn name(transport: Transport)`.
macro_rules! per_transport {
    ($($scenario:ident),+ $(,)?) => {$(
        mod $scenario {
            use super::*;
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn over_auto() {
                run(concat!(stringify!($scenario), "::over_auto"), Transport::Auto, super::$scenario).await;
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn over_same_host() {
                run(concat!(stringify!($scenario), "::over_same_host"), Transport::SameHost, super::$scenario).await;
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn over_tcp() {
                run(concat!(stringify!($scenario), "::over_tcp"), Transport::Tcp, super::$scenario).await;
            }
        }
    )+};
}

per_transport!(
    unregistered_blocks_read_nothing_alone_or_listed,
    a_withdrawn_pool_buffer_reads_nothing_once_redescribed,
    a_freed_pool_buffer_reads_nothing_once_reused,
    reads_racing_an_unregister_never_see_new_bytes,
);

fn transport_name(transport: &Transport) -> &'static str {
    match transport {
        Transport::Auto => "auto",
        Transport::SameHost => "same-host",
        Transport::Tcp => "tcp",
        other => panic!("no name for {other:?}"),
    }
}

fn transport_named(name: &str) -> Transport {
    match name {
        "auto" => Transport::Auto,
        "same-host" => Transport::SameHost,
        "tcp" => Transport::Tcp,
        other => panic!("unknown transport {other:?}"),
    }
}

fn config(transport: Transport) -> Config {
    Config::new()
        .with_transport(transport)
        .with_net_devices("lo")
        .with_get_deadline(LIMIT)
}

/// In the owner's process, play the owner; else start one and run
/// `scenario` as its consumer.
async fn run<F, Fut>(test: &str, transport: Transport, scenario: F)
where
    F: FnOnce(Consumer) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    if let Ok(role) = std::env::var(OWNER_ROLE) {
        owner_main(transport_named(&role)).await;
        return;
    }
    let owner = Owner::spawn(test, &transport);
    let rdma = Rdma::start(config(transport.clone())).expect("the consumer starts");
    rdma.add_peer(OWNER_PEER, owner.address.clone())
        .expect("the consumer records the owner");
    let consumer = Consumer {
        transport,
        rdma,
        owner,
    };
    scenario(consumer).await;
}

// ---------------------------------------------------------------- owner --

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(text: &str) -> Vec<u8> {
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&text[i..i + 2], 16).expect("hex"))
        .collect()
}

fn answer(line: &str) {
    let mut out = std::io::stdout().lock();
    writeln!(out, "{ANSWER}{line}").unwrap();
    out.flush().unwrap();
}

/// The owner: one command a line on stdin, until stdin closes.
///
/// - `blocks N LEN`: register N owned blocks of LEN bytes of [`LIVE`];
///   answers their descriptors.
/// - `release`: `unregister_owned` every block, then write [`NEW`] into the
///   buffers it got back (kept); answers `released`.
/// - `lend LEN`: a pool buffer of [`LIVE`], described; answers its
///   descriptor.
/// - `redescribe`: withdraw it, write [`NEW`], describe it again; answers
///   the new descriptor.
/// - `free-and-reuse`: drop it, allocate until a buffer lands on its
///   granules, write [`NEW`] there (nobody describes it); answers `reused`.
/// - `round BYTE LEN`: register one owned block of LEN bytes of BYTE;
///   answers its descriptor.
/// - `free`: `unregister_owned` that block, then write [`NEW`] over it a
///   few times; answers `freed`.
async fn owner_main(transport: Transport) {
    let rdma = Rdma::start(config(transport)).expect("the owner starts");
    answer(&format!("address {}", hex(&rdma.worker_address())));
    let (lines_tx, mut lines) = tokio::sync::mpsc::unbounded_channel();
    std::thread::spawn(move || {
        for line in std::io::stdin().lock().lines() {
            let Ok(line) = line else { break };
            if lines_tx.send(line).is_err() {
                break;
            }
        }
    });
    let mut blocks = Vec::new();
    let mut kept: Vec<Box<[u8]>> = Vec::new();
    let mut lent: Option<DescribedBuf> = None;
    let mut reused: Option<PinnedBuf> = None;
    let mut round = None;
    while let Some(line) = lines.recv().await {
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            [] => {}
            ["blocks", count, len] => {
                let (count, len): (usize, usize) = (count.parse().unwrap(), len.parse().unwrap());
                let mut descriptors = Vec::new();
                for _ in 0..count {
                    let guard = rdma
                        .register_owned(vec![LIVE; len].into_boxed_slice())
                        .await
                        .expect("registered");
                    descriptors.push(hex(&guard.descriptor().unwrap().encode()));
                    blocks.push(guard);
                }
                answer(&format!("descriptors {}", descriptors.join(" ")));
            }
            ["release"] => {
                for guard in blocks.drain(..) {
                    let (mut buffer, _) = guard.unregister_owned(LIMIT).await.expect("released");
                    buffer.fill(NEW);
                    kept.push(buffer);
                }
                answer("released");
            }
            ["lend", len] => {
                let mut buf = rdma.alloc_pinned(len.parse().unwrap()).await.unwrap();
                buf.fill(LIVE);
                let described = buf.describe().await.expect("described");
                answer(&format!(
                    "descriptor {}",
                    hex(&described.descriptor().encode())
                ));
                lent = Some(described);
            }
            ["redescribe"] => {
                let mut buf = lent.take().unwrap().withdraw().await.expect("withdrawn");
                buf.fill(NEW);
                let described = buf.describe().await.expect("described again");
                answer(&format!(
                    "descriptor {}",
                    hex(&described.descriptor().encode())
                ));
                lent = Some(described);
            }
            ["free-and-reuse"] => {
                let old = lent.take().unwrap();
                let (addr, len) = (old.as_ptr() as usize, old.len());
                drop(old);
                for _ in 0..400 {
                    let candidate = rdma.alloc_pinned(len).await.unwrap();
                    if candidate.as_ptr() as usize == addr {
                        reused = Some(candidate);
                        break;
                    }
                    drop(candidate);
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                let buf = reused
                    .as_mut()
                    .expect("the freed granules serve a new buffer");
                buf.fill(NEW);
                answer("reused");
            }
            ["round", byte, len] => {
                let (byte, len): (u8, usize) = (byte.parse().unwrap(), len.parse().unwrap());
                let guard = rdma
                    .register_owned(vec![byte; len].into_boxed_slice())
                    .await
                    .expect("registered");
                answer(&format!(
                    "descriptor {}",
                    hex(&guard.descriptor().unwrap().encode())
                ));
                round = Some(guard);
            }
            ["free"] => {
                let guard = round.take().unwrap();
                let (mut buffer, _) = guard.unregister_owned(LIMIT).await.expect("released");
                for _ in 0..8 {
                    buffer.fill(NEW);
                    tokio::task::yield_now().await;
                }
                answer("freed");
                kept.push(buffer);
                // Freed memory goes back to the allocator now and then.
                if kept.len() > 4 {
                    kept.remove(0);
                }
            }
            other => panic!("unknown owner command {other:?}"),
        }
    }
    drop((blocks, kept, lent, reused, round));
    let summary = rdma.shutdown().await;
    assert!(summary.is_clean(), "{summary:?}");
}

/// The owner process, as the consumer drives it.
struct Owner {
    child: Child,
    stdin: ChildStdin,
    answers: mpsc::Receiver<String>,
    address: bytes::Bytes,
}

impl Owner {
    fn spawn(test: &str, transport: &Transport) -> Owner {
        let mut child = Command::new(std::env::current_exe().expect("the test binary"))
            .args([test, "--exact", "--nocapture", "--test-threads", "1"])
            .env(OWNER_ROLE, transport_name(transport))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("the owner process starts");
        let stdin = child.stdin.take().unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, answers) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                // libtest may have begun the line with the test's name.
                if let Some(at) = line.find(ANSWER) {
                    if tx.send(line[at + ANSWER.len()..].to_owned()).is_err() {
                        break;
                    }
                }
            }
        });
        let mut owner = Owner {
            child,
            stdin,
            answers,
            address: bytes::Bytes::new(),
        };
        let address = owner.next("address");
        owner.address = unhex(&address).into();
        owner
    }

    /// The next answer, which must start with `word`; its rest.
    fn next(&mut self, word: &str) -> String {
        let line = self
            .answers
            .recv_timeout(Duration::from_secs(60))
            .unwrap_or_else(|_| panic!("the owner did not answer {word:?}"));
        let rest = line
            .strip_prefix(word)
            .unwrap_or_else(|| panic!("expected {word:?} from the owner, got {line:?}"));
        rest.trim().to_owned()
    }

    fn tell(&mut self, command: &str) {
        writeln!(self.stdin, "{command}").expect("the owner takes commands");
        self.stdin.flush().unwrap();
    }

    /// Send `command` and wait for the answer starting with `word`.
    fn ask(&mut self, command: &str, word: &str) -> String {
        self.tell(command);
        self.next(word)
    }

    fn descriptor(&mut self, command: &str) -> Descriptor {
        let text = self.ask(command, "descriptor");
        Descriptor::decode(&unhex(&text)).expect("a descriptor")
    }

    /// Closes stdin and waits for the owner's clean shutdown.
    fn finish(self) {
        let Owner {
            mut child, stdin, ..
        } = self;
        drop(stdin);
        let status = child.wait().expect("the owner exits");
        assert!(status.success(), "the owner failed: {status}");
    }
}

// ------------------------------------------------------------- consumer --

struct Consumer {
    transport: Transport,
    rdma: Rdma,
    owner: Owner,
}

impl Consumer {
    /// Reads `descriptor` into a buffer of [`NEW`]'s complement: the answer
    /// and the bytes.
    async fn read(&self, descriptor: &Descriptor) -> (Result<(), RdmaError>, PinnedBuf) {
        let mut buf = self
            .rdma
            .alloc_pinned(descriptor.len() as usize)
            .await
            .unwrap();
        buf.fill(!NEW);
        let answer = self.rdma.get(OWNER_PEER, descriptor, &mut buf).await;
        (answer, buf)
    }

    /// Whether this transport's engines open the same-host direct-read
    /// lane, whose copies the scenarios must have exercised.
    fn direct(&self) -> bool {
        !matches!(self.transport, Transport::Tcp)
    }

    async fn finish(self) {
        let summary = self.rdma.shutdown().await;
        assert!(summary.is_clean(), "{summary:?}");
        self.owner.finish();
    }
}

/// A read after the release: an error, and none of the owner's new bytes.
fn assert_refused(transport: &Transport, what: &str, answer: &Result<(), RdmaError>, bytes: &[u8]) {
    assert!(
        answer.is_err(),
        "{transport:?}: {what}: a stale descriptor read Ok"
    );
    assert!(
        !bytes.contains(&NEW),
        "{transport:?}: {what}: the owner's new bytes arrived ({answer:?})"
    );
}

/// 64 owned blocks read alone, in a one-shot list, and in a list posted
/// again (the engine's copy plan); the owner unregisters them and writes
/// new bytes; every read of the old descriptors, alone or listed, answers
/// `RegionNotFound`.
async fn unregistered_blocks_read_nothing_alone_or_listed(mut consumer: Consumer) {
    const BLOCKS: usize = 64;
    const LEN: usize = 4096;
    let transport = consumer.transport.clone();
    let text = consumer
        .owner
        .ask(&format!("blocks {BLOCKS} {LEN}"), "descriptors");
    let descriptors: Vec<Descriptor> = text
        .split_whitespace()
        .map(|d| Descriptor::decode(&unhex(d)).expect("a descriptor"))
        .collect();
    assert_eq!(descriptors.len(), BLOCKS);
    let mut list = consumer.rdma.transfer_list(OWNER_PEER);
    for (i, descriptor) in descriptors.iter().enumerate() {
        list.push(descriptor, 0, i * LEN).unwrap();
    }
    let mut buffers = vec![consumer.rdma.alloc_pinned(BLOCKS * LEN).await.unwrap()];
    for descriptor in &descriptors {
        let (answer, bytes) = consumer.read(descriptor).await;
        assert_eq!(answer, Ok(()), "{transport:?}: a live block reads");
        assert!(bytes.iter().all(|&b| b == LIVE));
    }
    for _ in 0..2 {
        let answers = consumer.rdma.post(&list, &mut buffers).await.unwrap();
        assert!(answers.iter().all(Result::is_ok), "{answers:?}");
        assert!(buffers[0].iter().all(|&b| b == LIVE));
    }
    // The live reads took the direct lane where there is one: copied on
    // this thread (all but the first, which makes the engine publish the
    // owner for such copies), and the list by the engine's copy plan.
    let engine = consumer.rdma.engine();
    assert_eq!(
        engine.reads_copied_on_caller_threads() > 0,
        consumer.direct(),
        "{transport:?}: caller copies"
    );
    assert_eq!(
        engine.lists_copied_by_plan() >= 1,
        consumer.direct(),
        "{transport:?}: copy plans"
    );

    consumer.owner.ask("release", "released");
    for (i, descriptor) in descriptors.iter().enumerate() {
        let (answer, bytes) = consumer.read(descriptor).await;
        assert_refused(&transport, &format!("block {i}"), &answer, &bytes);
        assert_eq!(answer, Err(RdmaError::RegionNotFound), "{transport:?}");
    }
    // The list posted again, then as a fresh one-shot list.
    buffers[0].fill(!NEW);
    let answers = consumer.rdma.post(&list, &mut buffers).await.unwrap();
    assert!(
        answers.iter().all(|a| *a == Err(RdmaError::RegionNotFound)),
        "{transport:?}: a reposted list of released blocks answered {answers:?}"
    );
    assert!(
        !buffers[0].contains(&NEW),
        "{transport:?}: new bytes arrived"
    );
    let reads: Vec<(&Descriptor, usize, usize)> = descriptors
        .iter()
        .enumerate()
        .map(|(i, d)| (d, 0, i * LEN))
        .collect();
    buffers[0].fill(!NEW);
    let answers = consumer
        .rdma
        .get_many(OWNER_PEER, &reads, &mut buffers)
        .await
        .unwrap();
    assert!(
        answers.iter().all(|a| *a == Err(RdmaError::RegionNotFound)),
        "{transport:?}: a list of released blocks answered {answers:?}"
    );
    assert!(
        !buffers[0].contains(&NEW),
        "{transport:?}: new bytes arrived"
    );
    drop(buffers);
    consumer.finish().await;
}

/// A pool buffer lent, withdrawn, rewritten and lent again: the first
/// descriptor reads nothing, the second reads the new bytes.
async fn a_withdrawn_pool_buffer_reads_nothing_once_redescribed(mut consumer: Consumer) {
    let transport = consumer.transport.clone();
    let first = consumer.owner.descriptor("lend 16384");
    let (answer, bytes) = consumer.read(&first).await;
    assert_eq!(answer, Ok(()));
    assert!(bytes.iter().all(|&b| b == LIVE));
    let second = consumer.owner.descriptor("redescribe");
    assert_eq!(
        second.addr(),
        first.addr(),
        "the same bytes, described again"
    );
    let (answer, bytes) = consumer.read(&first).await;
    assert_refused(
        &transport,
        "a withdrawn buffer's old descriptor",
        &answer,
        &bytes,
    );
    let (answer, bytes) = consumer.read(&second).await;
    assert_eq!(answer, Ok(()), "{transport:?}: the new descriptor reads");
    assert!(bytes.iter().all(|&b| b == NEW));
    consumer.finish().await;
}

/// A lent pool buffer freed, its granules given to a buffer nobody
/// described: the freed buffer's descriptor reads nothing.
async fn a_freed_pool_buffer_reads_nothing_once_reused(mut consumer: Consumer) {
    let transport = consumer.transport.clone();
    let descriptor = consumer.owner.descriptor("lend 16384");
    let (answer, _) = consumer.read(&descriptor).await;
    assert_eq!(answer, Ok(()));
    consumer.owner.ask("free-and-reuse", "reused");
    let (answer, bytes) = consumer.read(&descriptor).await;
    assert_refused(&transport, "a freed buffer's descriptor", &answer, &bytes);
    consumer.finish().await;
}

/// Rounds of: the owner registers a block of a byte of its own, the
/// consumer reads it over and over while the owner unregisters it and
/// writes new bytes. Every read answers `Ok` with the round's bytes, or an
/// error that left none of the new bytes; once the owner said the block is
/// freed, every read is an error.
async fn reads_racing_an_unregister_never_see_new_bytes(mut consumer: Consumer) {
    const ROUNDS: usize = 2000;
    const LEN: usize = 256 * 1024;
    /// A slice small enough to be copied on the caller's thread.
    const SLICE: usize = 32 * 1024;
    let transport = consumer.transport.clone();
    let mut whole = consumer.rdma.alloc_pinned(LEN).await.unwrap();
    let mut part = consumer.rdma.alloc_pinned(SLICE).await.unwrap();
    let (mut ok, mut refused) = (0usize, 0usize);
    for round in 0..ROUNDS {
        let byte = (round % 200) as u8 + 1;
        let descriptor = consumer.owner.descriptor(&format!("round {byte} {LEN}"));
        let slice = descriptor.slice((LEN / 4) as u64, SLICE as u64).unwrap();
        if round % 16 == 0 {
            // Now and then a read before the release starts: it lands.
            let answer = consumer.rdma.get(OWNER_PEER, &slice, &mut part).await;
            assert_eq!(answer, Ok(()), "{transport:?}: round {round}: a live read");
            assert!(part.iter().all(|&b| b == byte));
            ok += 1;
        }
        consumer.owner.tell("free");
        let mut freed = false;
        let mut after_freed = 0;
        let mut reads = 0usize;
        while after_freed < 2 {
            reads += 1;
            // Alternately the whole block (copied by the engine's thread)
            // and a slice (copied on this thread, on the direct lane).
            let (src, buf) = if reads % 2 == 0 {
                (&descriptor, &mut whole)
            } else {
                (&slice, &mut part)
            };
            buf.fill(!NEW);
            let answer = consumer.rdma.get(OWNER_PEER, src, buf).await;
            match answer {
                Ok(()) => {
                    assert!(
                        !freed,
                        "{transport:?}: round {round}: a read after the release answered Ok"
                    );
                    assert!(
                        buf.iter().all(|&b| b == byte),
                        "{transport:?}: round {round}: a read answered Ok with bytes not of the live registration (new bytes: {})",
                        buf.contains(&NEW)
                    );
                    ok += 1;
                }
                Err(_) => {
                    assert!(
                        !buf.contains(&NEW),
                        "{transport:?}: round {round}: a refused read left the new bytes"
                    );
                    refused += 1;
                }
            }
            if freed {
                after_freed += 1;
            } else if let Ok(line) = consumer.owner.answers.try_recv() {
                assert_eq!(line, "freed");
                freed = true;
            }
        }
    }
    eprintln!("{transport:?}: {ok} reads Ok, {refused} refused over {ROUNDS} rounds");
    assert_eq!(
        consumer.rdma.engine().reads_copied_on_caller_threads() > 0,
        consumer.direct(),
        "{transport:?}: caller copies"
    );
    drop((whole, part));
    consumer.finish().await;
}
