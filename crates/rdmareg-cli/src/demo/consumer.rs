//! The consumer side of the demo: connects to the owner, moves every offered
//! range twice — first all of them as transfer lists (one post per up to
//! [`LIST_CHUNK_BYTES`] of ranges), then one GET at a time to measure each
//! GET's latency — verifies every copy by checksum, and reports.
//!
//! With writable ranges in the offer (`--write`), it first writes the
//! pattern each asks for into it (PUT, then a notice naming the range, so
//! the owner checks its own bytes), and the read passes then read those
//! ranges back like the others.
//!
//! Every wait on the owner is bounded (see `control.rs`): a GET by its
//! deadline, the control channel by the owner's silence and by the longest
//! its shutdown may take. A lost owner ends the run with one line saying
//! what was lost and how many ranges were verified before, after this side
//! shut down in order.

use std::io::IsTerminal as _;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use indicatif::{ProgressBar, ProgressStyle};
use rdmareg_core::{PeerId, RdmaError};
use tokio::net::TcpStream;

use crate::bootstrap::{Message, OfferedRange, Tally};
use crate::cli::DemoArgs;
use crate::control::{self, Bounds, Control, ControlError};
use crate::node::{self, Node};
use crate::pattern;
use crate::stats::{Samples, mebibytes_per_second};

/// The owner, as this side names it.
const OWNER: PeerId = PeerId(1);
/// How long to keep retrying the bootstrap connection.
const CONNECT_PATIENCE: Duration = Duration::from_secs(5);
/// Bytes of ranges one transfer list moves: a list is written to one pinned
/// buffer of that size (or of one range, if a range is larger).
const LIST_CHUNK_BYTES: u64 = 64 << 20;

