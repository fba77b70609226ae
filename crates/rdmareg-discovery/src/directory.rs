//! The consumer's side: resolve names, and watch nodes come and go.
//!
//! A [`Directory`] remembers the newest entry it handed out per name, and
//! both [`Directory::resolve`] and the watch refuse anything older
//! ([`DiscoveryError::Stale`]). The watch snapshots the prefix and watches
//! from there; when it breaks it reports [`DirectoryEvent::Disconnected`],
//! snapshots again and reports the difference. When a read shows etcd lost
//! its data (`crate::store`), the directory forgets what it saw and reports
//! [`DirectoryEvent::StoreReplaced`] (`docs/discovery.md`).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use etcd_client::{Client, EventType, GetOptions, GetResponse, KeyValue, WatchOptions};
use rdmareg_core::Descriptor;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use crate::record::{KeyKind, Keys, NameRecord, NodeRecord, check_name};
use crate::store::{Header, Observation, Replacement, StoreView};
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
    /// A node appeared or republished itself (also a new incarnation from
    /// the same worker, with no [`NodeGone`](Self::NodeGone) first).
    NodeUp(Peer),
    /// A node's lease expired or was revoked: drop the peer and its names.
    NodeGone {
        /// The node's name.
        node: String,
        /// The incarnation that vanished.
        incarnation: i64,
    },
    /// A descriptor was published or replaced by a newer one.
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
    /// etcd lost its data or was replaced; what follows describes the new
    /// store, whose entries are admitted despite lower revisions.
    StoreReplaced {
        /// What showed it, e.g. `the revision went back from 303 to 6`.
        reason: String,
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

/// Whether `candidate` may be used after `seen`: no older revision,
/// incarnation, or generation of the same incarnation.
pub(crate) fn admit(seen: Option<Seen>, candidate: Seen) -> bool {
    let Some(seen) = seen else { return true };
    if candidate.revision < seen.revision || candidate.incarnation < seen.incarnation {
        return false;
    }
    !(candidate.incarnation == seen.incarnation && candidate.generation < seen.generation)
}

/// How often a read that straddled a store replacement is tried again.
const READ_ATTEMPTS: usize = 3;

/// What a directory remembers, under one lock: the store it reads from and
/// the newest entry handed out per name (revisions of that store).
#[derive(Default)]
struct Memory {
    store: StoreView,
    /// The last replacement taken in, for the watch to report.
    replaced: Option<Replacement>,
    seen: HashMap<String, Seen>,
}

type SharedMemory = Arc<Mutex<Memory>>;

fn lock(memory: &SharedMemory) -> std::sync::MutexGuard<'_, Memory> {
    memory.lock().unwrap_or_else(|p| p.into_inner())
}

/// Whether an entry may be handed out.
#[derive(Debug)]
enum Admission {
    /// Recorded as the newest entry of its name.
    Admitted,
    /// Older than one already seen.
    Stale(DiscoveryError),
    /// Read from a store replaced since: nothing recorded; read again.
    Reread,
}

/// Records `candidate` (store `epoch`) as `name`'s newest unless stale.
fn check_fresh(memory: &SharedMemory, epoch: u64, name: &str, candidate: Seen) -> Admission {
    let mut memory = lock(memory);
    if memory.store.epoch() != epoch {
        return Admission::Reread;
    }
    let previous = memory.seen.get(name).copied();
    if !admit(previous, candidate) {
        let previous = previous.unwrap_or(candidate);
        return Admission::Stale(DiscoveryError::Stale {
            name: name.to_string(),
            seen_revision: previous.revision,
            seen_generation: previous.generation,
            got_revision: candidate.revision,
            got_generation: candidate.generation,
        });
    }
    memory.seen.insert(name.to_string(), candidate);
    Admission::Admitted
}

