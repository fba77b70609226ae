//! `/metrics` over HTTP during a real transfer between two UCX engines, and
//! its values checked against the registry's own `stats()` and `metrics()`.
#![cfg(feature = "metrics")]

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use rdmareg::registry::RdmaConfig;
use rdmareg::{Config, ErrorKind, PeerId, Rdma, Transport};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const OWNER: PeerId = PeerId(1);
const SIZE: usize = 4 << 20;

fn config() -> Config {
    Config::new()
        .with_transport(Transport::Tcp)
        .with_net_devices("lo")
        .with_registry(RdmaConfig::default().with_budget_bytes(512 << 20))
}

/// One HTTP/1.1 request; answers the status line and the body.
async fn http_get(addr: SocketAddr, path: &str) -> (String, String) {
    let mut stream = TcpStream::connect(addr).await.expect("connects");
    let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.expect("sends");
    let mut response = String::new();
    stream
        .read_to_string(&mut response)
        .await
        .expect("reads the response");
    let (head, body) = response.split_once("\r\n\r\n").expect("a head and a body");
    (
        head.lines().next().unwrap_or("").to_owned(),
        body.to_owned(),
    )
}

/// `name{labels} value` lines of an OpenMetrics text, by series.
fn samples(text: &str) -> HashMap<String, f64> {
    text.lines()
        .filter(|line| !line.starts_with('#') && !line.is_empty())
        .filter_map(|line| {
            let (series, value) = line.rsplit_once(' ')?;
            Some((series.to_owned(), value.parse().ok()?))
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_scraped_over_http_during_a_transfer_match_the_registry() {
    let owner = Rdma::start(config()).expect("owner starts");
    let consumer = Rdma::start(config()).expect("consumer starts");
    consumer
        .add_peer(OWNER, owner.worker_address())
        .expect("peer");
    let payload: Vec<u8> = (0..SIZE).map(|i| (i % 253) as u8).collect();
    let region = owner
        .register_owned(payload.into_boxed_slice())
        .await
        .expect("registers");
    let descriptor = region.descriptor().expect("descriptor");
    let server = consumer
        .serve_metrics("127.0.0.1:0".parse().unwrap())
        .await
        .expect("binds");
    let addr = server.local_addr();

    // Transfers run in a task while the test scrapes.
    let registry = consumer.registry().clone();
    let running = Arc::new(AtomicBool::new(true));
    let (first_done, first) = tokio::sync::oneshot::channel();
    let mover = {
        let running = Arc::clone(&running);
        tokio::spawn(async move {
            let mut first_done = Some(first_done);
            let mut buffer = registry.alloc_pinned(SIZE).await.expect("allocates");
            let mut done = 0u64;
            while running.load(Ordering::SeqCst) || done < 4 {
                registry
                    .get(OWNER, &descriptor, &mut buffer)
                    .await
                    .expect("GET");
                done += 1;
                if let Some(first_done) = first_done.take() {
                    let _ = first_done.send(());
                }
            }
            assert_eq!(buffer[SIZE - 1], ((SIZE - 1) % 253) as u8);
            done
        })
    };
    // Scrape once the transfers are under way (the mover keeps going until
    // told to stop).
    first.await.expect("the first GET completed");
    let mut scraped_while_moving = 0;
    for _ in 0..5 {
        let (status, body) = http_get(addr, "/metrics").await;
        assert_eq!(status, "HTTP/1.1 200 OK");
        let series = samples(&body);
        let stats = consumer.stats();
        // Nothing registers or releases during the transfers: these hold still.
        assert_eq!(
            series["rdmareg_registered_bytes"],
            stats.registered_bytes as f64
        );
        assert_eq!(series["rdmareg_live_regions"], 0.0);
        assert!(series.contains_key("rdmareg_get_latency_seconds_count"));
        if series["rdmareg_transfers_in_flight"] >= 1.0 || series["rdmareg_gets_total"] >= 1.0 {
            scraped_while_moving += 1;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    running.store(false, Ordering::SeqCst);
    let moved = mover.await.expect("the mover finished");
    assert!(
        scraped_while_moving > 0,
        "no scrape saw a transfer under way"
    );

    // At rest, every series equals the registry's own figures.
    let (status, body) = http_get(addr, "/metrics").await;
    assert_eq!(status, "HTTP/1.1 200 OK");
    let series = samples(&body);
    let metrics = consumer.metrics();
    let stats = &metrics.stats;
    assert_eq!(metrics.gets, moved);
    assert_eq!(series["rdmareg_gets_total"], moved as f64);
    assert_eq!(
        series["rdmareg_get_bytes_total"],
        (moved * SIZE as u64) as f64
    );
    assert_eq!(
        series["rdmareg_registered_bytes"],
        stats.registered_bytes as f64
    );
    assert_eq!(series["rdmareg_budget_bytes"], stats.budget_bytes as f64);
    assert_eq!(
        series["rdmareg_pool_arenas"],
        (stats.pooled_arenas + stats.dedicated_arenas) as f64
    );
    assert_eq!(
        series["rdmareg_pool_arena_bytes"],
        (stats.pooled_arena_bytes + stats.dedicated_arena_bytes) as f64
    );
    assert_eq!(
        series["rdmareg_pool_bytes_in_use"],
        stats.pool_bytes_in_use as f64
    );
    assert_eq!(series["rdmareg_leaked_bytes"], 0.0);
    assert_eq!(series["rdmareg_transfers_in_flight"], 0.0);
    assert_eq!(
        series["rdmareg_registrations_total"],
        metrics.registrations as f64
    );
    assert_eq!(series["rdmareg_get_latency_seconds_count"], moved as f64);
    assert_eq!(
        series["rdmareg_get_latency_seconds_bucket{le=\"+Inf\"}"],
        moved as f64
    );
    // Every exported bucket is the registry's cumulative count.
    for (bound, count) in metrics.get_latency.cumulative() {
        if bound.is_finite() {
            let name = format!("rdmareg_get_latency_seconds_bucket{{le=\"{bound:?}\"}}");
            let exported = series.iter().find(|(series, _)| {
                series
                    .strip_prefix("rdmareg_get_latency_seconds_bucket{le=\"")
                    .and_then(|rest| rest.strip_suffix("\"}"))
                    .and_then(|le| le.parse::<f64>().ok())
                    == Some(bound)
            });
            assert_eq!(exported.map(|(_, v)| *v), Some(count as f64), "{name}");
        }
    }
    for kind in ErrorKind::ALL {
        let name = format!("rdmareg_errors_total{{kind=\"{}\"}}", kind.as_str());
        assert_eq!(series[&name], 0.0, "{name}");
    }

    let (status, _) = http_get(addr, "/elsewhere").await;
    assert_eq!(status, "HTTP/1.1 404 Not Found");

    drop(server);
    region
        .unregister(Duration::from_secs(5))
        .await
        .expect("unregisters");
    for side in [consumer, owner] {
        let summary = side.shutdown().await;
        assert!(summary.is_clean(), "{summary:?}");
    }
}
