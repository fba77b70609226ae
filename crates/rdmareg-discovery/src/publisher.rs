//! The owner's side: a node entry and named descriptors under one lease.
//!
//! Every write to etcd (publish, withdraw, the republish after a reconnect)
//! goes through one async mutex over [`Writes`], so a republish can never put
//! back a name that a concurrent withdraw has just deleted: the published set
//! in memory and the set in etcd change under the same lock.
//!
//! A background task keeps the lease alive (a refresh every third of the
//! TTL). When a refresh fails or etcd says the lease is gone, it reports
//! [`PublisherStatus::Reconnecting`], then retries with backoff: a fresh
//! lease, the node key, every name still published. On success the status is
//! [`PublisherStatus::Live`] again.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use etcd_client::{Client, Compare, CompareOp, PutOptions, Txn, TxnOp};

/// Operations per transaction when republishing (etcd's default limit is 128).
const OPS_PER_TXN: usize = 100;
use rdmareg_core::Descriptor;
use tokio::sync::{Mutex, watch};
use tokio::task::JoinHandle;

use crate::record::{Keys, NameRecord, NodeRecord, check_name};
use crate::{DiscoveryError, EtcdConfig};

/// Where a publisher's lease stands.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum PublisherStatus {
    /// The lease is alive and everything published is in etcd.
    Live {
        /// The etcd lease every key of this node is attached to.
        lease: i64,
    },
    /// The connection or the lease was lost; the publisher is retrying.
    /// Entries may be missing from etcd (and expire with the old lease).
    Reconnecting {
        /// Failed attempts so far.
        attempts: u32,
        /// The last error.
        error: String,
    },
    /// [`Publisher::shutdown`] ran.
    Closed,
}

/// What is published, and under which lease (guarded by one async mutex).
struct Writes {
    lease: Option<i64>,
    names: BTreeMap<String, Vec<u8>>,
    closed: bool,
}

struct Shared {
    client: Client,
    keys: Keys,
    node: String,
    record: NodeRecord,
    ttl: i64,
    writes: Mutex<Writes>,
    status: watch::Sender<PublisherStatus>,
}

/// A node's presence in etcd: its worker address and named descriptors,
/// kept under a lease for as long as this value lives.
///
/// Dropping it stops the keep-alive (the lease and every entry then expire
/// within the TTL); [`shutdown`](Self::shutdown) removes them at once.
pub struct Publisher {
    shared: Arc<Shared>,
    keeper: JoinHandle<()>,
}

impl std::fmt::Debug for Publisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Publisher")
            .field("node", &self.shared.node)
            .field("status", &*self.shared.status.borrow())
            .finish()
    }
}

impl Publisher {
    /// Connects, takes a lease and publishes the node `node` with its backend
    /// key and worker address. Errors if etcd is unreachable or the input is
    /// invalid; another node entry of the same name is replaced.
    ///
    /// # Cancel safety
    /// Dropping the future before it resolves may leave a lease with the node
    /// key behind; it expires within the TTL.
    pub async fn start(
        config: &EtcdConfig,
        node: &str,
        backend_key: &str,
        worker_address: Bytes,
    ) -> Result<Self, DiscoveryError> {
        check_name(node)?;
        if backend_key.is_empty() || backend_key.len() > rdmareg_core::MAX_BACKEND_KEY_LEN {
            return Err(DiscoveryError::InvalidName(backend_key.to_string()));
        }
        if worker_address.is_empty() || worker_address.len() > crate::MAX_WORKER_ADDRESS_LEN {
            return Err(DiscoveryError::Malformed {
                key: "worker address".into(),
                reason: format!(
                    "{} bytes, expected 1..={}",
                    worker_address.len(),
                    crate::MAX_WORKER_ADDRESS_LEN
                ),
            });
        }
        let mut client = config.connect().await?;
        let keys = Keys::new(config.prefix());
        let ttl = config.ttl_secs();
        let lease = client
            .lease_grant(ttl, None)
            .await
            .map_err(|e| DiscoveryError::etcd("granting the node's lease", e))?
            .id();
        // The incarnation is the revision of this first write, which etcd
        // gives no other write. The record carries a guess (the next
        // revision); if another write got that revision first, the record is
        // written again carrying the revision the first write really got.
        let node_key = keys.node(node);
        let put_node = |client: &mut Client, incarnation: i64| {
            let record = NodeRecord {
                incarnation,
                backend_key: backend_key.to_string(),
                worker_address: worker_address.clone(),
            };
            let value = record.encode();
            let mut client = client.clone();
            let key = node_key.clone();
            async move {
                let response = client
                    .put(key, value, Some(PutOptions::new().with_lease(lease)))
                    .await
                    .map_err(|e| DiscoveryError::etcd("publishing the node", e))?;
                Ok::<_, DiscoveryError>((record, response.header().map_or(0, |h| h.revision())))
            }
        };
        let now = client
            .status()
            .await
            .map_err(|e| DiscoveryError::etcd("reading the revision", e))?
            .header()
            .map_or(0, |h| h.revision());
        let (mut incarnation, written_at) = put_node(&mut client, now + 1).await?;
        if written_at != incarnation.incarnation {
            incarnation = put_node(&mut client, written_at).await?.0;
        }
        tracing::info!(
            node,
            lease,
            incarnation = incarnation.incarnation,
            "published node in etcd"
        );
        let (status, _) = watch::channel(PublisherStatus::Live { lease });
        let shared = Arc::new(Shared {
            client,
            keys,
            node: node.to_string(),
            record: incarnation,
            ttl,
            writes: Mutex::new(Writes {
                lease: Some(lease),
                names: BTreeMap::new(),
                closed: false,
            }),
            status,
        });
        let keeper = tokio::spawn(keep_alive(Arc::clone(&shared), lease));
        Ok(Self { shared, keeper })
    }