/// Takes in the header of a response to a read issued while `before` was
/// current; on a replacement, forgets every entry seen.
fn observe(memory: &SharedMemory, before: &StoreView, header: Option<Header>) -> Observation {
    let mut memory = lock(memory);
    let Some(header) = header else {
        return if before.epoch() == memory.store.epoch() {
            Observation::Same
        } else {
            Observation::Late
        };
    };
    let observation = memory.store.observe(before, &header);
    if let Observation::Replaced(replacement) = &observation {
        tracing::warn!(
            %replacement,
            forgotten = memory.seen.len(),
            "etcd lost its data or was replaced; forgetting every revision seen"
        );
        memory.seen.clear();
        memory.replaced = Some(replacement.clone());
    }
    observation
}

/// A consumer's view of a cluster in etcd.
#[derive(Clone)]
pub struct Directory {
    client: Client,
    keys: Keys,
    memory: SharedMemory,
}

impl std::fmt::Debug for Directory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Directory")
            .field("keys", &self.keys)
            .finish()
    }
}

impl Directory {
    /// Connects; [`DiscoveryError::Unreachable`] if etcd does not respond.
    pub async fn connect(config: &EtcdConfig) -> Result<Self, DiscoveryError> {
        let client = config.connect().await?;
        Ok(Self {
            client,
            keys: Keys::new(config.prefix()),
            memory: Arc::default(),
        })
    }

    /// A linearizable read and the store epoch its response belongs to;
    /// `None` when it was issued before a replacement already taken in.
    async fn read(
        &self,
        key: String,
        options: Option<GetOptions>,
        action: &'static str,
    ) -> Result<Option<(GetResponse, u64)>, DiscoveryError> {
        let before = lock(&self.memory).store.clone();
        let mut client = self.client.clone();
        let response = client
            .get(key, options)
            .await
            .map_err(|e| DiscoveryError::etcd(action, e))?;
        let header = response.header().map(Header::from);
        Ok(match observe(&self.memory, &before, header) {
            Observation::Late => None,
            Observation::Same => Some((response, before.epoch())),
            Observation::Replaced(_) => Some((response, before.epoch() + 1)),
        })
    }

    /// Resolves `name` to its node and descriptor.
    ///
    /// Errors: [`DiscoveryError::NotFound`], [`DiscoveryError::PeerGone`]
    /// when its node's lease is gone, [`DiscoveryError::Stale`] for an entry
    /// older than one seen. After etcd lost its data, what was seen is
    /// forgotten first.
    pub async fn resolve(&self, name: &str) -> Result<Resolved, DiscoveryError> {
        check_name(name)?;
        for _ in 0..READ_ATTEMPTS {
            if let Some(resolved) = self.resolve_once(name).await? {
                return Ok(resolved);
            }
        }
        Err(DiscoveryError::etcd(
            "resolving a name",
            "the etcd store was replaced during every attempt",
        ))
    }

    /// One resolve; `None` when its two reads did not come from one store.
    async fn resolve_once(&self, name: &str) -> Result<Option<Resolved>, DiscoveryError> {
        let key = self.keys.name(name);
        let Some((response, epoch)) = self.read(key.clone(), None, "resolving a name").await?
        else {
            return Ok(None);
        };
        let Some(kv) = response.kvs().first() else {
            return Err(DiscoveryError::NotFound(name.to_string()));
        };
        let record = NameRecord::decode(&key, kv.value())?;
        let node_key = self.keys.node(&record.node);
        let Some((response, node_epoch)) = self
            .read(node_key.clone(), None, "resolving a node")
            .await?
        else {
            return Ok(None);
        };
        if node_epoch != epoch {
            return Ok(None);
        }
        let Some(node_kv) = response.kvs().first() else {
            return Err(DiscoveryError::PeerGone(record.node));
        };
        let node = NodeRecord::decode(&node_key, node_kv.value())?;
        if node.incarnation != record.incarnation {
            return Err(DiscoveryError::PeerGone(record.node));
        }
        let candidate = Seen {
            revision: kv.mod_revision(),
            incarnation: record.incarnation,
            generation: record.descriptor.generation(),
        };
        match check_fresh(&self.memory, epoch, name, candidate) {
            Admission::Admitted => {}
            Admission::Stale(error) => return Err(error),
            Admission::Reread => return Ok(None),
        }
        Ok(Some(Resolved {
            name: name.to_string(),
            peer: Peer {
                node: record.node,
                record: node,
            },
            descriptor: record.descriptor,
            revision: kv.mod_revision(),
        }))
    }

