//! The consumer's side: resolve names, and watch nodes come and go.
//!
//! A [`Directory`] remembers, per name, the newest entry it has handed out
//! (revision, node incarnation, generation). Both [`Directory::resolve`] and
//! the watch go through that memory, so an entry older than one already used
//! is refused ([`DiscoveryError::Stale`]) whichever path brought it: a lagging
//! read, a watch replayed after a reconnect, an old process's leftover.
//!
//! The watch task takes a snapshot of the prefix, then watches from the
//! snapshot's revision on. When the watch breaks (etcd restarted, link lost,
//! history compacted) it reports [`DirectoryEvent::Disconnected`], takes a
//! new snapshot and reports the difference — nodes that vanished meanwhile as
//! [`DirectoryEvent::NodeGone`] — then watches again.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use etcd_client::{Client, EventType, GetOptions, KeyValue, WatchOptions};
use rdmareg_core::Descriptor;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use crate::record::{KeyKind, Keys, NameRecord, NodeRecord, check_name};
use crate::{DiscoveryError, EtcdConfig};

/// A node as published: where to reach its backend.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Peer {
    /// The node's name.
    pub node: String,
    /// The node's record: incarnation, backend key, worker address.
    pub record: NodeRecord,
}

/// A name resolved to the node that published it and the descriptor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resolved {
    /// The descriptor's name.
    pub name: String,
    /// The node that published it.
    pub peer: Peer,
    /// The descriptor.
    pub descriptor: Descriptor,
    /// The etcd revision of the entry.
    pub revision: i64,
}

/// A change seen by [`Directory::watch`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum DirectoryEvent {
    /// A node appeared or republished itself (its address may have changed).
    NodeUp(Peer),
    /// A node's entry vanished: its lease expired or was revoked. Drop the
    /// peer; its descriptors are gone too.
    NodeGone {
        /// The node's name.
        node: String,
        /// The incarnation that vanished.
        incarnation: i64,
    },
    /// A descriptor was published or replaced (never an older one than
    /// already reported for the name).
    Published {
        /// The descriptor's name.
        name: String,
        /// The publishing node.
        node: String,
        /// The descriptor.
        descriptor: Descriptor,
        /// The etcd revision of the entry.
        revision: i64,
    },
    /// A descriptor was withdrawn (or vanished with its node).
    Withdrawn {
        /// The descriptor's name.
        name: String,
    },
    /// The watch lost etcd; it is reconnecting and will report what changed.
    Disconnected {
        /// Why.
        error: String,
    },
    /// The watch is connected again and caught up.
    Resynced {
        /// The revision caught up to.
        revision: i64,
    },
}

/// The newest entry handed out for one name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Seen {
    pub(crate) revision: i64,
    pub(crate) incarnation: i64,
    pub(crate) generation: u64,
}

/// Whether `candidate` may be used after `seen`: not an older revision, and
/// not an older generation of the same node incarnation, nor an entry of an
/// older incarnation.
pub(crate) fn admit(seen: Option<Seen>, candidate: Seen) -> bool {
    let Some(seen) = seen else { return true };
    if candidate.revision < seen.revision || candidate.incarnation < seen.incarnation {
        return false;
    }
    !(candidate.incarnation == seen.incarnation && candidate.generation < seen.generation)
}

type SeenMap = Arc<Mutex<HashMap<String, Seen>>>;

fn check_fresh(seen: &SeenMap, name: &str, candidate: Seen) -> Result<(), DiscoveryError> {
    let mut map = seen.lock().unwrap_or_else(|p| p.into_inner());
    let previous = map.get(name).copied();
    if !admit(previous, candidate) {
        let previous = previous.unwrap_or(candidate);
        return Err(DiscoveryError::Stale {
            name: name.to_string(),
            seen_revision: previous.revision,
            seen_generation: previous.generation,
            got_revision: candidate.revision,
            got_generation: candidate.generation,
        });
    }
    map.insert(name.to_string(), candidate);
    Ok(())
}

/// A consumer's view of a cluster in etcd.
#[derive(Clone)]
pub struct Directory {
    client: Client,
    keys: Keys,
    seen: SeenMap,
}

impl std::fmt::Debug for Directory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Directory")
            .field("keys", &self.keys)
            .finish()
    }
}

impl Directory {
    /// Connects; [`DiscoveryError::Unreachable`] if etcd does not answer.
    pub async fn connect(config: &EtcdConfig) -> Result<Self, DiscoveryError> {
        let client = config.connect().await?;
        Ok(Self {
            client,
            keys: Keys::new(config.prefix()),
            seen: Arc::default(),
        })
    }

