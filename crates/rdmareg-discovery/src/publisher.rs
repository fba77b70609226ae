//! The owner's side: a node entry and named descriptors under one lease.
//!
//! Every write (publish, withdraw, republish) goes through one async mutex
//! over [`Writes`], so a republish never restores a name a concurrent
//! withdraw deleted. A background task refreshes the lease every third of
//! the TTL; on loss it reports [`PublisherStatus::Reconnecting`] and retries
//! with a fresh lease and every name. In a store that lost its data it
//! republishes as a new incarnation (`docs/discovery.md`, "A wiped store").

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use etcd_client::{Client, Compare, CompareOp, PutOptions, Txn, TxnOp};

/// Operations per transaction when republishing (etcd's default limit is 128).
const OPS_PER_TXN: usize = 100;
use rdmareg_core::Descriptor;
use tokio::sync::{Mutex, watch};
use tokio::task::JoinHandle;

use crate::record::{Keys, NameRecord, NodeRecord, check_name};
use crate::store::{Header, Observation, StoreView};
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
    /// The connection or lease was lost and the publisher is retrying;
    /// entries may be missing from etcd.
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
    names: BTreeMap<String, Descriptor>,
    closed: bool,
    /// The node record as published (name records carry its incarnation).
    record: NodeRecord,
    /// What the responses to these writes showed of the store.
    store: StoreView,
    /// The store epoch `record` was written in.
    record_epoch: u64,
}

impl Writes {
    /// The name record of `descriptor`, under the current incarnation.
    fn name_record(&self, node: &str, descriptor: &Descriptor) -> Vec<u8> {
        NameRecord {
            node: node.to_string(),
            incarnation: self.record.incarnation,
            descriptor: descriptor.clone(),
        }
        .encode()
    }

    /// Takes in the header of a write's response (`before`: the view then).
    fn observe(&mut self, before: &StoreView, header: Option<&etcd_client::ResponseHeader>) {
        if let Some(header) = header
            && let Observation::Replaced(replacement) =
                self.store.observe(before, &Header::from(header))
        {
            tracing::warn!(%replacement, "etcd lost its data or was replaced");
        }
    }
}

