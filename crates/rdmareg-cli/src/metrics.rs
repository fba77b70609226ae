//! `--metrics-addr`: the process's registry metrics at `/metrics`.
//!
//! One address per process, one registry exported at a time: every
//! [`Node`](crate::node::Node) publishes its registry when it starts, and a
//! later node (the benchmark's next transport) replaces it.

use std::net::SocketAddr;
use std::sync::OnceLock;

use anyhow::Context as _;
use rdmareg::metrics::{MetricsServer, MetricsSlot};
use rdmareg_registry::RdmaRegistry;

/// Set once the server runs.
static SLOT: OnceLock<MetricsSlot> = OnceLock::new();

/// Serve metrics at `addr`, if given; keep the returned server for the run.
pub async fn serve(addr: Option<SocketAddr>) -> anyhow::Result<Option<MetricsServer>> {
    let Some(addr) = addr else {
        return Ok(None);
    };
    let slot = SLOT.get_or_init(MetricsSlot::default);
    let server = MetricsServer::serve(addr, slot.prometheus_registry())
        .await
        .with_context(|| format!("cannot serve metrics on {addr}"))?;
    eprintln!("metrics at http://{}/metrics", server.local_addr());
    Ok(Some(server))
}

/// Export `registry` if metrics are served; nothing otherwise.
pub fn publish(registry: &RdmaRegistry) {
    if let Some(slot) = SLOT.get() {
        slot.set(Some(registry.clone()));
    }
}
