//! Prometheus export of the registry's metrics (feature `metrics`).
//!
//! [`RegistryCollector`] reads a registry's [`RegistryMetrics`] at each
//! scrape; [`MetricsServer`] serves them at `GET /metrics` in the
//! OpenMetrics text format. The series and how to read them are listed in
//! `docs/operations.md` ("Metrics"). Several registries share one Prometheus
//! registry under distinct labels with
//! [`Registry::sub_registry_with_label`](prometheus_client::registry::Registry::sub_registry_with_label).

use std::borrow::Cow;
use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio::task::JoinHandle;

use crate::registry::{GET_LATENCY_BUCKETS, LatencyHistogram, RdmaRegistry, RegistryMetrics};

/// Exposes one [`RdmaRegistry`]'s metrics to a Prometheus [`Registry`].
#[derive(Debug, Clone)]
pub struct RegistryCollector {
    registry: RdmaRegistry,
}

impl RegistryCollector {
    /// A collector reading `registry` at each scrape.
    pub fn new(registry: RdmaRegistry) -> Self {
        Self { registry }
    }
}

fn gauge(
    encoder: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    value: u64,
) -> Result<(), std::fmt::Error> {
    let value = i64::try_from(value).unwrap_or(i64::MAX);
    let metric = ConstGauge::new(value);
    metric.encode(encoder.encode_descriptor(name, help, None, metric.metric_type())?)
}

fn counter(
    encoder: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    value: u64,
) -> Result<(), std::fmt::Error> {
    let metric = ConstCounter::new(value);
    metric.encode(encoder.encode_descriptor(name, help, None, metric.metric_type())?)
}

/// A histogram snapshot in the form prometheus-client encodes.
#[derive(Debug)]
struct Histogram<'a>(&'a LatencyHistogram);

impl EncodeMetric for Histogram<'_> {
    fn encode(&self, mut encoder: MetricEncoder<'_>) -> Result<(), std::fmt::Error> {
        // prometheus-client takes per-bucket counts and accumulates them.
        let buckets: Vec<(f64, u64)> = GET_LATENCY_BUCKETS
            .iter()
            .copied()
            .chain([f64::INFINITY])
            .zip(self.0.buckets.iter().copied())
            .collect();
        encoder.encode_histogram::<NoLabelSet>(
            self.0.sum.as_secs_f64(),
            self.0.count,
            &buckets,
            None,
        )
    }

    fn metric_type(&self) -> MetricType {
        MetricType::Histogram
    }
}

/// Encode `metrics` as the series listed in the module docs.
fn encode_metrics(
    metrics: &RegistryMetrics,
    mut encoder: DescriptorEncoder<'_>,
) -> Result<(), std::fmt::Error> {
    let stats = &metrics.stats;
    let e = &mut encoder;
    gauge(
        e,
        "rdmareg_registered_bytes",
        "Bytes registered (page-rounded, as budgeted)",
        stats.registered_bytes,
    )?;
    gauge(
        e,
        "rdmareg_budget_bytes",
        "Ceiling on registered bytes",
        stats.budget_bytes,
    )?;
    gauge(
        e,
        "rdmareg_live_regions",
        "Regions registered and not yet released",
        stats.live_regions as u64,
    )?;
    gauge(
        e,
        "rdmareg_pool_arenas",
        "Pool arenas registered (pooled and dedicated)",
        (stats.pooled_arenas + stats.dedicated_arenas) as u64,
    )?;
    gauge(
        e,
        "rdmareg_pool_arena_bytes",
        "Total size of the registered pool arenas",
        stats.pooled_arena_bytes + stats.dedicated_arena_bytes,
    )?;
    gauge(
        e,
        "rdmareg_pool_bytes_in_use",
        "Pool bytes carved into live buffers",
        stats.pool_bytes_in_use,
    )?;
    gauge(
        e,
        "rdmareg_transfers_in_flight",
        "GETs admitted and not yet completed",
        stats.transfers_in_flight as u64,
    )?;
    gauge(
        e,
        "rdmareg_leaked_bytes",
        "Bytes leaked because their unmap was never confirmed",
        stats.leaked_bytes,
    )?;
    counter(
        e,
        "rdmareg_registrations",
        "Regions and pool arenas registered",
        metrics.registrations,
    )?;
    counter(
        e,
        "rdmareg_unregistrations",
        "Regions and pool arenas released",
        metrics.unregistrations,
    )?;
    counter(
        e,
        "rdmareg_budget_refusals",
        "Registrations and allocations refused by the budget",
        metrics.budget_refusals,
    )?;
    counter(
        e,
        "rdmareg_gets",
        "GETs that completed successfully",
        metrics.gets,
    )?;
    counter(
        e,
        "rdmareg_get_bytes",
        "Bytes moved by successful GETs",
        metrics.get_bytes,
    )?;
    counter(
        e,
        "rdmareg_puts",
        "PUTs that completed successfully",
        metrics.puts,
    )?;
    counter(
        e,
        "rdmareg_put_bytes",
        "Bytes moved by successful PUTs",
        metrics.put_bytes,
    )?;
    {
        let mut family = e.encode_descriptor(
            "rdmareg_errors",
            "Errors returned by the registry, by kind",
            None,
            MetricType::Counter,
        )?;
        for (kind, count) in &metrics.errors {
            let labels = [("kind", kind.as_str())];
            ConstCounter::new(*count).encode(family.encode_family(&labels)?)?;
        }
    }
    let histogram = Histogram(&metrics.get_latency);
    histogram.encode(e.encode_descriptor(
        "rdmareg_get_latency",
        "Time from a GET's admission to its completion",
        Some(&prometheus_client::registry::Unit::Seconds),
        histogram.metric_type(),
    )?)
}

