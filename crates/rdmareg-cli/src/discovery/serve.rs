//! `rdmareg serve`: an owner that publishes its registered memory in etcd.
//!
//! Order: register every range → publish the node (worker address, under a
//! lease) → publish each range's descriptor → serve GETs until stopped →
//! withdraw each name → revoke the lease → deregister → engine teardown. A
//! name is withdrawn before its buffer goes back to the pool, so no
//! descriptor stays published after its registration is gone; if this
//! process dies instead, the lease takes every name with it within the TTL.

use std::time::Duration;

use anyhow::{Context as _, bail};
use rdmareg_discovery::{Publisher, PublisherStatus};
use rdmareg_registry::DescribedBuf;

use super::{etcd_config, range_name, seed_for, stamp};
use crate::cli::ServeArgs;
use crate::control::Bounds;
use crate::node::{self, Node};
use crate::pattern;

/// Run the owner until SIGINT, SIGTERM or `--duration`.
pub async fn run(args: ServeArgs) -> anyhow::Result<()> {
    let _metrics = crate::metrics::serve(args.metrics_addr).await?;
    let bounds = Bounds::new(&args.limits);
    let total = args.size.saturating_mul(u64::from(args.count));
    let node = Node::start(
        args.transport,
        args.net_devices.as_deref(),
        node::registry_config_for(total),
        bounds,
    )?;
    let served = serve(&node, &args).await;
    let outcome = node.shutdown().await;
    println!(
        "owner {} shut down: backend holds {} registrations",
        args.name, outcome.live_registrations
    );
    served?;
    if !outcome.clean {
        bail!(
            "owner shutdown was not clean: the backend holds {} registrations",
            outcome.live_registrations
        );
    }
    Ok(())
}

async fn serve(node: &Node, args: &ServeArgs) -> anyhow::Result<()> {
    let size = usize::try_from(args.size).context("size does not fit this machine")?;
    let mut ranges: Vec<(String, DescribedBuf)> = Vec::with_capacity(args.count as usize);
    let mut descriptors = Vec::with_capacity(args.count as usize);
    for index in 0..args.count {
        let name = range_name(&args.name, index);
        let mut buffer = node
            .registry
            .alloc_pinned(size)
            .await
            .context("allocating a pool buffer")?;
        pattern::fill(&mut buffer, seed_for(&name));
        let buffer = buffer.describe().await?;
        descriptors.push(buffer.descriptor());
        ranges.push((name, buffer));
    }
    let backend_key = descriptors
        .first()
        .map(|d| d.backend_key().to_owned())
        .context("nothing registered")?;
    let config = etcd_config(&args.etcd);
    let publisher = Publisher::start(
        &config,
        &args.name,
        &backend_key,
        node.engine.worker_address(),
    )
    .await
    .context("publishing this owner in etcd")?;
    for ((name, _), descriptor) in ranges.iter().zip(&descriptors) {
        publisher
            .publish(name, descriptor)
            .await
            .with_context(|| format!("publishing `{name}`"))?;
    }
    println!(
        "{} serving {} ranges of {size} B as `{}` ({}.0 … {}.{}), lease ttl {} s",
        stamp(),
        ranges.len(),
        args.name,
        args.name,
        args.name,
        args.count - 1,
        config.ttl_secs()
    );

    report_until_stopped(&publisher, args.duration).await;

    // Withdraw before the registrations go: never a name without memory.
    for (name, _) in &ranges {
        if let Err(e) = publisher.withdraw(name).await {
            eprintln!("rdmareg: withdrawing `{name}`: {e}; it expires with the lease");
        }
    }
    if let Err(e) = publisher.shutdown().await {
        eprintln!(
            "rdmareg: revoking the lease: {e}; the entries expire within {} s",
            config.ttl_secs()
        );
    }
    println!("{} withdrew `{}` from etcd", stamp(), args.name);
    drop(ranges);
    Ok(())
}

/// Prints the publisher's status changes until a stop signal or `duration`.
async fn report_until_stopped(publisher: &Publisher, duration: Option<Duration>) {
    let mut status = publisher.status();
    let stop = stop_signal(duration);
    tokio::pin!(stop);
    loop {
        tokio::select! {
            () = &mut stop => return,
            changed = status.changed() => {
                if changed.is_err() {
                    return;
                }
                let line = match &*status.borrow_and_update() {
                    PublisherStatus::Live { lease } => {
                        format!("etcd connection live again (lease {lease:x}); publishing resumed")
                    }
                    PublisherStatus::Reconnecting { attempts: 0, error } => {
                        format!("etcd connection lost ({error}); reconnecting")
                    }
                    PublisherStatus::Reconnecting { .. } => continue,
                    _ => return,
                };
                println!("{} {line}", stamp());
            }
        }
    }
}

/// Resolves on SIGINT, SIGTERM, or after `duration`.
async fn stop_signal(duration: Option<Duration>) {
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot watch SIGTERM");
                std::future::pending::<()>().await;
            }
        }
    };
    let elapsed = async {
        match duration {
            Some(duration) => tokio::time::sleep(duration).await,
            None => std::future::pending().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        () = terminate => {}
        () = elapsed => {}
    }
}
