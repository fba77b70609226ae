//! Scale simulation: N nodes against one local etcd, each with a lease kept
//! alive and D descriptors, re-publishing them (churn) for a while, watched by
//! one consumer. Prints publish latency, watch throughput and watch lag.
//!
//! ```text
//! cargo run --release -p rdmareg-discovery --features test-support --example simulate -- NODES NAMES SECONDS PUBLISHES_PER_NODE_PER_SECOND
//! ```
//!
//! The descriptor generation carries the publish time (µs since start), so
//! the consumer can measure how long each change took to reach it.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use rdmareg_core::Descriptor;
use rdmareg_discovery::test_support::EtcdServer;
use rdmareg_discovery::{Directory, DirectoryEvent, EtcdConfig, Publisher};

fn arg(index: usize, default: u64) -> u64 {
    std::env::args()
        .nth(index)
        .and_then(|a| a.parse().ok())
        .unwrap_or(default)
}

fn percentile(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let nodes = arg(1, 100);
    let names = arg(2, 10);
    let seconds = arg(3, 10);
    let rate = arg(4, 1);
    let etcd = EtcdServer::start()?;
    let config = EtcdConfig::new(etcd.url())
        .with_prefix("/rdmareg/sim")
        .with_ttl(Duration::from_secs(5));
    let start = Instant::now();
    let micros = move || start.elapsed().as_micros() as u64 + 1;

    let directory = Directory::connect(&config).await?;
    let mut watch = directory.watch();
    let events = Arc::new(AtomicU64::new(0));
    let lags = Arc::new(parking_lot_free::Lags::default());
    {
        let events = Arc::clone(&events);
        let lags = Arc::clone(&lags);
        tokio::spawn(async move {
            while let Some(event) = watch.next().await {
                events.fetch_add(1, Ordering::Relaxed);
                if let DirectoryEvent::Published { descriptor, .. } = event {
                    lags.push(micros().saturating_sub(descriptor.generation()));
                }
            }
        });
    }

    let setup = Instant::now();
    let mut publishers = Vec::new();
    for node in 0..nodes {
        let publisher = Publisher::start(
            &config,
            &format!("node-{node}"),
            "ucx",
            Bytes::from(vec![7u8; 200]),
        )
        .await?;
        for name in 0..names {
            let d = Descriptor::new("ucx", 0x1000, 4096, micros(), Bytes::from_static(&[1; 9]))?;
            publisher.publish(&format!("n{node}.{name}"), &d).await?;
        }
        publishers.push(Arc::new(publisher));
    }
    let setup_secs = setup.elapsed().as_secs_f64();
    println!(
        "setup: {nodes} nodes × {names} descriptors published in {setup_secs:.2} s ({:.0} writes/s)",
        (nodes * (names + 1)) as f64 / setup_secs
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    lags.clear();
    let events_before = events.load(Ordering::Relaxed);

    let churn_until = Instant::now() + Duration::from_secs(seconds);
    let latencies = Arc::new(parking_lot_free::Lags::default());
    let mut tasks = Vec::new();
    for (node, publisher) in publishers.iter().enumerate() {
        let publisher = Arc::clone(publisher);
        let latencies = Arc::clone(&latencies);
        tasks.push(tokio::spawn(async move {
            let period = Duration::from_micros(1_000_000 / rate.max(1));
            let mut ticker = tokio::time::interval(period);
            let mut i = 0u64;
            while Instant::now() < churn_until {
                ticker.tick().await;
                let name = format!("n{node}.{}", i % names.max(1));
                i += 1;
                let d = Descriptor::new("ucx", 0x1000, 4096, micros(), Bytes::from_static(&[1; 9]))
                    .expect("valid descriptor");
                let issued = Instant::now();
                if publisher.publish(&name, &d).await.is_ok() {
                    latencies.push(issued.elapsed().as_micros() as u64);
                }
            }
        }));
    }
    for task in tasks {
        task.await?;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let events = events.load(Ordering::Relaxed) - events_before;
    let publishes = latencies.sorted();
    let lag = lags.sorted();
    println!(
        "churn: {} publishes in {seconds} s ({:.0}/s); publish latency p50 {} µs p99 {} µs",
        publishes.len(),
        publishes.len() as f64 / seconds as f64,
        percentile(&publishes, 0.5),
        percentile(&publishes, 0.99)
    );
    println!(
        "watch: {events} events ({:.0}/s); lag publish→event p50 {} µs p99 {} µs max {} µs",
        events as f64 / seconds as f64,
        percentile(&lag, 0.5),
        percentile(&lag, 0.99),
        lag.last().copied().unwrap_or(0)
    );
    println!(
        "keep-alives: {nodes} leases refreshed every {:.1} s ≈ {:.0}/s",
        5.0 / 3.0,
        nodes as f64 * 3.0 / 5.0
    );
    let size = std::fs::read_dir(etcd.data_dir())
        .map(|_| dir_size(etcd.data_dir()))
        .unwrap_or(0);
    println!(
        "etcd data directory: {:.1} MiB",
        size as f64 / (1 << 20) as f64
    );
    Ok(())
}

fn dir_size(path: &std::path::Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(path) else {
        return 0;
    };
    entries
        .flatten()
        .map(|e| match e.metadata() {
            Ok(m) if m.is_dir() => dir_size(&e.path()),
            Ok(m) => m.len(),
            Err(_) => 0,
        })
        .sum()
}

/// A shared list of samples (a mutex is plenty for a simulation).
mod parking_lot_free {
    use std::sync::Mutex;

    #[derive(Default)]
    pub struct Lags(Mutex<Vec<u64>>);

    impl Lags {
        pub fn push(&self, value: u64) {
            self.0.lock().unwrap_or_else(|p| p.into_inner()).push(value);
        }

        pub fn clear(&self) {
            self.0.lock().unwrap_or_else(|p| p.into_inner()).clear();
        }

        pub fn sorted(&self) -> Vec<u64> {
            let mut values = self.0.lock().unwrap_or_else(|p| p.into_inner()).clone();
            values.sort_unstable();
            values
        }
    }
}