impl Collector for RegistryCollector {
    fn encode(&self, encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        encode_metrics(&self.registry.metrics(), encoder)
    }
}

/// A collector whose registry can be replaced while served, for a process
/// that runs one registry after another behind one address. Clones share
/// the slot; empty, it exports nothing.
#[derive(Debug, Clone, Default)]
pub struct MetricsSlot {
    registry: Arc<std::sync::Mutex<Option<RdmaRegistry>>>,
}

impl MetricsSlot {
    /// Export `registry` from now on (or nothing, for `None`).
    pub fn set(&self, registry: Option<RdmaRegistry>) {
        *self
            .registry
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = registry;
    }

    /// A Prometheus registry holding this slot as its collector.
    pub fn prometheus_registry(&self) -> Registry {
        let mut prometheus = Registry::default();
        prometheus.register_collector(Box::new(self.clone()));
        prometheus
    }
}

impl Collector for MetricsSlot {
    fn encode(&self, encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let registry = self
            .registry
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone();
        match registry {
            Some(registry) => encode_metrics(&registry.metrics(), encoder),
            None => Ok(()),
        }
    }
}

/// A Prometheus registry holding `registry`'s collector.
pub fn prometheus_registry(registry: &RdmaRegistry) -> Registry {
    let mut prometheus = Registry::default();
    prometheus.register_collector(Box::new(RegistryCollector::new(registry.clone())));
    prometheus
}

/// Render `prometheus` in the OpenMetrics text format.
///
/// # Errors
/// Only if a collector fails to encode (a formatting error).
pub fn render(prometheus: &Registry) -> Result<String, std::fmt::Error> {
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, prometheus)?;
    Ok(text)
}

/// The content type of [`render`]'s output.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Longest request head the server reads before it responds 400.
const MAX_REQUEST_HEAD: usize = 8 * 1024;
/// How long a client may take to send its request head.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// How long one connection may last in all, response included.
const CONNECTION_TIMEOUT: Duration = Duration::from_secs(10);

/// A small HTTP server serving `GET /metrics` (404 otherwise, 405 for a
/// method other than `GET`/`HEAD`; one request per connection), on the
/// Tokio runtime it was started from, until dropped.
///
/// It holds at most [`MAX_CONNECTIONS`](Self::MAX_CONNECTIONS) connections,
/// each for at most 10 s; more clients wait in the kernel's listen backlog,
/// so a flood of idle connections delays scrapes but cannot take the UCX
/// listener's file descriptors.
#[derive(Debug)]
pub struct MetricsServer {
    local_addr: SocketAddr,
    task: JoinHandle<()>,
}

