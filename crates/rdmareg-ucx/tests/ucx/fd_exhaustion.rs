//! An owner that runs out of file descriptors keeps accepting consumers
//! once descriptors are free again, and idle connections cannot hold its
//! descriptors for ever.
//!
//! UCX 1.22.0's tcp interface closes its listening socket for good on an
//! `accept()` that fails with `EMFILE`, and keeps every accepted socket
//! until its peer closes it, whether or not the peer ever speaks. The UCX
//! that `cargo xtask ucx --from-source` builds carries a patch
//! (`crates/rdmareg-ucx-src/patches/0005-…`) under which the interface
//! pauses accepting on a resource error and polls its listener again after
//! a back-off, and shuts down accepted sockets whose peer has not completed
//! the connection handshake within `UCX_TCP_ACCEPT_HANDSHAKE_TIMEOUT`.
//!
//! Each test runs the owner in a child process (this binary again, in the
//! owner role) whose `RLIMIT_NOFILE` is lowered to a few hundred, soft and
//! hard, so that it runs out quickly; the test process exhausts the
//! owner's descriptors, watching their count in `/proc/<pid>/fd`, and ends
//! with a new consumer engine reading the owner's buffer. Against an
//! unpatched UCX each test fails: the consumer's connection is refused.
//! Each test also runs in a process of its own (`in_own_process`): the
//! hundreds of connections one test opens would otherwise use up the
//! descriptors of the tests beside it under `cargo test`.

use crate::common;

use rdmareg_backend::own_process::in_own_process;

use std::fs;
use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::child_process::{CHILD_ROLE, is_child, test_path};
use common::sockets::own_listening_ports;
use common::*;
use rdmareg_backend::RdmaBackend;
use rdmareg_core::{Descriptor, RdmaError};
use rdmareg_ucx::{Transport, UcxEngine, build_info};

/// The owner's open-file limit, soft and hard.
const LIMIT: u64 = 256;
/// Bytes the owner serves.
const SIZE: usize = 64 * 1024;
/// How long a consumer's read may take once descriptors are free again:
/// the listener's longest back-off is a second.
const READ_DEADLINE: Duration = Duration::from_secs(15);
/// The child's soft limit (`LIMIT` when unset).
const CHILD_SOFT: &str = "RDMAREG_FDX_SOFT";

/// The owner role: lower the open-file limit, start an engine over tcp,
/// serve a buffer of the pattern, announce it and its limits, and serve
/// until stdin closes.
fn owner_main() {
    let soft: u64 = std::env::var(CHILD_SOFT).map_or(LIMIT, |v| v.parse().expect("soft limit"));
    let limit = libc::rlimit {
        rlim_cur: soft,
        rlim_max: LIMIT,
    };
    // SAFETY: `limit` is a valid rlimit; lowering limits needs no privilege
    // and affects only this child process.
    let set = unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &limit) };
    assert_eq!(set, 0, "setrlimit: {}", std::io::Error::last_os_error());
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .try_init();
    // Listening sockets this process inherited (under `cargo test`, other
    // tests' engines in the harness's process) are not its engine's.
    let inherited = own_listening_ports();
    let buf = PageBuf::filled(SIZE, pattern);
    let engine = UcxEngine::start(config(Transport::Tcp)).expect("owner engine starts");
    let runtime = runtime();
    let region = runtime.block_on(map(&engine.backend(), &buf));
    let raised = build_info::raise_open_file_limit().expect("the limit was read");
    let now = build_info::open_file_limit().expect("the limit is read");
    let ports: Vec<String> = own_listening_ports()
        .difference(&inherited)
        .map(u16::to_string)
        .collect();
    println!(
        "READY {} {} {} {} {} {}",
        hex(&engine.worker_address()),
        hex(&describe(&buf, &region).encode()),
        ports.join(","),
        raised.before.soft,
        now.soft,
        now.hard,
    );
    std::io::stdout().flush().unwrap();
    let mut line = String::new();
    while std::io::stdin().read_line(&mut line).is_ok_and(|n| n > 0) {
        line.clear();
    }
    drop(engine);
    drop(buf);
}

/// In the test `name`'s own process, starts its owner process with `env`
/// set and returns it; in that owner process (started by [`Owner::start`]),
/// serves as the owner and returns `None`.
fn owner_for(name: &str, env: &[(&str, &str)]) -> Option<Owner> {
    if is_child(name) {
        owner_main();
        return None;
    }
    init_tracing();
    Some(Owner::start(name, env))
}