struct Shared {
    client: Client,
    keys: Keys,
    node: String,
    /// A copy of `Writes::record.incarnation` readable without the lock.
    incarnation: AtomicI64,
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
    /// key and worker address, replacing another entry of the same name.
    ///
    /// # Cancel safety
    /// A dropped future may leave a lease and node key until the TTL.
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
        let mut store = StoreView::default();
        let before = store.clone();
        let status = client
            .status()
            .await
            .map_err(|e| DiscoveryError::etcd("reading the revision", e))?;
        let now = status.header().map_or(0, |h| h.revision());
        if let Some(header) = status.header() {
            store.observe(&before, &Header::from(header));
        }
        let template = NodeRecord {
            incarnation: 0,
            backend_key: backend_key.to_string(),
            worker_address,
        };
        let record = write_node(
            &mut client,
            &keys.node(node),
            lease,
            &template,
            now,
            &mut store,
        )
        .await?;
        tracing::info!(
            node,
            lease,
            incarnation = record.incarnation,
            "published node in etcd"
        );
        let (status, _) = watch::channel(PublisherStatus::Live { lease });
        let shared = Arc::new(Shared {
            client,
            keys,
            node: node.to_string(),
            incarnation: AtomicI64::new(record.incarnation),
            ttl,
            writes: Mutex::new(Writes {
                lease: Some(lease),
                names: BTreeMap::new(),
                closed: false,
                record,
                record_epoch: store.epoch(),
                store,
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

    /// This publisher's incarnation: the etcd revision of its first write,
    /// or, after etcd lost its data, of its first write to the new store.
    pub fn incarnation(&self) -> i64 {
        self.shared.incarnation.load(Ordering::Relaxed)
    }

    /// The current status; changes are reported as they happen.
    pub fn status(&self) -> watch::Receiver<PublisherStatus> {
        self.shared.status.subscribe()
    }

    /// Publishes `descriptor` under `name`, replacing whatever was there. On
    /// a transient error the name stays queued until the connection is back
    /// (unless withdrawn first).
    ///
    /// # Cancel safety
    /// The name stays queued; it may or may not be in etcd yet.
    pub async fn publish(&self, name: &str, descriptor: &Descriptor) -> Result<(), DiscoveryError> {
        check_name(name)?;
        let mut writes = self.shared.writes.lock().await;
        if writes.closed {
            return Err(DiscoveryError::Closed);
        }
        writes.names.insert(name.to_string(), descriptor.clone());
        let Some(lease) = writes.lease else {
            return Err(DiscoveryError::etcd(
                "publishing a descriptor",
                "no live lease (reconnecting); queued until the connection is back",
            ));
        };
        let value = writes.name_record(&self.shared.node, descriptor);
        let before = writes.store.clone();
        let mut client = self.shared.client.clone();
        let response = client
            .put(
                self.shared.keys.name(name),
                value,
                Some(PutOptions::new().with_lease(lease)),
            )
            .await
            .map_err(|e| DiscoveryError::etcd("publishing a descriptor", e))?;
        writes.observe(&before, response.header());
        tracing::debug!(node = %self.shared.node, name, generation = descriptor.generation(), "published descriptor");
        Ok(())
    }

    /// Withdraws `name`: call it before its region is unregistered. Only this
    /// node's entry is deleted; an unpublished name is `Ok`. On an error the
    /// name is no longer republished and its entry expires with the lease.
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
        let before = writes.store.clone();
        let mut client = self.shared.client.clone();
        let response = client
            .txn(txn)
            .await
            .map_err(|e| DiscoveryError::etcd("withdrawing a descriptor", e))?;
        writes.observe(&before, response.header());
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
            Ok(Ok(Some(response))) if response.ttl() > 0 => {}
            Ok(Ok(Some(_))) => return "etcd reports the lease expired".to_string(),
            Ok(Ok(None)) => return "keep-alive stream closed".to_string(),
            Ok(Err(e)) => return format!("keep-alive: {e}"),
            Err(_) => return format!("no keep-alive response within {period:?}"),
        }
        tokio::time::sleep(period).await;
    }
}

/// Writes the node key under `lease`, its incarnation the revision of that
/// very write: the record guesses the revision after `now`, and is written
/// again with the real one if another write took it.
async fn write_node(
    client: &mut Client,
    key: &str,
    lease: i64,
    template: &NodeRecord,
    now: i64,
    store: &mut StoreView,
) -> Result<NodeRecord, DiscoveryError> {
    let mut put = async |incarnation: i64, store: &mut StoreView| {
        let record = NodeRecord {
            incarnation,
            ..template.clone()
        };
        let before = store.clone();
        let response = client
            .put(
                key,
                record.encode(),
                Some(PutOptions::new().with_lease(lease)),
            )
            .await
            .map_err(|e| DiscoveryError::etcd("publishing the node", e))?;
        let header = response.header().map(Header::from);
        if let Some(header) = &header {
            store.observe(&before, header);
        }
        Ok::<_, DiscoveryError>((record, header.map_or(0, |h| h.revision)))
    };
    let (record, written_at) = put(now + 1, store).await?;
    if written_at == record.incarnation {
        return Ok(record);
    }
    Ok(put(written_at, store).await?.0)
}

/// A new lease, the node key and every published name under it.
async fn republish(shared: &Shared) -> Result<i64, DiscoveryError> {
    let mut client = shared.client.clone();
    // Nothing else writes while the lease is lost, so this is still
    // what the writes had seen when the grant was sent.
    let before = shared.writes.lock().await.store.clone();
    let grant = client
        .lease_grant(shared.ttl, None)
        .await
        .map_err(|e| DiscoveryError::etcd("granting a new lease", e))?;
    let lease = grant.id();
    let mut writes = shared.writes.lock().await;
    if writes.closed {
        return Err(DiscoveryError::Closed);
    }
    writes.observe(&before, grant.header());
    let options = || Some(PutOptions::new().with_lease(lease));
    let mut ops = Vec::new();
    if writes.store.epoch() == writes.record_epoch {
        ops.push(TxnOp::put(
            shared.keys.node(&shared.node),
            writes.record.encode(),
            options(),
        ));
    } else {
        // The incarnation is a revision of a store that is gone: become a
        // new incarnation of this one, as a restart would.
        let now = grant.header().map_or(0, |h| h.revision());
        let mut store = writes.store.clone();
        let record = write_node(
            &mut client,
            &shared.keys.node(&shared.node),
            lease,
            &writes.record,
            now,
            &mut store,
        )
        .await?;
        tracing::warn!(
            node = %shared.node,
            was = writes.record.incarnation,
            incarnation = record.incarnation,
            "etcd lost its data; republishing as a new incarnation"
        );
        writes.store = store;
        writes.record_epoch = writes.store.epoch();
        shared
            .incarnation
            .store(record.incarnation, Ordering::Relaxed);
        writes.record = record;
    }
    for (name, descriptor) in &writes.names {
        ops.push(TxnOp::put(
            shared.keys.name(name),
            writes.name_record(&shared.node, descriptor),
            options(),
        ));
    }
    for chunk in ops.chunks(OPS_PER_TXN) {
        let before = writes.store.clone();
        let response = client
            .txn(Txn::new().and_then(chunk.to_vec()))
            .await
            .map_err(|e| DiscoveryError::etcd("republishing after a reconnect", e))?;
        writes.observe(&before, response.header());
    }
    writes.lease = Some(lease);
    Ok(lease)
}
