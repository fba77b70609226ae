//! `rdmareg demo`: an owner and a consumer as two OS processes; with
//! `--write` the consumer also pushes into the owner's writable ranges.
//!
//! Without `--listen`/`--connect` the process starts a copy of itself as the
//! owner on 127.0.0.1 (an ephemeral port it reports on its first stdout
//! line), acts as the consumer, and forwards the owner's report lines. With
//! `--listen` it is only the owner; with `--connect` only the consumer, which
//! is how the demo runs across hosts.

mod consumer;
mod owner;

use anyhow::{Context as _, bail};

use crate::cli::DemoArgs;
use crate::control::{self, Bounds};
use crate::owner_process::{self, OwnerProcess};

/// Run the demo as the arguments say.
pub async fn run(args: DemoArgs) -> anyhow::Result<()> {
    let _metrics = crate::metrics::serve(args.metrics_addr).await?;
    if let Some(listen) = args.listen {
        return owner::run(&args, listen).await;
    }
    if let Some(connect) = args.connect.clone() {
        return consumer::run(&args, &connect).await;
    }
    run_both(args).await
}

/// Start the owner as a child process, then be the consumer.
async fn run_both(args: DemoArgs) -> anyhow::Result<()> {
    let mut owner_args = vec![];
    if args.write {
        owner_args.push("--write".to_owned());
    }
    let owner = owner_process::start(
        &[
            "demo".to_owned(),
            "--listen".to_owned(),
            "127.0.0.1:0".to_owned(),
            "--transport".to_owned(),
            args.transport.name().to_owned(),
            "--size".to_owned(),
            args.size.to_string(),
            "--count".to_owned(),
            args.count.to_string(),
            "--get-deadline".to_owned(),
            format!("{}ms", args.limits.get_deadline.as_millis()),
            "--teardown-timeout".to_owned(),
            format!("{}ms", args.limits.teardown_timeout.as_millis()),
            // If this process dies before connecting, the owner does not wait
            // for a consumer forever.
            "--accept-timeout".to_owned(),
            format!("{}ms", owner_process::START_PATIENCE.as_millis()),
        ]
        .into_iter()
        .chain(owner_args)
        .collect::<Vec<_>>(),
    )
    .await?;
    let OwnerProcess {
        mut child,
        address,
        mut lines,
    } = owner;
    let forward = tokio::spawn(async move {
        while let Ok(Some(line)) = lines.next_line().await {
            println!("[owner] {line}");
        }
    });
    let consumer_result = consumer::run(&args, &address).await;
    // The consumer has its report or gave up on the owner; either way the
    // owner is shutting down or lost, and ends within its shutdown bound.
    let bound = Bounds::new(&args.limits).shutdown() + control::SLACK;
    let status = tokio::time::timeout(bound, child.wait())
        .await
        .with_context(|| {
            format!(
                "the owner process did not exit within {:.0} s",
                bound.as_secs_f64()
            )
        })?
        .context("waiting for the owner process")?;
    let _ = forward.await;
    consumer_result?;
    if !status.success() {
        bail!("the owner process failed ({status})");
    }
    Ok(())
}