    /// Resolves `name` to its node and descriptor.
    ///
    /// Errors: [`DiscoveryError::NotFound`] when nothing is published under
    /// the name, [`DiscoveryError::PeerGone`] when its node's lease is gone,
    /// [`DiscoveryError::Stale`] when the entry is older than one seen before.
    pub async fn resolve(&self, name: &str) -> Result<Resolved, DiscoveryError> {
        check_name(name)?;
        let mut client = self.client.clone();
        let key = self.keys.name(name);
        let answer = client
            .get(key.clone(), None)
            .await
            .map_err(|e| DiscoveryError::etcd("resolving a name", e))?;
        let Some(kv) = answer.kvs().first() else {
            return Err(DiscoveryError::NotFound(name.to_string()));
        };
        let record = NameRecord::decode(&key, kv.value())?;
        let node_key = self.keys.node(&record.node);
        let answer = client
            .get(node_key.clone(), None)
            .await
            .map_err(|e| DiscoveryError::etcd("resolving a node", e))?;
        let Some(node_kv) = answer.kvs().first() else {
            return Err(DiscoveryError::PeerGone(record.node));
        };
        let node = NodeRecord::decode(&node_key, node_kv.value())?;
        if node.incarnation != record.incarnation {
            return Err(DiscoveryError::PeerGone(record.node));
        }
        check_fresh(
            &self.seen,
            name,
            Seen {
                revision: kv.mod_revision(),
                incarnation: record.incarnation,
                generation: record.descriptor.generation(),
            },
        )?;
        Ok(Resolved {
            name: name.to_string(),
            peer: Peer {
                node: record.node,
                record: node,
            },
            descriptor: record.descriptor,
            revision: kv.mod_revision(),
        })
    }

    /// Starts watching the cluster. The first events describe what is there
    /// now (every node as [`DirectoryEvent::NodeUp`], every name as
    /// [`DirectoryEvent::Published`]); then changes follow as they happen.
    pub fn watch(&self) -> DirectoryWatch {
        let (tx, rx) = mpsc::channel(1024);
        let task = tokio::spawn(watch_loop(self.clone(), tx));
        DirectoryWatch { rx, task }
    }
}

/// A stream of [`DirectoryEvent`]s; dropping it stops the watch.
#[derive(Debug)]
pub struct DirectoryWatch {
    rx: mpsc::Receiver<DirectoryEvent>,
    task: JoinHandle<()>,
}

impl DirectoryWatch {
    /// The next event; `None` once the watch has stopped.
    ///
    /// # Cancel safety
    /// Cancel safe: an event is either returned or stays queued.
    pub async fn next(&mut self) -> Option<DirectoryEvent> {
        self.rx.recv().await
    }
}

