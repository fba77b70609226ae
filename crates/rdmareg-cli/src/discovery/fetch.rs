//! `rdmareg fetch`: a consumer that finds its data through etcd.
//!
//! It resolves every name (waiting up to `--wait`), adds each owner as a
//! peer, and GETs and verifies every range, once or in rounds for `--for`,
//! applying the directory's watch between GETs: a vanished owner is
//! removed (its GETs fail at once), a returning one added under a new peer
//! id, a replaced descriptor used. It succeeds only when every name was
//! verified and no read failed or mismatched.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use futures::FutureExt as _;
use rdmareg_core::{Descriptor, PeerId};
use rdmareg_discovery::{Directory, DirectoryEvent, DirectoryWatch, DiscoveryError, Peer};
use rdmareg_registry::PinnedBuf;

use super::{etcd_config, expected_checksum, stamp};
use crate::cli::FetchArgs;
use crate::control::Bounds;
use crate::node::{self, Node};
use crate::pattern;

/// How often `--for` prints each owner's running tally.
const TALLY_EVERY: Duration = Duration::from_secs(1);

/// An owner as this consumer knows it.
struct Owner {
    peer: PeerId,
    incarnation: i64,
    worker_address: bytes::Bytes,
    gone: bool,
}

/// One name and what fetching it has established.
struct Target {
    node: String,
    descriptor: Descriptor,
    expected: u32,
    verified: u64,
    mismatched: u64,
    failed: u64,
    /// The last outcome printed (so only changes are printed).
    last: Option<String>,
    /// The etcd revision the descriptor was published at, in the store
    /// followed now (0 once etcd lost its data: then nothing is known of
    /// it until it is published again).
    revision: i64,
}

/// The consumer's view: owners, names, and the next peer id.
struct View {
    owners: HashMap<String, Owner>,
    targets: BTreeMap<String, Target>,
    next_peer: u64,
}

/// Run the consumer.
pub async fn run(args: FetchArgs) -> anyhow::Result<()> {
    let _metrics = crate::metrics::serve(args.metrics_addr).await?;
    let bounds = Bounds::new(&args.limits);
    let config = etcd_config(&args.etcd);
    let directory = Directory::connect(&config)
        .await
        .context("connecting to etcd")?;
    let mut watch = directory.watch();
    let node = Node::start(
        args.transport,
        args.net_devices.as_deref(),
        node::registry_config_for(0),
        bounds,
    )?;
    let mut view = View {
        owners: HashMap::new(),
        targets: BTreeMap::new(),
        next_peer: 1,
    };
    let fetched = fetch(&node, &directory, &mut watch, &mut view, &args).await;
    for owner in view.owners.values().filter(|o| !o.gone) {
        if let Err(e) = node.engine.remove_peer(owner.peer) {
            tracing::warn!(error = %e, "closing an endpoint");
        }
    }
    let outcome = node.shutdown().await;
    let summary = fetched.map(|()| summarize(&view));
    println!(
        "consumer backend registrations left: {}",
        outcome.live_registrations
    );
    let summary = summary?;
    if !outcome.clean {
        bail!("shutdown left registrations behind");
    }
    if let Some(problem) = summary.problem() {
        bail!("{problem}");
    }
    Ok(())
}