/// Connect to the owner at `address` and run the consumer side.
pub async fn run(args: &DemoArgs, address: &str) -> anyhow::Result<()> {
    let bounds = Bounds::new(&args.limits);
    let mut stream = connect(address).await?;
    let offer = control::receive_within(&mut stream, bounds.silence())
        .await
        .map_err(|e| anyhow::anyhow!("lost the owner at {address} before its offer: {e}"))?;
    let (worker_address, ranges) = match offer {
        Message::Offer {
            worker_address,
            ranges,
        } => (worker_address, ranges),
        other => bail!("expected an offer from the owner, got {other:?}"),
    };
    let mut control = Control::start(stream, bounds);
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
        bounds,
    )?;
    node.engine
        .add_peer(OWNER, worker_address)
        .context("adding the owner as a peer")?;

    let writes = write_all(&node, &ranges).await;
    let mut transfer = match &writes.failure {
        Some(failure) => Transfer::failed(ranges.len(), failure.clone()),
        None => transfer_all(&node, &ranges, args.plain, &control).await,
    };
    let tally = transfer.tally();
    // Close the endpoint before the owner goes away, so its departure is
    // not reported as a peer failure.
    if let Err(e) = node.engine.remove_peer(OWNER) {
        tracing::warn!(error = %e, "closing the endpoint to the owner");
    }
    // Every GET has completed: the owner may deregister. Our own shutdown
    // does not depend on the owner, so it runs while the owner's report is
    // awaited.
    let verified = transfer.failure.is_none() && transfer.copies_differing() == 0;
    let report = async {
        control.send(Message::Done { verified, tally }).await?;
        match control
            .receive("shutdown report", Some(bounds.shutdown()))
            .await?
        {
            Message::OwnerShutDown { live_registrations } => Ok(live_registrations),
            other => Err(ControlError::Protocol(format!(
                "expected its shutdown report, got {other:?}"
            ))),
        }
    };
    let (owner_report, outcome) = tokio::join!(report, node.shutdown());
    control.close(control::SLACK).await;

    if transfer.failure.is_none() {
        transfer.print_summary(args.transport.name());
        writes.print_summary();
    }
    let owner_live = owner_report.as_ref().ok().copied().flatten();
    println!(
        "owner backend registrations left: {}",
        owner_live.map_or_else(|| "unknown".to_owned(), |n| n.to_string())
    );
    println!(
        "consumer backend registrations left: {}",
        outcome.live_registrations
    );
    let so_far = format!("{} of {} ranges verified", tally.verified, transfer.ranges);
    if let Err(lost) = owner_report {
        let during = match &transfer.failure {
            Some(failure) => format!("{failure}, and then {lost}"),
            None => format!("after the transfer {lost}"),
        };
        bail!("lost the owner at {address}: {during}; {so_far} before the loss");
    }
    if let Some(failure) = &transfer.failure {
        bail!("{failure}; {so_far}");
    }
    if transfer.copies_differing() > 0 {
        bail!(
            "verification FAILED: {} copies of the {} ranges (moved once as lists, once GET by GET) differ from the owner's checksum",
            transfer.copies_differing(),
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

/// What the write pass established.
struct WritePass {
    written: usize,
    bytes: u64,
    elapsed: Duration,
    failure: Option<String>,
}

impl WritePass {
    fn print_summary(&self) {
        if self.written == 0 {
            return;
        }
        println!(
            "  written          {} ranges, {} bytes, {:.1} MiB/s (PUT, then read back above)",
            self.written,
            self.bytes,
            mebibytes_per_second(self.bytes, self.elapsed)
        );
        println!();
    }
}

/// Writes into every range the owner offered writable the pattern of the
/// range's index, then tells the owner with a notice naming the range.
async fn write_all(node: &Node, ranges: &[OfferedRange]) -> WritePass {
    let mut pass = WritePass {
        written: 0,
        bytes: 0,
        elapsed: Duration::ZERO,
        failure: None,
    };
    let writable: Vec<(usize, &OfferedRange)> = ranges
        .iter()
        .enumerate()
        .filter(|(_, range)| range.descriptor.access().allows_write())
        .collect();
    let Some(largest) = writable.iter().map(|(_, r)| r.descriptor.len()).max() else {
        return pass;
    };
    let source = match usize::try_from(largest) {
        Ok(len) => node
            .registry
            .alloc_pinned(len)
            .await
            .map_err(|e| e.to_string()),
        Err(e) => Err(e.to_string()),
    };
    let mut source = match source {
        Ok(source) => source,
        Err(e) => {
            pass.failure = Some(format!("allocating the write source: {e}"));
            return pass;
        }
    };
    let started = Instant::now();
    for (index, range) in writable {
        let len = range.descriptor.len() as usize;
        pattern::fill(&mut source[..len], index as u64);
        if let Err(e) = node
            .registry
            .put(OWNER, &mut source, &range.descriptor)
            .await
        {
            pass.failure = Some(format!("PUT of range {index} failed ({e})"));
            break;
        }
        // The notice tells the owner this range is written: it checks it.
        let notice = (index as u32).to_le_bytes().to_vec();
        if let Err(e) = node.registry.notify(OWNER, notice).await {
            pass.failure = Some(format!(
                "the notice after writing range {index} failed ({e})"
            ));
            break;
        }
        pass.written += 1;
        pass.bytes += len as u64;
    }
    pass.elapsed = started.elapsed();
    pass
}

/// What moving the ranges established (up to the first failure).
struct Transfer {
    ranges: usize,
    /// The transfer-list pass, if it ran to its end.
    lists: Option<ListPass>,
    read: usize,
    bytes: u64,
    elapsed: Duration,
    latencies: Samples,
    mismatches: usize,
    /// Why the transfer stopped early, if it did.
    failure: Option<String>,
}

async fn transfer_all(
    node: &Node,
    ranges: &[OfferedRange],
    plain: bool,
    control: &Control,
) -> Transfer {
    let mut transfer = Transfer {
        ranges: ranges.len(),
        lists: None,
        read: 0,
        bytes: 0,
        elapsed: Duration::ZERO,
        latencies: Samples::with_capacity(ranges.len()),
        mismatches: 0,
        failure: None,
    };
    match move_as_lists(node, ranges).await {
        Ok(pass) => transfer.lists = Some(pass),
        Err(e) => {
            transfer.failure = Some(e);
            return transfer;
        }
    }
    let largest = ranges.iter().map(|r| r.descriptor.len()).max().unwrap_or(1);
    let destination = match usize::try_from(largest) {
        Ok(len) => node
            .registry
            .alloc_pinned(len)
            .await
            .map_err(|e| e.to_string()),
        Err(e) => Err(e.to_string()),
    };
    let mut destination = match destination {
        Ok(destination) => destination,
        Err(e) => {
            transfer.failure = Some(format!("allocating the destination buffer: {e}"));
            return transfer;
        }
    };
    let progress = Progress::new(ranges.len() as u64, plain);
    let started = Instant::now();
    for (index, range) in ranges.iter().enumerate() {
        let len = range.descriptor.len() as usize;
        let issued = Instant::now();
        // The notice tells the owner this range is read: it may free it.
        let notice = (index as u32).to_le_bytes().to_vec();
        if let Err(e) = node
            .registry
            .get_with_notice(OWNER, &range.descriptor, &mut destination, notice)
            .await
        {
            transfer.failure = Some(format!("GET of range {index} failed ({e})"));
            break;
        }
        transfer.latencies.push(issued.elapsed());
        // A range offered under a lease is released once read, so its
        // owner may free it; a plain descriptor is no lease, and its key
        // says so.
        match node.registry.release_lease(OWNER, &range.descriptor).await {
            Ok(()) | Err(RdmaError::InvalidKey | RdmaError::Unsupported { .. }) => {}
            Err(e) => {
                transfer.failure =
                    Some(format!("releasing the lease of range {index} failed ({e})"));
                break;
            }
        }
        transfer.read += 1;
        transfer.bytes += len as u64;
        if pattern::checksum(&destination[..len]) != range.crc32 {
            transfer.mismatches += 1;
            progress.note(&format!("range {index}: checksum mismatch"));
        }
        control.set_tally(transfer.tally());
        progress.advance(index as u64 + 1);
    }
    transfer.elapsed = started.elapsed();
    progress.finish();
    transfer
}

/// What moving every range as transfer lists established.
struct ListPass {
    posts: usize,
    bytes: u64,
    elapsed: Duration,
    mismatches: usize,
}

/// Moves `ranges` as transfer lists, consecutive ranges of up to
/// [`LIST_CHUNK_BYTES`] per list, each list posted once into one buffer
/// (range after range), and verifies every range. The buffers are freed
/// before this returns, so the per-GET pass has the budget to itself.
async fn move_as_lists(node: &Node, ranges: &[OfferedRange]) -> Result<ListPass, String> {
    let mut pass = ListPass {
        posts: 0,
        bytes: 0,
        elapsed: Duration::ZERO,
        mismatches: 0,
    };
    let mut start = 0;
    while start < ranges.len() {
        // The next chunk: at least one range, then as many as fit.
        let mut end = start + 1;
        let mut chunk_bytes = ranges[start].descriptor.len();
        while end < ranges.len() && chunk_bytes + ranges[end].descriptor.len() <= LIST_CHUNK_BYTES {
            chunk_bytes += ranges[end].descriptor.len();
            end += 1;
        }
        let chunk = &ranges[start..end];
        let len = usize::try_from(chunk_bytes).map_err(|e| e.to_string())?;
        let mut list = node.registry.transfer_list(OWNER);
        let mut offsets = Vec::with_capacity(chunk.len());
        let mut offset = 0usize;
        for range in chunk {
            list.push(&range.descriptor, 0, offset)
                .map_err(|e| format!("building the transfer list: {e}"))?;
            offsets.push(offset);
            offset += range.descriptor.len() as usize;
        }
        let buffer = node
            .registry
            .alloc_pinned(len)
            .await
            .map_err(|e| format!("allocating a transfer-list buffer: {e}"))?;
        let mut buffers = [buffer];
        let posted = Instant::now();
        let outcomes = node.registry.post(&list, &mut buffers).await.map_err(|e| {
            format!(
                "posting a transfer list of {} ranges failed ({e})",
                chunk.len()
            )
        })?;
        pass.elapsed += posted.elapsed();
        for (i, outcome) in outcomes.iter().enumerate() {
            if let Err(e) = outcome {
                return Err(format!(
                    "range {} of a transfer list failed ({e})",
                    start + i
                ));
            }
        }
        for ((range, &at), index) in chunk.iter().zip(&offsets).zip(start..) {
            let bytes = &buffers[0][at..at + range.descriptor.len() as usize];
            if pattern::checksum(bytes) != range.crc32 {
                pass.mismatches += 1;
                tracing::warn!(range = index, "checksum mismatch after a transfer list");
            }
        }
        pass.posts += 1;
        pass.bytes += chunk_bytes;
        start = end;
    }
    Ok(pass)
}

impl Transfer {
    /// A transfer that never started, for `failure`.
    fn failed(ranges: usize, failure: String) -> Transfer {
        Transfer {
            ranges,
            lists: None,
            read: 0,
            bytes: 0,
            elapsed: Duration::ZERO,
            latencies: Samples::with_capacity(0),
            mismatches: 0,
            failure: Some(failure),
        }
    }

    /// Copies, list and single-GET, whose checksum did not match.
    fn copies_differing(&self) -> usize {
        self.mismatches + self.lists.as_ref().map_or(0, |l| l.mismatches)
    }

    fn tally(&self) -> Tally {
        let count = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
        Tally {
            read: count(self.read),
            verified: count(self.read - self.mismatches),
        }
    }

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
        if let Some(lists) = &self.lists {
            println!(
                "  as lists         {} bytes in {} post{}, {:.1} MiB/s",
                lists.bytes,
                lists.posts,
                if lists.posts == 1 { "" } else { "s" },
                mebibytes_per_second(lists.bytes, lists.elapsed)
            );
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