impl Drop for DirectoryWatch {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// What the watch task believes is in etcd.
#[derive(Default)]
struct State {
    nodes: BTreeMap<String, NodeRecord>,
    /// Name → revision of the entry last reported.
    names: BTreeMap<String, i64>,
}

/// Snapshot, watch, and on failure resynchronise, until the receiver is gone.
async fn watch_loop(directory: Directory, tx: mpsc::Sender<DirectoryEvent>) {
    let mut state = State::default();
    let mut first = true;
    let mut backoff = Duration::from_millis(100);
    loop {
        let error = match watch_once(&directory, &tx, &mut state, first).await {
            Ok(()) => return,
            Err(error) => error,
        };
        first = false;
        tracing::warn!(%error, "etcd watch lost; resynchronising");
        if tx
            .send(DirectoryEvent::Disconnected { error })
            .await
            .is_err()
        {
            return;
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(2));
    }
}

/// One snapshot and one watch; `Ok` only when the receiver is gone.
async fn watch_once(
    directory: &Directory,
    tx: &mpsc::Sender<DirectoryEvent>,
    state: &mut State,
    first: bool,
) -> Result<(), String> {
    let mut client = directory.client.clone();
    let root = directory.keys.root();
    let snapshot = client
        .get(root.clone(), Some(GetOptions::new().with_prefix()))
        .await
        .map_err(|e| format!("snapshot: {e}"))?;
    let revision = snapshot.header().map_or(0, |h| h.revision());
    let mut events = Vec::new();
    // What the snapshot holds, decoded only (no freshness bookkeeping yet).
    let mut present_nodes: BTreeMap<&str, i64> = BTreeMap::new();
    let mut present_names: BTreeSet<&str> = BTreeSet::new();
    for kv in snapshot.kvs() {
        match directory.keys.classify(kv.key()) {
            KeyKind::Node(node) => {
                if let Ok(record) = NodeRecord::decode(node, kv.value()) {
                    present_nodes.insert(node, record.incarnation);
                }
            }
            KeyKind::Name(name) => {
                present_names.insert(name);
            }
            KeyKind::Other => {}
        }
    }
    // Report what vanished while the watch was away.
    let vanished: Vec<(String, i64)> = state
        .nodes
        .iter()
        .filter(|(node, record)| present_nodes.get(node.as_str()) != Some(&record.incarnation))
        .map(|(node, record)| (node.clone(), record.incarnation))
        .collect();
    for (node, incarnation) in vanished {
        state.nodes.remove(&node);
        events.push(DirectoryEvent::NodeGone { node, incarnation });
    }
    let withdrawn: Vec<String> = state
        .names
        .keys()
        .filter(|name| !present_names.contains(name.as_str()))
        .cloned()
        .collect();
    for name in withdrawn {
        state.names.remove(&name);
        events.push(DirectoryEvent::Withdrawn { name });
    }
    // Then what is new or changed (by revision) since.
    for kv in snapshot.kvs() {
        apply_put(directory, state, kv, &mut events);
    }
    if !first {
        events.push(DirectoryEvent::Resynced { revision });
    }
    for event in events {
        if tx.send(event).await.is_err() {
            return Ok(());
        }
    }
    let options = WatchOptions::new()
        .with_prefix()
        .with_start_revision(revision + 1);
    let (_watcher, mut stream) = client
        .watch(root, Some(options))
        .await
        .map_err(|e| format!("watch: {e}"))?;
    loop {
        let response = match stream.message().await {
            Ok(Some(response)) => response,
            Ok(None) => return Err("watch stream closed".to_string()),
            Err(e) => return Err(format!("watch: {e}")),
        };
        if response.canceled() {
            return Err(format!(
                "watch cancelled by etcd (compacted at {}): {}",
                response.compact_revision(),
                response.cancel_reason()
            ));
        }
        let mut events = Vec::new();
        for event in response.events() {
            let Some(kv) = event.kv() else { continue };
            match event.event_type() {
                EventType::Put => apply_put(directory, state, kv, &mut events),
                EventType::Delete => apply_delete(directory, state, kv, &mut events),
            }
        }
        for event in events {
            if tx.send(event).await.is_err() {
                return Ok(());
            }
        }
    }
}

/// Applies a put to `state`, reporting what changed.
fn apply_put(
    directory: &Directory,
    state: &mut State,
    kv: &KeyValue,
    events: &mut Vec<DirectoryEvent>,
) {
    let key = String::from_utf8_lossy(kv.key()).into_owned();
    match directory.keys.classify(kv.key()) {
        KeyKind::Node(node) => match NodeRecord::decode(&key, kv.value()) {
            Ok(record) => {
                if state.nodes.get(node) != Some(&record) {
                    if let Some(old) = state.nodes.get(node)
                        && old.incarnation != record.incarnation
                    {
                        events.push(DirectoryEvent::NodeGone {
                            node: node.to_string(),
                            incarnation: old.incarnation,
                        });
                    }
                    state.nodes.insert(node.to_string(), record.clone());
                    events.push(DirectoryEvent::NodeUp(Peer {
                        node: node.to_string(),
                        record,
                    }));
                }
            }
            Err(error) => tracing::warn!(%error, "ignoring a node record"),
        },
        KeyKind::Name(name) => match NameRecord::decode(&key, kv.value()) {
            Ok(record) => {
                let candidate = Seen {
                    revision: kv.mod_revision(),
                    incarnation: record.incarnation,
                    generation: record.descriptor.generation(),
                };
                if state.names.get(name) == Some(&kv.mod_revision()) {
                    // Already reported (a resync's snapshot).
                    return;
                }
                match check_fresh(&directory.seen, name, candidate) {
                    Ok(()) => {
                        state.names.insert(name.to_string(), kv.mod_revision());
                        events.push(DirectoryEvent::Published {
                            name: name.to_string(),
                            node: record.node,
                            descriptor: record.descriptor,
                            revision: kv.mod_revision(),
                        });
                    }
                    Err(error) => tracing::warn!(%error, "refusing a stale descriptor"),
                }
            }
            Err(error) => tracing::warn!(%error, "ignoring a name record"),
        },
        KeyKind::Other => {}
    }
}

/// Applies a delete to `state`, reporting what vanished.
fn apply_delete(
    directory: &Directory,
    state: &mut State,
    kv: &KeyValue,
    events: &mut Vec<DirectoryEvent>,
) {
    match directory.keys.classify(kv.key()) {
        KeyKind::Node(node) => {
            if let Some(record) = state.nodes.remove(node) {
                events.push(DirectoryEvent::NodeGone {
                    node: node.to_string(),
                    incarnation: record.incarnation,
                });
            }
        }
        KeyKind::Name(name) => {
            if state.names.remove(name).is_some() {
                events.push(DirectoryEvent::Withdrawn {
                    name: name.to_string(),
                });
            }
        }
        KeyKind::Other => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seen(revision: i64, incarnation: i64, generation: u64) -> Seen {
        Seen {
            revision,
            incarnation,
            generation,
        }
    }

    #[test]
    fn anything_is_admitted_for_a_name_never_seen() {
        assert!(admit(None, seen(1, 1, 1)));
    }

    #[test]
    fn an_older_revision_is_refused() {
        assert!(!admit(Some(seen(10, 5, 2)), seen(9, 5, 2)));
    }

    #[test]
    fn an_older_generation_of_the_same_incarnation_is_refused_even_at_a_newer_revision() {
        assert!(!admit(Some(seen(10, 5, 3)), seen(11, 5, 2)));
        assert!(admit(Some(seen(10, 5, 3)), seen(11, 5, 4)));
    }

    #[test]
    fn a_restarted_node_may_count_generations_from_the_start_again() {
        assert!(admit(Some(seen(10, 5, 30)), seen(12, 11, 1)));
    }

    #[test]
    fn an_entry_of_an_older_incarnation_is_refused() {
        assert!(!admit(Some(seen(10, 5, 1)), seen(12, 4, 9)));
    }
}
