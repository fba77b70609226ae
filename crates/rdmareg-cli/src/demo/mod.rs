//! `rdmareg demo`: an owner and a consumer as two OS processes.
//!
//! Without `--listen`/`--connect` the process starts a copy of itself as the
//! owner on 127.0.0.1 (an ephemeral port it reports on its first stdout
//! line), acts as the consumer, and forwards the owner's report lines. With
//! `--listen` it is only the owner; with `--connect` only the consumer, which
//! is how the demo runs across hosts.

mod consumer;
mod owner;

use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context as _, bail};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;

use crate::cli::DemoArgs;

/// First line the owner prints once it listens; the rest is the address.
pub const LISTENING_PREFIX: &str = "owner listening on ";

/// Run the demo as the arguments say.
pub async fn run(args: DemoArgs) -> anyhow::Result<()> {
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
    let program = std::env::current_exe().context("locating the rdmareg binary")?;
    let mut child = Command::new(program)
        .arg("demo")
        .args(["--listen", "127.0.0.1:0"])
        .args(["--transport", args.transport.name()])
        .args(["--size", &args.size.to_string()])
        .args(["--count", &args.count.to_string()])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .context("starting the owner process")?;
    let stdout = child.stdout.take().context("owner stdout")?;
    let mut lines = BufReader::new(stdout).lines();
    let first = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
        .await
        .context("the owner did not start listening within 30 s")?
        .context("reading the owner's output")?;
    let address = match first
        .as_deref()
        .and_then(|l| l.strip_prefix(LISTENING_PREFIX))
    {
        Some(address) => address.to_owned(),
        None => {
            let status = child.wait().await.ok();
            bail!("the owner process failed to start (exit status {status:?})");
        }
    };
    let forward = tokio::spawn(async move {
        while let Ok(Some(line)) = lines.next_line().await {
            println!("[owner] {line}");
        }
    });
    let consumer_result = consumer::run(&args, &address).await;
    let status = tokio::time::timeout(Duration::from_secs(60), child.wait())
        .await
        .context("the owner process did not exit within 60 s")?
        .context("waiting for the owner process")?;
    let _ = forward.await;
    consumer_result?;
    if !status.success() {
        bail!("the owner process failed ({status})");
    }
    Ok(())
}