/// A running owner process.
struct Owner {
    child: Child,
    address: Bytes,
    descriptor: Descriptor,
    ports: Vec<u16>,
    /// Its soft limit before its engine started, and both limits after.
    soft_before: u64,
    soft: u64,
    hard: u64,
}

impl Owner {
    /// Starts the owner role of the test `name` with `env` set.
    fn start(name: &str, env: &[(&str, &str)]) -> Owner {
        let mut child = Command::new(std::env::current_exe().expect("the test binary"))
            .args([
                test_path(module_path!(), name).as_str(),
                "--exact",
                "--nocapture",
                "--test-threads",
                "1",
            ])
            .env(CHILD_ROLE, name)
            .envs(env.iter().copied())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("the owner process starts");
        let stdout = child.stdout.take().expect("stdout");
        let line = BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
            // libtest's "test <name> ... " precedes it on the same line.
            .find_map(|line| Some(line[line.find("READY ")?..].to_owned()))
            .expect("the owner announces itself");
        let fields: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(fields.len(), 7, "{line}");
        let number = |i: usize| fields[i].parse::<u64>().expect("a limit");
        Owner {
            address: Bytes::from(unhex(fields[1])),
            descriptor: Descriptor::decode(&unhex(fields[2])).expect("a descriptor"),
            ports: fields[3]
                .split(',')
                .map(|p| p.parse().expect("a port"))
                .collect(),
            soft_before: number(4),
            soft: number(5),
            hard: number(6),
            child,
        }
    }

    /// How many file descriptors the owner holds.
    fn open_fds(&self) -> usize {
        fs::read_dir(format!("/proc/{}/fd", self.child.id())).map_or(0, |dir| dir.count())
    }

    /// Asserts that within `patience` the owner holds at most 8 descriptors
    /// more than `baseline` again; `context` ends the failure message.
    fn assert_fds_back(&self, baseline: usize, patience: Duration, context: &str) {
        let (fds, freed) = self.wait_for_fds(patience, |n| n <= baseline + 8);
        assert!(
            freed,
            "the owner still holds {fds} descriptors (had {baseline}){context}"
        );
    }

