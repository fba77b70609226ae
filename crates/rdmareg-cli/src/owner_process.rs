//! Starting a copy of this binary as the owner process, as `demo` and
//! `bench` both do on one host: the child listens on an ephemeral loopback
//! port and announces it on its first stdout line ([`LISTENING_PREFIX`]).

use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context as _, bail};
use tokio::io::{AsyncBufReadExt, BufReader, Lines};
use tokio::process::{Child, ChildStdout, Command};

/// First line an owner prints once it listens; the rest is the address.
pub const LISTENING_PREFIX: &str = "owner listening on ";

/// How long an owner may take to start listening (and, once listening, how
/// long it waits for its parent to connect).
pub const START_PATIENCE: Duration = Duration::from_secs(30);

/// A started owner process.
pub struct OwnerProcess {
    /// The child; killed if dropped.
    pub child: Child,
    /// Where it listens for the bootstrap connection.
    pub address: String,
    /// The rest of its standard output.
    pub lines: Lines<BufReader<ChildStdout>>,
}

/// Run this binary with `args` (which must make it listen on
/// `127.0.0.1:0`) and wait for it to announce its address.
pub async fn start(args: &[String]) -> anyhow::Result<OwnerProcess> {
    let program = std::env::current_exe().context("locating the rdmareg binary")?;
    let mut child = Command::new(program)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .context("starting the owner process")?;
    let stdout = child.stdout.take().context("owner stdout")?;
    let mut lines = BufReader::new(stdout).lines();
    let first = tokio::time::timeout(START_PATIENCE, lines.next_line())
        .await
        .context("the owner did not start listening within 30 s")?
        .context("reading the owner's output")?;
    match first
        .as_deref()
        .and_then(|l| l.strip_prefix(LISTENING_PREFIX))
    {
        Some(address) => Ok(OwnerProcess {
            address: address.to_owned(),
            child,
            lines,
        }),
        None => {
            let status = child.wait().await.ok();
            bail!("the owner process failed to start (exit status {status:?})")
        }
    }
}
