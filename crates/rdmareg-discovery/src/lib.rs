//! Peers and named descriptors on etcd, under leases, with watches that tell a
//! consumer when a peer is gone.
//!
//! An owner's [`Publisher`] writes its worker address and named descriptors
//! under an etcd lease it keeps alive, withdraws a name before its region is
//! unregistered, and reconnects and republishes after a loss. A consumer's
//! [`Directory`] resolves names and watches for [`DirectoryEvent::NodeGone`]
//! within the lease TTL of a node's death. Staleness is decided by etcd
//! revisions and descriptor generations, never by timers
//! ([`DiscoveryError::Stale`]). The design: `docs/discovery.md`.
//!
//! Order of use: [`EtcdConfig::new`] → [`Publisher::start`] →
//! [`Publisher::publish`] → [`Publisher::withdraw`] before unregistering →
//! [`Publisher::shutdown`]; [`Directory::connect`] → [`Directory::watch`] /
//! [`Directory::resolve`].
//!
//! This crate depends on `rdmareg-core` only, so any backend can use it.

#![forbid(unsafe_code)]

mod directory;
mod error;
mod publisher;
mod record;
mod store;
#[cfg(feature = "test-support")]
pub mod test_support;

use std::time::Duration;

use etcd_client::{Client, ConnectOptions};

pub use directory::{Directory, DirectoryEvent, DirectoryWatch, Peer, Resolved};
pub use error::DiscoveryError;
pub use publisher::{Publisher, PublisherStatus};
pub use record::{MAX_NAME_LEN, MAX_WORKER_ADDRESS_LEN, NodeRecord};

/// How often a connection with a watch or request open pings etcd: etcd's
/// gRPC server closes connections that ping more often than its
/// `--grpc-keepalive-min-time` (5 s by default) or on idle connections.
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(10);

/// How long a ping may go unanswered before the link counts as dead.
const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(5);

/// Where etcd is and how a cluster is laid out in it.
#[derive(Debug, Clone)]
pub struct EtcdConfig {
    endpoints: Vec<String>,
    prefix: String,
    ttl: Duration,
    connect_timeout: Duration,
    request_timeout: Duration,
}

/// The default lease TTL: how long a dead node stays visible at most.
pub const DEFAULT_TTL: Duration = Duration::from_secs(5);

impl EtcdConfig {
    /// One etcd endpoint (`http://host:2379`), the prefix `/rdmareg/default`,
    /// a 5 s lease and 3 s connect / 5 s request timeouts.
    pub fn new(endpoint: impl Into<String>) -> Self {
        Self {
            endpoints: vec![endpoint.into()],
            prefix: "/rdmareg/default".to_string(),
            ttl: DEFAULT_TTL,
            connect_timeout: Duration::from_secs(3),
            request_timeout: Duration::from_secs(5),
        }
    }

    /// Adds another endpoint of the same etcd cluster.
    pub fn with_endpoint(mut self, endpoint: impl Into<String>) -> Self {
        self.endpoints.push(endpoint.into());
        self
    }

    /// The key prefix of the cluster (several clusters can share one etcd).
    pub fn with_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// The lease TTL, rounded up to whole seconds (etcd's unit; at least 1 s,
    /// and etcd itself raises TTLs below its minimum, about 2 s by default).
    pub fn with_ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl;
        self
    }

    /// How long connecting may take before [`DiscoveryError::Unreachable`].
    pub fn with_connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// How long one etcd request may take.
    pub fn with_request_timeout(mut self, timeout: Duration) -> Self {
        self.request_timeout = timeout;
        self
    }

    /// The lease TTL in etcd's whole seconds.
    pub fn ttl_secs(&self) -> i64 {
        let secs = self.ttl.as_secs() + u64::from(self.ttl.subsec_nanos() > 0);
        secs.clamp(1, i64::MAX as u64) as i64
    }

    /// The cluster prefix.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// Checks every endpoint: `http://HOST:PORT` or `HOST:PORT`.
    fn check_endpoints(&self) -> Result<(), DiscoveryError> {
        if self.endpoints.is_empty() {
            return Err(DiscoveryError::InvalidEndpoint {
                endpoint: String::new(),
                reason: "no endpoint given",
            });
        }
        for endpoint in &self.endpoints {
            check_endpoint(endpoint)?;
        }
        if !self.prefix.starts_with('/') || self.prefix.trim_end_matches('/').is_empty() {
            return Err(DiscoveryError::InvalidName(self.prefix.clone()));
        }
        Ok(())
    }

    /// Connects and proves etcd responds, within the connect timeout.
    async fn connect(&self) -> Result<Client, DiscoveryError> {
        self.check_endpoints()?;
        let unreachable = |detail: String| DiscoveryError::Unreachable {
            endpoints: self.endpoints.join(","),
            detail,
        };
        let options = ConnectOptions::new()
            .with_connect_timeout(self.connect_timeout)
            .with_timeout(self.request_timeout)
            // HTTP/2 pings notice a silently dead link under a watch, no
            // more often than etcd tolerates (see `KEEPALIVE_INTERVAL`).
            .with_keep_alive(KEEPALIVE_INTERVAL, KEEPALIVE_TIMEOUT)
            .with_keep_alive_while_idle(false);
        let attempt = async {
            let mut client = Client::connect(&self.endpoints, Some(options))
                .await
                .map_err(|e| unreachable(e.to_string()))?;
            client
                .status()
                .await
                .map_err(|e| unreachable(e.to_string()))?;
            Ok(client)
        };
        match tokio::time::timeout(self.connect_timeout, attempt).await {
            Ok(result) => result,
            Err(_) => Err(unreachable(format!(
                "no response within {:?}",
                self.connect_timeout
            ))),
        }
    }
}

fn check_endpoint(endpoint: &str) -> Result<(), DiscoveryError> {
    let bad = |reason| DiscoveryError::InvalidEndpoint {
        endpoint: endpoint.to_string(),
        reason,
    };
    let rest = if let Some(rest) = endpoint.strip_prefix("http://") {
        rest
    } else if endpoint.starts_with("https://") {
        return Err(bad("TLS endpoints are not supported by this build"));
    } else if endpoint.contains("://") {
        return Err(bad("the scheme must be http"));
    } else {
        endpoint
    };
    let rest = rest.trim_end_matches('/');
    let Some((host, port)) = rest.rsplit_once(':') else {
        return Err(bad("no port"));
    };
    if host.is_empty() || host.contains('/') {
        return Err(bad("no host"));
    }
    match port.parse::<u16>() {
        Ok(p) if p > 0 => Ok(()),
        _ => Err(bad("the port is not a number in 1..=65535")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_without_port_or_with_other_schemes_are_refused() {
        for bad in [
            "",
            "http://",
            "http://host",
            "https://h:1",
            "grpc://h:1",
            "h:0",
            "h:x",
            ":2379",
        ] {
            assert!(
                matches!(
                    check_endpoint(bad),
                    Err(DiscoveryError::InvalidEndpoint { .. })
                ),
                "{bad}"
            );
        }
        for good in [
            "http://127.0.0.1:2379",
            "etcd.local:2379",
            "http://[::1]:2379/",
        ] {
            assert!(check_endpoint(good).is_ok(), "{good}");
        }
    }

    #[test]
    fn ttl_rounds_up_to_whole_seconds() {
        let config = EtcdConfig::new("h:1").with_ttl(Duration::from_millis(1500));
        assert_eq!(config.ttl_secs(), 2);
        let config = EtcdConfig::new("h:1").with_ttl(Duration::ZERO);
        assert_eq!(config.ttl_secs(), 1);
    }
}