    /// The node name.
    pub fn node(&self) -> &str {
        &self.shared.node
    }

    /// This publisher's incarnation (the etcd revision of its first write).
    pub fn incarnation(&self) -> i64 {
        self.shared.record.incarnation
    }

    /// The current status; changes are reported as they happen.
    pub fn status(&self) -> watch::Receiver<PublisherStatus> {
        self.shared.status.subscribe()
    }

    /// Publishes `descriptor` under `name`, replacing whatever was there (a
    /// re-registered region replaces its old entry).
    ///
    /// On a transient error the name stays queued: it is written when the
    /// connection is back, unless it is withdrawn first.
    ///
    /// # Cancel safety
    /// Dropping the future leaves the name queued as above; it may or may not
    /// be in etcd yet.
    pub async fn publish(&self, name: &str, descriptor: &Descriptor) -> Result<(), DiscoveryError> {
        check_name(name)?;
        let value = NameRecord {
            node: self.shared.node.clone(),
            incarnation: self.shared.record.incarnation,
            descriptor: descriptor.clone(),
        }
        .encode();
        let mut writes = self.shared.writes.lock().await;
        if writes.closed {
            return Err(DiscoveryError::Closed);
        }
        writes.names.insert(name.to_string(), value.clone());
        let Some(lease) = writes.lease else {
            return Err(DiscoveryError::etcd(
                "publishing a descriptor",
                "no live lease (reconnecting); queued until the connection is back",
            ));
        };
        let mut client = self.shared.client.clone();
        client
            .put(
                self.shared.keys.name(name),
                value,
                Some(PutOptions::new().with_lease(lease)),
            )
            .await
            .map_err(|e| DiscoveryError::etcd("publishing a descriptor", e))?;
        tracing::debug!(node = %self.shared.node, name, generation = descriptor.generation(), "published descriptor");
        Ok(())
    }

    /// Withdraws `name`: call it before the region it describes is
    /// unregistered. Only this node's entry is deleted (a newer one of
    /// another node stays). Withdrawing a name not published is `Ok`.
    ///
    /// On an error the name is no longer republished, and its entry vanishes
    /// with this publisher's lease (within the TTL) if the delete did not
    /// reach etcd.
    ///
    /// # Cancel safety
    /// As for an error: the name is forgotten locally first.
    pub async fn withdraw(&self, name: &str) -> Result<(), DiscoveryError> {
        check_name(name)?;
        let mut writes = self.shared.writes.lock().await;
        let was_published = writes.names.remove(name).is_some();
        let Some(lease) = writes.lease else {
            return if was_published {
                Err(DiscoveryError::etcd(
                    "withdrawing a descriptor",
                    "no live lease (reconnecting); the entry expires with the old lease",
                ))
            } else {
                Ok(())
            };
        };
        let key = self.shared.keys.name(name);
        let txn = Txn::new()
            .when([Compare::lease(key.clone(), CompareOp::Equal, lease)])
            .and_then([TxnOp::delete(key, None)]);
        let mut client = self.shared.client.clone();
        client
            .txn(txn)
            .await
            .map_err(|e| DiscoveryError::etcd("withdrawing a descriptor", e))?;
        tracing::debug!(node = %self.shared.node, name, "withdrew descriptor");
        Ok(())
    }