    /// Waits up to `patience` for `condition` on the owner's descriptor
    /// count; answers the last count seen and whether it held.
    fn wait_for_fds(&self, patience: Duration, condition: impl Fn(usize) -> bool) -> (usize, bool) {
        let until = Instant::now() + patience;
        loop {
            let count = self.open_fds();
            if condition(count) {
                return (count, true);
            }
            if Instant::now() >= until {
                return (count, false);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Opens up to `count` idle tcp connections to the owner's UCX
    /// listeners, round robin (fewer if one is refused: an unpatched UCX
    /// closes its listener when its descriptors run out), and waits until
    /// the owner holds `LIMIT` descriptors less a few; panics if it never
    /// does.
    fn exhaust(&self, count: usize) -> Vec<TcpStream> {
        assert!(!self.ports.is_empty(), "the owner listens on no tcp port");
        let idle: Vec<TcpStream> = (0..count)
            .map_while(|i| TcpStream::connect(("127.0.0.1", self.ports[i % self.ports.len()])).ok())
            .collect();
        let (fds, full) = self.wait_for_fds(Duration::from_secs(10), |n| n as u64 + 4 >= LIMIT);
        assert!(
            full,
            "the owner holds only {fds} descriptors of {LIMIT} after {} of {count} connections",
            idle.len()
        );
        // Let accept() run into the limit with connections still pending.
        std::thread::sleep(Duration::from_millis(300));
        idle
    }

    /// A new consumer engine in this process reads the owner's buffer.
    fn read_by_new_consumer(&self, deadline: Duration) -> Result<(), RdmaError> {
        let consumer = UcxEngine::start(config(Transport::Tcp)).expect("consumer engine starts");
        consumer.add_peer(OWNER, self.address.clone())?;
        let backend = consumer.backend();
        let result = runtime().block_on(async {
            let dest = PageBuf::zeroed(SIZE);
            let region = map(&backend, &dest).await;
            let request = get_request(OWNER, &self.descriptor, &region, 0, Some(deadline));
            let read = backend.get_into_test_memory(request).await;
            let _ = backend.unmap(region.backend_region_id).await;
            read.map(|()| dest.snapshot())
        });
        consumer.shutdown_blocking();
        let bytes = result?;
        assert_eq!(
            differing_bytes(&bytes, &PageBuf::filled(SIZE, pattern).snapshot()),
            0,
            "the consumer read other bytes than the owner serves"
        );
        Ok(())
    }
}

impl Drop for Owner {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The first reproduction: idle connections to the owner's UCX
/// port until its descriptors run out, then closed; a consumer arriving
/// after that is served, where the unpatched UCX refuses it (its listener
/// closed at the first `EMFILE`).
#[test]
fn a_moment_without_fds_leaves_the_listener_open() {
    in_own_process(|| {
        let Some(owner) = owner_for("a_moment_without_fds_leaves_the_listener_open", &[]) else {
            return;
        };
        let baseline = owner.open_fds();
        let idle = owner.exhaust(LIMIT as usize + 64);
        drop(idle);
        owner.assert_fds_back(baseline, Duration::from_secs(10), "");
        owner
            .read_by_new_consumer(READ_DEADLINE)
            .expect("a consumer arriving after the exhaustion reads");
    });
}

/// Idle connections that never complete the UCX handshake are closed by
/// the owner after `UCX_TCP_ACCEPT_HANDSHAKE_TIMEOUT` (2 s here), so a
/// consumer is served while they are still open on the attacker's side,
/// and the owner's descriptors return to where they were.
#[test]
fn idle_connections_are_closed_after_the_bound() {
    in_own_process(|| {
        let Some(owner) = owner_for(
            "idle_connections_are_closed_after_the_bound",
            &[("UCX_TCP_ACCEPT_HANDSHAKE_TIMEOUT", "2s")],
        ) else {
            return;
        };
        let bound = Duration::from_secs(2);
        let baseline = owner.open_fds();
        let idle = owner.exhaust(LIMIT as usize + 64);
        let started = Instant::now();
        owner
            .read_by_new_consumer(READ_DEADLINE)
            .expect("a consumer reads while the idle connections stay open");
        let waited = started.elapsed();
        eprintln!("the consumer read after {waited:?} with the idle connections open");
        // The consumer's connection keeps one descriptor until it is closed.
        owner.assert_fds_back(baseline, 4 * bound, " with idle connections open");
        assert!(
            waited < 2 * bound + Duration::from_secs(3),
            "the consumer waited {waited:?}"
        );
        drop(idle);
    });
}

/// The third reproduction, with no attacker: real consumers until
/// the owner's descriptors run out, then all of them gone; the next
/// consumer is served.
#[test]
fn consumers_up_to_the_fd_limit_leave_the_listener_open() {
    in_own_process(|| {
        let Some(owner) = owner_for("consumers_up_to_the_fd_limit_leave_the_listener_open", &[])
        else {
            return;
        };
        let baseline = owner.open_fds();
        let mut consumers = Vec::new();
        let runtime = runtime();
        let mut refused = None;
        let mut peak = baseline;
        while consumers.len() < 2 * LIMIT as usize {
            let consumer =
                UcxEngine::start(config(Transport::Tcp)).expect("consumer engine starts");
            consumer
                .add_peer(OWNER, owner.address.clone())
                .expect("the consumer records the owner");
            let backend = consumer.backend();
            let read = runtime.block_on(async {
                let dest = PageBuf::zeroed(SIZE);
                let region = map(&backend, &dest).await;
                let request = get_request(
                    OWNER,
                    &owner.descriptor,
                    &region,
                    0,
                    Some(Duration::from_secs(2)),
                );
                let read = backend.get_into_test_memory(request).await;
                let _ = backend.unmap(region.backend_region_id).await;
                read
            });
            consumers.push(consumer);
            peak = peak.max(owner.open_fds());
            if let Err(err) = read {
                refused = Some(err);
                break;
            }
        }
        assert!(
            refused.is_some() && peak as u64 + 4 >= LIMIT,
            "{} consumers read, the owner peaked at {peak} descriptors of {LIMIT}",
            consumers.len()
        );
        eprintln!(
            "{} consumers read before one waited past its deadline; the owner peaked at {peak} \
             descriptors (had {baseline})",
            consumers.len() - 1
        );
        for consumer in consumers.drain(..) {
            consumer.shutdown_blocking();
        }
        owner.assert_fds_back(baseline, Duration::from_secs(15), "");
        owner
            .read_by_new_consumer(READ_DEADLINE)
            .expect("a consumer arriving after the others left reads");
    });
}

/// The engine raises the soft open-file limit to the hard one as it
/// starts, and reports both.
#[test]
fn the_engine_raises_the_soft_fd_limit_to_the_hard_one() {
    in_own_process(|| {
        let Some(owner) = owner_for(
            "the_engine_raises_the_soft_fd_limit_to_the_hard_one",
            &[(CHILD_SOFT, "64")],
        ) else {
            return;
        };
        assert_eq!(
            (owner.soft_before, owner.soft, owner.hard),
            (64, LIMIT, LIMIT)
        );
    });
}