async fn fetch(
    node: &Node,
    directory: &Directory,
    watch: &mut DirectoryWatch,
    view: &mut View,
    args: &FetchArgs,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + args.wait;
    for name in &args.names {
        let resolved = resolve_patiently(directory, name, deadline).await?;
        let len = usize::try_from(resolved.descriptor.len()).context("range too large")?;
        view.ensure_owner(node, &resolved.peer)?;
        println!(
            "{} resolved `{name}` to owner `{}` ({} B, generation {}, revision {})",
            stamp(),
            resolved.peer.node,
            len,
            resolved.descriptor.generation(),
            resolved.revision
        );
        view.targets.insert(
            name.clone(),
            Target {
                node: resolved.peer.node.clone(),
                expected: expected_checksum(name, len),
                descriptor: resolved.descriptor,
                verified: 0,
                mismatched: 0,
                failed: 0,
                last: None,
                revision: resolved.revision,
            },
        );
    }
    let mut destination: Option<PinnedBuf> = None;
    let until = args.keep_fetching.map(|d| Instant::now() + d);
    let mut last_tally = Instant::now();
    loop {
        if until.is_some() && last_tally.elapsed() >= TALLY_EVERY {
            view.print_tally();
            last_tally = Instant::now();
        }
        let names: Vec<String> = view.targets.keys().cloned().collect();
        for name in names {
            while let Some(Some(event)) = watch.next().now_or_never() {
                view.apply(node, event);
            }
            get_one(node, view, watch, &name, &mut destination).await?;
        }
        match until {
            Some(until) if Instant::now() < until => {
                // Wait out the interval, applying events as they come.
                let pause = tokio::time::sleep(args.interval);
                tokio::pin!(pause);
                loop {
                    tokio::select! {
                        () = &mut pause => break,
                        event = watch.next() => match event {
                            Some(event) => view.apply(node, event),
                            None => bail!("the etcd watch stopped"),
                        },
                    }
                }
            }
            _ => {
                if until.is_some() {
                    view.print_tally();
                }
                return Ok(());
            }
        }
    }
}