impl MetricsServer {
    /// Most connections the server holds open at a time.
    pub const MAX_CONNECTIONS: usize = 64;

    /// Bind `addr` and serve `prometheus` there.
    ///
    /// # Errors
    /// The bind's I/O error.
    pub async fn serve(addr: SocketAddr, prometheus: Registry) -> io::Result<MetricsServer> {
        let listener = TcpListener::bind(addr).await?;
        let local_addr = listener.local_addr()?;
        let prometheus = Arc::new(prometheus);
        let slots = Arc::new(Semaphore::new(Self::MAX_CONNECTIONS));
        let task = tokio::spawn(async move {
            loop {
                // A slot first, then the accept: waiting clients stay in the
                // kernel's backlog.
                let Ok(slot) = Arc::clone(&slots).acquire_owned().await else {
                    return;
                };
                match listener.accept().await {
                    Ok((stream, _)) => {
                        let prometheus = Arc::clone(&prometheus);
                        tokio::spawn(async move {
                            let responded = tokio::time::timeout(
                                CONNECTION_TIMEOUT,
                                respond(stream, &prometheus),
                            )
                            .await;
                            match responded {
                                Ok(Err(error)) => {
                                    tracing::debug!(%error, "metrics request failed");
                                }
                                Err(_) => tracing::debug!("metrics connection timed out"),
                                Ok(Ok(())) => {}
                            }
                            drop(slot);
                        });
                    }
                    Err(error) => {
                        tracing::warn!(%error, "metrics server: accept failed");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                }
            }
        });
        tracing::info!(%local_addr, "serving metrics at /metrics");
        Ok(MetricsServer { local_addr, task })
    }

    /// Serve one registry's metrics at `addr`.
    ///
    /// # Errors
    /// The bind's I/O error.
    pub async fn serve_registry(
        addr: SocketAddr,
        registry: &RdmaRegistry,
    ) -> io::Result<MetricsServer> {
        Self::serve(addr, prometheus_registry(registry)).await
    }

    /// The bound address (with the port chosen when `addr` asked for 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }
}

impl Drop for MetricsServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Read one request head and respond to it.
async fn respond(mut stream: TcpStream, prometheus: &Registry) -> io::Result<()> {
    let head = match tokio::time::timeout(REQUEST_TIMEOUT, read_head(&mut stream)).await {
        Ok(head) => head?,
        Err(_) => return Ok(()),
    };
    let request_line = head.as_deref().and_then(|h| h.lines().next()).unwrap_or("");
    let mut parts = request_line.split(' ');
    let (method, path) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let path = path.split('?').next().unwrap_or("");
    let (status, content_type, body): (&str, &str, Cow<'_, str>) = if head.is_none() {
        ("400 Bad Request", "text/plain", "bad request\n".into())
    } else if method != "GET" && method != "HEAD" {
        ("405 Method Not Allowed", "text/plain", "only GET\n".into())
    } else if path != "/metrics" {
        (
            "404 Not Found",
            "text/plain",
            "metrics are at /metrics\n".into(),
        )
    } else {
        match render(prometheus) {
            Ok(text) => ("200 OK", CONTENT_TYPE, text.into()),
            Err(_) => (
                "500 Internal Server Error",
                "text/plain",
                "encoding failed\n".into(),
            ),
        }
    };
    let header = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(header.as_bytes()).await?;
    if method != "HEAD" {
        stream.write_all(body.as_bytes()).await?;
    }
    stream.shutdown().await
}

/// The request head up to the blank line; `None` if it is too long, not
/// UTF-8, or the client closed first.
async fn read_head(stream: &mut TcpStream) -> io::Result<Option<String>> {
    let mut head = Vec::with_capacity(512);
    let mut chunk = [0u8; 512];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = stream.read(&mut chunk).await?;
        if n == 0 || head.len() + n > MAX_REQUEST_HEAD {
            return Ok(None);
        }
        head.extend_from_slice(&chunk[..n]);
    }
    Ok(String::from_utf8(head).ok())
}