    /// Starts watching the cluster: first every node and name present now
    /// ([`DirectoryEvent::NodeUp`], [`DirectoryEvent::Published`]), then changes.
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
    /// The store epoch of the last snapshot.
    epoch: u64,
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
    let mut read = None;
    for _ in 0..READ_ATTEMPTS {
        read = directory
            .read(
                root.clone(),
                Some(GetOptions::new().with_prefix()),
                "taking a snapshot",
            )
            .await
            .map_err(|e| format!("snapshot: {e}"))?;
        if read.is_some() {
            break;
        }
    }
    let Some((snapshot, epoch)) = read else {
        return Err("snapshot: the etcd store was replaced during every attempt".to_string());
    };
    let revision = snapshot.header().map_or(0, |h| h.revision());
    let mut events = Vec::new();
    // A store replaced since the last snapshot: old revisions mean nothing.
    let replaced = !first && epoch != state.epoch;
    state.epoch = epoch;
    if replaced {
        let reason = lock(&directory.memory)
            .replaced
            .as_ref()
            .map_or_else(|| "unknown".to_string(), ToString::to_string);
        tracing::warn!(%reason, revision, "etcd store replaced; reporting it from scratch");
        events.push(DirectoryEvent::StoreReplaced { reason });
    }
    // What the snapshot holds, decoded only (no freshness bookkeeping yet).
    let mut present_nodes: BTreeMap<&str, NodeRecord> = BTreeMap::new();
    let mut present_names: BTreeSet<&str> = BTreeSet::new();
    for kv in snapshot.kvs() {
        match directory.keys.classify(kv.key()) {
            KeyKind::Node(node) => {
                if let Ok(record) = NodeRecord::decode(node, kv.value()) {
                    present_nodes.insert(node, record);
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
        .filter(|(node, record)| {
            present_nodes
                .get(node.as_str())
                .is_none_or(|present| !same_node(present, record))
        })
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
    if replaced {
        // Report every name again: its old revision was the old store's.
        state.names.clear();
    }
    // Then what is new or changed (by revision) since.
    let mut current = true;
    for kv in snapshot.kvs() {
        current &= apply_put(directory, state, kv, &mut events);
    }
    if !first && current {
        events.push(DirectoryEvent::Resynced { revision });
    }
    for event in events {
        if tx.send(event).await.is_err() {
            return Ok(());
        }
    }
    if !current {
        return Err("the etcd store was replaced during the snapshot".to_string());
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
        let mut current = true;
        for event in response.events() {
            let Some(kv) = event.kv() else { continue };
            match event.event_type() {
                EventType::Put => current &= apply_put(directory, state, kv, &mut events),
                EventType::Delete => apply_delete(directory, state, kv, &mut events),
            }
        }
        for event in events {
            if tx.send(event).await.is_err() {
                return Ok(());
            }
        }
        if !current {
            return Err("the etcd store was replaced under the watch".to_string());
        }
    }
}

/// Whether two records describe the same running node: the same incarnation
/// or the same worker (a publisher that outlived a wiped etcd republishes
/// from the same worker: no `NodeGone`).
fn same_node(a: &NodeRecord, b: &NodeRecord) -> bool {
    a.incarnation == b.incarnation
        || (a.backend_key == b.backend_key && a.worker_address == b.worker_address)
}

/// Applies a put to `state`, reporting what changed; `false` if the store
/// was replaced since the watch's snapshot (resynchronise).
fn apply_put(
    directory: &Directory,
    state: &mut State,
    kv: &KeyValue,
    events: &mut Vec<DirectoryEvent>,
) -> bool {
    let key = String::from_utf8_lossy(kv.key()).into_owned();
    match directory.keys.classify(kv.key()) {
        KeyKind::Node(node) => match NodeRecord::decode(&key, kv.value()) {
            Ok(record) => {
                if state.nodes.get(node) != Some(&record) {
                    if let Some(old) = state.nodes.get(node)
                        && !same_node(old, &record)
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
                    return true;
                }
                match check_fresh(&directory.memory, state.epoch, name, candidate) {
                    Admission::Admitted => {
                        state.names.insert(name.to_string(), kv.mod_revision());
                        events.push(DirectoryEvent::Published {
                            name: name.to_string(),
                            node: record.node,
                            descriptor: record.descriptor,
                            revision: kv.mod_revision(),
                        });
                    }
                    Admission::Stale(error) => {
                        tracing::warn!(%error, "refusing a stale descriptor");
                    }
                    Admission::Reread => return false,
                }
            }
            Err(error) => tracing::warn!(%error, "ignoring a name record"),
        },
        KeyKind::Other => {}
    }
    true
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

    #[test]
    fn a_new_incarnation_from_the_same_worker_is_the_same_node() {
        let record = |incarnation: i64, address: &'static [u8]| NodeRecord {
            incarnation,
            backend_key: "ucx".into(),
            worker_address: bytes::Bytes::from_static(address),
        };
        assert!(same_node(&record(302, b"w1"), &record(302, b"w1")));
        // Republished into an etcd that lost its data.
        assert!(same_node(&record(302, b"w1"), &record(3, b"w1")));
        // Restarted: another worker.
        assert!(!same_node(&record(302, b"w1"), &record(310, b"w2")));
    }

    fn header(revision: i64) -> Header {
        Header {
            cluster_id: 1,
            member_id: 2,
            raft_term: 2,
            revision,
        }
    }

    /// The case without etcd: a name seen at revision 303, then the
    /// store responds at revision 6 and holds the name at revision 6.
    #[test]
    fn a_replaced_store_makes_the_directory_forget_what_it_saw() {
        let memory = SharedMemory::default();
        let before = lock(&memory).store.clone();
        assert_eq!(
            observe(&memory, &before, Some(header(303))),
            Observation::Same
        );
        assert!(matches!(
            check_fresh(&memory, 0, "block-1", seen(303, 300, 1)),
            Admission::Admitted
        ));
        // The same store refuses the older entry.
        assert!(matches!(
            check_fresh(&memory, 0, "block-1", seen(6, 5, 1)),
            Admission::Stale(DiscoveryError::Stale {
                seen_revision: 303,
                ..
            })
        ));

        let before = lock(&memory).store.clone();
        assert!(matches!(
            observe(&memory, &before, Some(header(6))),
            Observation::Replaced(_)
        ));
        assert!(lock(&memory).seen.is_empty());
        assert!(lock(&memory).replaced.is_some());
        // What was read from the old store may not be recorded any more;
        // what is read from the new one is admitted.
        assert!(matches!(
            check_fresh(&memory, 0, "block-1", seen(303, 300, 1)),
            Admission::Reread
        ));
        assert!(matches!(
            check_fresh(&memory, 1, "block-1", seen(6, 5, 1)),
            Admission::Admitted
        ));
    }

    #[test]
    fn a_response_without_a_header_proves_nothing() {
        let memory = SharedMemory::default();
        let before = lock(&memory).store.clone();
        assert_eq!(observe(&memory, &before, None), Observation::Same);
        assert_eq!(
            observe(&memory, &before, Some(header(303))),
            Observation::Same
        );
        let stale = lock(&memory).store.clone();
        assert!(matches!(
            observe(&memory, &stale, Some(header(6))),
            Observation::Replaced(_)
        ));
        assert_eq!(observe(&memory, &stale, None), Observation::Late);
    }
}
