//! The consumer side of the demo: connects to the owner, GETs every offered
//! range into a pinned buffer, verifies it by checksum, and reports.

use std::io::IsTerminal as _;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use indicatif::{ProgressBar, ProgressStyle};
use rdmareg_core::PeerId;
use tokio::net::TcpStream;

use crate::bootstrap::{self, Message, OfferedRange};
use crate::cli::DemoArgs;
use crate::node::{self, Node};
use crate::pattern;
use crate::stats::{Samples, mebibytes_per_second};

/// The owner, as this side names it.
const OWNER: PeerId = PeerId(1);
/// How long to keep retrying the bootstrap connection.
const CONNECT_PATIENCE: Duration = Duration::from_secs(5);

/// Connect to the owner at `address` and run the consumer side.
pub async fn run(args: &DemoArgs, address: &str) -> anyhow::Result<()> {
    let mut stream = connect(address).await?;
    let (worker_address, ranges) = match bootstrap::receive(&mut stream)
        .await
        .context("receiving the owner's offer")?
    {
        Message::Offer {
            worker_address,
            ranges,
        } => (worker_address, ranges),
        other => bail!("expected an offer from the owner, got {other:?}"),
    };
    let largest = ranges
        .iter()
        .map(|r| r.descriptor.len())
        .max()
        .context("the owner offered nothing")?;
    let net_devices = args
        .net_devices
        .clone()
        .or_else(|| node::is_loopback(address).then(|| "lo".to_owned()));
    let node = Node::start(
        args.transport,
        net_devices.as_deref(),
        node::registry_config_for(largest),
    )?;
    node.engine
        .add_peer(OWNER, worker_address)
        .context("adding the owner as a peer")?;

    let transfer = transfer_all(&node, &ranges, args.plain).await;
    let verified = transfer.as_ref().is_ok_and(|t| t.mismatches == 0);
    // Close the endpoint before the owner goes away, so its departure is
    // not reported as a peer failure.
    if let Err(e) = node.engine.remove_peer(OWNER) {
        tracing::warn!(error = %e, "closing the endpoint to the owner");
    }
    bootstrap::send(&mut stream, &Message::Done { verified }).await?;
    let owner_live = match bootstrap::receive(&mut stream).await {
        Ok(Message::OwnerShutDown { live_registrations }) => live_registrations,
        Ok(other) => bail!("unexpected message from the owner: {other:?}"),
        Err(e) => bail!("the owner did not report its shutdown: {e}"),
    };
    let outcome = node.shutdown().await;

    let mut transfer = transfer?;
    transfer.print_summary(args.transport.name());
    println!(
        "owner backend registrations left: {}",
        owner_live.map_or_else(|| "unknown".to_owned(), |n| n.to_string())
    );
    println!(
        "consumer backend registrations left: {}",
        outcome.live_registrations
    );
    if transfer.mismatches > 0 {
        bail!(
            "verification FAILED: {} of {} ranges differ from the owner's checksum",
            transfer.mismatches,
            transfer.ranges
        );
    }
    println!(
        "verification passed: {} ranges, every byte matches",
        transfer.ranges
    );
    if !outcome.clean || owner_live != Some(0) {
        bail!("shutdown left registrations behind");
    }
    println!("shutdown complete: both backends hold zero registrations");
    Ok(())
}

async fn connect(address: &str) -> anyhow::Result<TcpStream> {
    let deadline = Instant::now() + CONNECT_PATIENCE;
    loop {
        match TcpStream::connect(address).await {
            Ok(stream) => {
                stream.set_nodelay(true)?;
                return Ok(stream);
            }
            Err(e) if Instant::now() >= deadline => {
                bail!("cannot reach the owner at {address}: {e}")
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}

/// What moving every range established.
struct Transfer {
    ranges: usize,
    bytes: u64,
    elapsed: Duration,
    latencies: Samples,
    mismatches: usize,
}

async fn transfer_all(
    node: &Node,
    ranges: &[OfferedRange],
    plain: bool,
) -> anyhow::Result<Transfer> {
    let largest = ranges.iter().map(|r| r.descriptor.len()).max().unwrap_or(1);
    let mut destination = node
        .registry
        .alloc_pinned(usize::try_from(largest)?)
        .await
        .context("allocating the destination buffer")?;
    let progress = Progress::new(ranges.len() as u64, plain);
    let mut latencies = Samples::with_capacity(ranges.len());
    let mut mismatches = 0;
    let mut bytes = 0;
    let started = Instant::now();
    for (index, range) in ranges.iter().enumerate() {
        let len = range.descriptor.len() as usize;
        let issued = Instant::now();
        node.registry
            .get(OWNER, &range.descriptor, &mut destination)
            .await
            .with_context(|| format!("GET of range {index}"))?;
        latencies.push(issued.elapsed());
        bytes += len as u64;
        if pattern::checksum(&destination[..len]) != range.crc32 {
            mismatches += 1;
            progress.note(&format!("range {index}: checksum mismatch"));
        }
        progress.advance(index as u64 + 1);
    }
    let elapsed = started.elapsed();
    progress.finish();
    Ok(Transfer {
        ranges: ranges.len(),
        bytes,
        elapsed,
        latencies,
        mismatches,
    })
}

impl Transfer {
    fn print_summary(&mut self, transport: &str) {
        let summary = self.latencies.summary();
        let gigabytes_per_second = self.bytes as f64 / self.elapsed.as_secs_f64().max(1e-9) / 1e9;
        println!();
        println!("  transport        {transport}");
        println!("  ranges           {}", self.ranges);
        println!("  bytes moved      {}", self.bytes);
        println!(
            "  throughput       {gigabytes_per_second:.3} GB/s ({:.1} MiB/s)",
            mebibytes_per_second(self.bytes, self.elapsed)
        );
        if let Some(s) = summary {
            println!("  GET latency p50  {:.1} µs", s.p50_us);
            println!("  GET latency p99  {:.1} µs", s.p99_us);
        }
        println!();
    }
}

/// A progress bar on a terminal, a few plain lines otherwise.
struct Progress {
    bar: Option<ProgressBar>,
    total: u64,
}

impl Progress {
    fn new(total: u64, plain: bool) -> Self {
        let bar = (!plain && std::io::stdout().is_terminal()).then(|| {
            let bar = ProgressBar::new(total);
            if let Ok(style) =
                ProgressStyle::with_template("{spinner} GET {pos}/{len} [{bar:40}] {elapsed}")
            {
                bar.set_style(style.progress_chars("=> "));
            }
            bar
        });
        Progress { bar, total }
    }

    fn advance(&self, done: u64) {
        match &self.bar {
            Some(bar) => bar.set_position(done),
            None => {
                let quarter = self.total.div_ceil(4).max(1);
                if done % quarter == 0 || done == self.total {
                    println!("GET {done}/{}", self.total);
                }
            }
        }
    }

    fn note(&self, text: &str) {
        match &self.bar {
            Some(bar) => bar.println(text),
            None => println!("{text}"),
        }
    }

    fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}