/// Resolves `name`, retrying while it is not published (yet) or its owner is
/// gone, until `deadline`.
async fn resolve_patiently(
    directory: &Directory,
    name: &str,
    deadline: Instant,
) -> anyhow::Result<rdmareg_discovery::Resolved> {
    loop {
        match directory.resolve(name).await {
            Ok(resolved) => return Ok(resolved),
            Err(e @ (DiscoveryError::NotFound(_) | DiscoveryError::PeerGone(_)))
                if Instant::now() < deadline =>
            {
                tracing::debug!(error = %e, "waiting for `{name}`");
            }
            Err(e) if e.is_transient() && Instant::now() < deadline => {
                tracing::warn!(error = %e, "resolving `{name}`; retrying");
            }
            Err(e) => return Err(e).with_context(|| format!("resolving `{name}`")),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// GETs one name into `destination` and verifies it. Directory events that
/// arrive while the GET is in flight are applied at once: a GET to an owner
/// that is reported gone meanwhile ends as soon as the peer is dropped.
async fn get_one(
    node: &Node,
    view: &mut View,
    watch: &mut DirectoryWatch,
    name: &str,
    destination: &mut Option<PinnedBuf>,
) -> anyhow::Result<()> {
    let Some(target) = view.targets.get(name) else {
        return Ok(());
    };
    // A descriptor older than its owner's incarnation names an earlier
    // process's region; the owner republishes after registering, so wait.
    if view
        .owners
        .get(&target.node)
        .is_some_and(|owner| !owner.gone && target.revision < owner.incarnation)
    {
        return Ok(());
    }
    let len = target.descriptor.len() as usize;
    if destination.as_ref().is_none_or(|d| d.len() < len) {
        *destination = None;
        *destination = Some(
            node.registry
                .alloc_pinned(len)
                .await
                .context("allocating the destination buffer")?,
        );
    }
    let Some(buffer) = destination.as_mut() else {
        return Ok(());
    };
    let peer = view.owners.get(&target.node).map(|o| o.peer);
    let descriptor = target.descriptor.clone();
    let issued = Instant::now();
    let outcome = match peer {
        Some(peer) => {
            let get = node.registry.get(peer, &descriptor, buffer);
            tokio::pin!(get);
            let mut watching = true;
            loop {
                tokio::select! {
                    outcome = &mut get => break outcome,
                    event = watch.next(), if watching => match event {
                        Some(event) => view.apply(node, event),
                        None => watching = false,
                    },
                }
            }
        }
        None => Err(rdmareg_core::RdmaError::NotConfigured),
    };
    let took = issued.elapsed();
    let Some(target) = view.targets.get_mut(name) else {
        return Ok(());
    };
    // What happened, and (for failures) how long it took to say so.
    let (what, took_note) = match outcome {
        Ok(()) if pattern::checksum(&buffer[..len]) == target.expected => {
            target.verified += 1;
            (
                format!("GET `{name}` from `{}`: verified", target.node),
                String::new(),
            )
        }
        Ok(()) => {
            target.mismatched += 1;
            (
                format!("GET `{name}` from `{}`: CHECKSUM MISMATCH", target.node),
                String::new(),
            )
        }
        Err(e) => {
            target.failed += 1;
            (
                format!("GET `{name}` from `{}` failed: {e}", target.node),
                format!(" (after {} ms)", took.as_millis()),
            )
        }
    };
    // Print changes only: the first success, the first failure of a kind.
    if target.last.as_deref() != Some(what.as_str()) {
        println!("{} {what}{took_note}", stamp());
        target.last = Some(what);
    }
    Ok(())
}

impl View {
    /// Adds `peer` to the engine unless this incarnation is already known.
    fn ensure_owner(&mut self, node: &Node, peer: &Peer) -> anyhow::Result<()> {
        if let Some(owner) = self.owners.get(&peer.node)
            && owner.incarnation == peer.record.incarnation
            && !owner.gone
        {
            return Ok(());
        }
        if let Some(old) = self.owners.remove(&peer.node)
            && !old.gone
        {
            let _ = node.engine.remove_peer(old.peer);
        }
        let id = PeerId(self.next_peer);
        self.next_peer += 1;
        node.engine
            .add_peer(id, peer.record.worker_address.clone())
            .with_context(|| format!("adding owner `{}` as a peer", peer.node))?;
        self.owners.insert(
            peer.node.clone(),
            Owner {
                peer: id,
                incarnation: peer.record.incarnation,
                worker_address: peer.record.worker_address.clone(),
                gone: false,
            },
        );
        Ok(())
    }

    /// Prints, per owner, how many GETs verified and failed so far:
    /// `tally `owner-a`: verified 12, failed 0`.
    fn print_tally(&self) {
        let mut tallies: BTreeMap<&str, (u64, u64)> = BTreeMap::new();
        for target in self.targets.values() {
            let entry = tallies.entry(target.node.as_str()).or_default();
            entry.0 += target.verified;
            entry.1 += target.failed + target.mismatched;
        }
        let stamp = stamp();
        for (owner, (verified, failed)) in tallies {
            println!("{stamp} tally `{owner}`: verified {verified}, failed {failed}");
        }
    }

    /// Applies one directory event.
    fn apply(&mut self, node: &Node, event: DirectoryEvent) {
        match event {
            DirectoryEvent::NodeGone {
                node: name,
                incarnation,
            } => {
                let Some(owner) = self.owners.get_mut(&name) else {
                    return;
                };
                if owner.incarnation != incarnation || owner.gone {
                    return;
                }
                owner.gone = true;
                if let Err(e) = node.engine.remove_peer(owner.peer) {
                    tracing::warn!(error = %e, "removing a gone owner's peer");
                }
                println!(
                    "{} owner `{name}` gone: its lease vanished; dropped it as a peer",
                    stamp()
                );
            }
            DirectoryEvent::NodeUp(peer) => {
                // The same worker under a new incarnation (it republished
                // into an etcd that lost its data): the same process, so
                // the same peer.
                if let Some(owner) = self.owners.get_mut(&peer.node)
                    && !owner.gone
                    && owner.incarnation != peer.record.incarnation
                    && owner.worker_address == peer.record.worker_address
                {
                    owner.incarnation = peer.record.incarnation;
                    println!(
                        "{} owner `{}` republished as incarnation {} from the same worker; kept it as a peer",
                        stamp(),
                        peer.node,
                        peer.record.incarnation
                    );
                    return;
                }
                // Only an owner this consumer reads from and had lost (or
                // that restarted) is news.
                let returning = self
                    .owners
                    .get(&peer.node)
                    .is_some_and(|o| o.gone || o.incarnation != peer.record.incarnation);
                let wanted = self.targets.values().any(|t| t.node == peer.node);
                if returning && wanted {
                    match self.ensure_owner(node, &peer) {
                        Ok(()) => println!(
                            "{} owner `{}` is back (incarnation {}); added it as a peer",
                            stamp(),
                            peer.node,
                            peer.record.incarnation
                        ),
                        Err(e) => println!("{} owner `{}` is back but: {e:#}", stamp(), peer.node),
                    }
                }
            }
            DirectoryEvent::Published {
                name,
                node: owner,
                descriptor,
                revision,
            } => {
                if let Some(target) = self.targets.get_mut(&name) {
                    target.revision = revision;
                    if target.descriptor != descriptor {
                        let len = descriptor.len() as usize;
                        target.expected = expected_checksum(&name, len);
                        target.descriptor = descriptor;
                        target.node = owner;
                        println!("{} `{name}` republished by `{}`", stamp(), target.node);
                    }
                }
            }
            DirectoryEvent::Withdrawn { name } => {
                if self.targets.contains_key(&name) {
                    println!("{} `{name}` withdrawn", stamp());
                }
            }
            DirectoryEvent::Disconnected { error } => {
                println!("{} etcd watch lost ({error}); reconnecting", stamp());
            }
            DirectoryEvent::StoreReplaced { reason } => {
                for target in self.targets.values_mut() {
                    target.revision = 0;
                }
                println!(
                    "{} etcd lost its data or was replaced ({reason}); following the new store",
                    stamp()
                );
            }
            DirectoryEvent::Resynced { revision } => {
                println!("{} etcd watch resynced at revision {revision}", stamp());
            }
            other => tracing::debug!(?other, "directory event"),
        }
    }
}

/// What a whole run established.
#[derive(Debug, Default, PartialEq, Eq)]
struct Summary {
    /// Every name was verified at least once.
    all_verified: bool,
    reads: u64,
    failed: u64,
    mismatched: u64,
}

impl Summary {
    /// Why the run failed, or `None` when every name was verified and no
    /// read failed or mismatched.
    fn problem(&self) -> Option<String> {
        let mut problems = Vec::new();
        if self.failed > 0 {
            problems.push(format!("{} of {} reads failed", self.failed, self.reads));
        }
        if self.mismatched > 0 {
            problems.push(format!(
                "{} of {} reads returned wrong bytes",
                self.mismatched, self.reads
            ));
        }
        if !self.all_verified {
            problems.push("not every name was fetched and verified".to_string());
        }
        (!problems.is_empty()).then(|| problems.join("; "))
    }
}

/// Prints one line per name, and what the run established.
fn summarize(view: &View) -> Summary {
    let mut summary = Summary {
        all_verified: true,
        ..Summary::default()
    };
    for (name, target) in &view.targets {
        let gone = view.owners.get(&target.node).is_some_and(|o| o.gone);
        println!(
            "  {name:<24} owner {:<12} verified {:>5}  mismatched {:>3}  failed {:>5}{}",
            target.node,
            target.verified,
            target.mismatched,
            target.failed,
            if gone { "  (owner gone)" } else { "" }
        );
        summary.all_verified &= target.verified > 0;
        summary.reads += target.verified + target.mismatched + target.failed;
        summary.failed += target.failed;
        summary.mismatched += target.mismatched;
    }
    summary
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_run_that_verified_everything_has_no_problem() {
        let summary = Summary {
            all_verified: true,
            reads: 224,
            ..Summary::default()
        };
        assert_eq!(summary.problem(), None);
    }

    /// Reads from before the owner restarted verified and every read after
    /// failed: the run has a problem, so it does not exit 0.
    #[test]
    fn failed_reads_are_a_problem_even_when_everything_verified_once() {
        let summary = Summary {
            all_verified: true,
            reads: 224,
            failed: 180,
            mismatched: 0,
        };
        assert_eq!(
            summary.problem().as_deref(),
            Some("180 of 224 reads failed")
        );
    }

    #[test]
    fn every_problem_is_named() {
        let summary = Summary {
            all_verified: false,
            reads: 10,
            failed: 2,
            mismatched: 1,
        };
        assert_eq!(
            summary.problem().as_deref(),
            Some(
                "2 of 10 reads failed; 1 of 10 reads returned wrong bytes; \
                 not every name was fetched and verified"
            )
        );
    }
}
