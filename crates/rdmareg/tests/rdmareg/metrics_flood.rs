//! A flood of idle connections to `/metrics` cannot take the descriptors
//! the owner's UCX listener needs: the metrics server holds at most
//! [`MetricsServer::MAX_CONNECTIONS`] connections, and consumers arriving
//! during and after the flood read.
//!
//! The owner runs in a child process (this test binary again, in the owner
//! role) with `RLIMIT_NOFILE` lowered to 256, soft and hard, serving both
//! a registered buffer and its metrics; this process opens as many idle
//! connections to the metrics port as the kernel takes, up to 6000 (with
//! the bound: the server's 64 and the listen backlog's). Before the bound,
//! the server accepted every one of them until `accept()` failed with
//! `EMFILE`, and UCX 1.22.0's tcp interface then closed its listener for
//! good: no consumer read again.
#![cfg(feature = "metrics")]

use std::io::{BufRead, BufReader};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use rdmareg::metrics::MetricsServer;
use rdmareg::registry::RdmaConfig;
use rdmareg::{Config, Descriptor, PeerId, Rdma, Transport};

const OWNER: PeerId = PeerId(1);
const SIZE: usize = 64 * 1024;
/// The owner's open-file limit, soft and hard.
const LIMIT: u64 = 256;
/// Names the test whose owner role a child process plays.
const ROLE: &str = "RDMAREG_METRICS_FLOOD_OWNER";
/// How many idle connections the flood tries to open.
const FLOOD: usize = 6000;

fn config() -> Config {
    Config::new()
        .with_transport(Transport::Tcp)
        .with_net_devices("lo")
        .with_registry(
            RdmaConfig::default()
                .with_budget_bytes(64 << 20)
                .with_get_deadline(Duration::from_secs(15)),
        )
}

fn byte(i: usize) -> u8 {
    (i % 251) as u8 + 1
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(text: &str) -> Vec<u8> {
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&text[i..i + 2], 16).expect("hex"))
        .collect()
}

/// The owner role: lower the open-file limit, register a buffer, serve
/// metrics, announce both, and serve until killed.
fn owner_main() {
    let limit = libc::rlimit {
        rlim_cur: LIMIT,
        rlim_max: LIMIT,
    };
    // SAFETY: `limit` is a valid rlimit; lowering limits needs no privilege
    // and affects only this child process.
    let set = unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &limit) };
    assert_eq!(set, 0, "setrlimit: {}", std::io::Error::last_os_error());
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let owner = Rdma::start(config()).expect("owner starts");
        let payload: Vec<u8> = (0..SIZE).map(byte).collect();
        let region = owner
            .register_owned(payload.into_boxed_slice())
            .await
            .expect("registers");
        let descriptor = region.descriptor().expect("descriptor");
        let server = owner
            .serve_metrics("127.0.0.1:0".parse().unwrap())
            .await
            .expect("binds");
        println!(
            "READY {} {} {}",
            hex(&owner.worker_address()),
            hex(&descriptor.encode()),
            server.local_addr()
        );
        std::future::pending::<()>().await;
    });
}

/// Idle connections to `addr`, as many as the kernel takes at once (up to
/// [`FLOOD`]): once the server and its listen backlog are full, connecting
/// times out, and ten timeouts in a row end the flood.
fn flood(addr: SocketAddr) -> Vec<TcpStream> {
    let mut open = Vec::new();
    let mut refused_in_a_row = 0;
    while open.len() < FLOOD && refused_in_a_row < 10 {
        match TcpStream::connect_timeout(&addr, Duration::from_millis(50)) {
            Ok(stream) => {
                refused_in_a_row = 0;
                open.push(stream);
            }
            Err(_) => refused_in_a_row += 1,
        }
    }
    open
}

/// Reads the owner's buffer with a new consumer in this process.
async fn read_by_new_consumer(address: &[u8], descriptor: &Descriptor) -> Result<(), String> {
    let consumer = Rdma::start(config()).map_err(|e| e.to_string())?;
    consumer
        .add_peer(OWNER, bytes::Bytes::copy_from_slice(address))
        .map_err(|e| e.to_string())?;
    let registry = consumer.registry().clone();
    let mut buffer = registry.alloc_pinned(SIZE).await.expect("allocates");
    let read = registry.get(OWNER, descriptor, &mut buffer).await;
    let right = buffer.iter().enumerate().all(|(i, b)| *b == byte(i));
    drop(buffer);
    let _ = consumer.shutdown().await;
    read.map_err(|e| e.to_string())?;
    right.then_some(()).ok_or_else(|| "wrong bytes".to_string())
}

/// The owner process, killed when dropped.
struct OwnerProcess(Child);

impl Drop for OwnerProcess {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn a_metrics_flood_leaves_consumers_reading() {
    const NAME: &str = "a_metrics_flood_leaves_consumers_reading";
    if std::env::var(ROLE).as_deref() == Ok(NAME) {
        owner_main();
        return;
    }
    let mut owner = OwnerProcess(
        Command::new(std::env::current_exe().expect("the test binary"))
            .args([
                // Its full name in the test binary: `--exact` compares with that.
                format!("metrics_flood::{NAME}").as_str(),
                "--exact",
                "--nocapture",
                "--test-threads",
                "1",
            ])
            .env(ROLE, NAME)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("the owner process starts"),
    );
    let line = BufReader::new(owner.0.stdout.take().expect("stdout"))
        .lines()
        .map_while(Result::ok)
        // libtest's "test <name> ... " precedes it on the same line.
        .find_map(|line| Some(line[line.find("READY ")?..].to_owned()))
        .expect("the owner announces itself");
    let fields: Vec<&str> = line.split_whitespace().collect();
    let address = unhex(fields[1]);
    let descriptor = Descriptor::decode(&unhex(fields[2])).expect("a descriptor");
    let metrics: SocketAddr = fields[3].parse().expect("the metrics address");
    let pid = owner.0.id();
    let fds = || std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |dir| dir.count());
    let baseline = fds();

    let idle = flood(metrics);
    let during = fds();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let while_flooded = runtime.block_on(read_by_new_consumer(&address, &descriptor));
    let flooded_with = idle.len();
    drop(idle);
    let afterwards = runtime.block_on(read_by_new_consumer(&address, &descriptor));
    assert_eq!(
        (while_flooded, afterwards),
        (Ok(()), Ok(())),
        "reads during and after a flood of {flooded_with} metrics connections \
         (the owner held {during} descriptors during it, {baseline} before)"
    );
    assert!(
        flooded_with > MetricsServer::MAX_CONNECTIONS,
        "only {flooded_with} connections were taken: the server was never full"
    );
    assert!(
        during <= baseline + MetricsServer::MAX_CONNECTIONS + 8,
        "the owner held {during} descriptors with {flooded_with} metrics connections open \
         (had {baseline})"
    );
}