    /// Withdraws everything at once by revoking the lease, and stops.
    pub async fn shutdown(self) -> Result<(), DiscoveryError> {
        self.keeper.abort();
        let mut writes = self.shared.writes.lock().await;
        writes.closed = true;
        writes.names.clear();
        let lease = writes.lease.take();
        self.shared.status.send_replace(PublisherStatus::Closed);
        if let Some(lease) = lease {
            let mut client = self.shared.client.clone();
            client
                .lease_revoke(lease)
                .await
                .map_err(|e| DiscoveryError::etcd("revoking the node's lease", e))?;
        }
        tracing::info!(node = %self.shared.node, "withdrew node from etcd");
        Ok(())
    }
}

impl Drop for Publisher {
    fn drop(&mut self) {
        self.keeper.abort();
    }
}

/// Keeps `lease` alive; on loss, re-establishes a lease and republishes.
async fn keep_alive(shared: Arc<Shared>, mut lease: i64) {
    let period = Duration::from_millis((shared.ttl as u64 * 1000 / 3).max(300));
    loop {
        let error = refresh_until_lost(&shared, lease, period).await;
        tracing::warn!(node = %shared.node, lease, %error, "lost the etcd lease; reconnecting");
        shared.writes.lock().await.lease = None;
        let mut attempts = 0u32;
        let mut backoff = Duration::from_millis(100);
        shared.status.send_replace(PublisherStatus::Reconnecting {
            attempts,
            error: error.clone(),
        });
        lease = loop {
            match republish(&shared).await {
                Ok(lease) => break lease,
                Err(e) => {
                    attempts += 1;
                    tracing::debug!(node = %shared.node, attempts, error = %e, "reconnect attempt failed");
                    shared.status.send_replace(PublisherStatus::Reconnecting {
                        attempts,
                        error: e.to_string(),
                    });
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(2));
                }
            }
        };
        tracing::info!(node = %shared.node, lease, attempts, "reconnected to etcd; publishing resumed");
        shared.status.send_replace(PublisherStatus::Live { lease });
    }
}

/// Refreshes the lease every `period` until that fails; returns why.
async fn refresh_until_lost(shared: &Shared, lease: i64, period: Duration) -> String {
    let mut client = shared.client.clone();
    let (mut keeper, mut stream) = match client.lease_keep_alive(lease).await {
        Ok(pair) => pair,
        Err(e) => return format!("keep-alive stream: {e}"),
    };
    loop {
        if let Err(e) = keeper.keep_alive().await {
            return format!("keep-alive: {e}");
        }
        match tokio::time::timeout(period, stream.message()).await {
            Ok(Ok(Some(answer))) if answer.ttl() > 0 => {}
            Ok(Ok(Some(_))) => return "etcd reports the lease expired".to_string(),
            Ok(Ok(None)) => return "keep-alive stream closed".to_string(),
            Ok(Err(e)) => return format!("keep-alive: {e}"),
            Err(_) => return format!("no keep-alive answer within {period:?}"),
        }
        tokio::time::sleep(period).await;
    }
}

/// A new lease, the node key and every published name under it.
async fn republish(shared: &Shared) -> Result<i64, DiscoveryError> {
    let mut client = shared.client.clone();
    let lease = client
        .lease_grant(shared.ttl, None)
        .await
        .map_err(|e| DiscoveryError::etcd("granting a new lease", e))?
        .id();
    let mut writes = shared.writes.lock().await;
    if writes.closed {
        return Err(DiscoveryError::Closed);
    }
    let options = || Some(PutOptions::new().with_lease(lease));
    let mut ops = vec![TxnOp::put(
        shared.keys.node(&shared.node),
        shared.record.encode(),
        options(),
    )];
    for (name, value) in &writes.names {
        ops.push(TxnOp::put(shared.keys.name(name), value.clone(), options()));
    }
    for chunk in ops.chunks(OPS_PER_TXN) {
        client
            .txn(Txn::new().and_then(chunk.to_vec()))
            .await
            .map_err(|e| DiscoveryError::etcd("republishing after a reconnect", e))?;
    }
    writes.lease = Some(lease);
    Ok(lease)
}
