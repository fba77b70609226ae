//! `rdmareg bench`: GETs through the registry against `ucx_perftest`, and the
//! pinned pool against map+unmap — side by side in one run, as ratios.
//!
//! An owner process (`rdmareg bench-owner`) registers and offers one pool
//! buffer; this process GETs from it: latency with one GET outstanding,
//! bandwidth with perftest's `-O` window, then `ucx_perftest -t ucp_get` on
//! the same settings. The ratio per row is the result; the libfabric lanes
//! have no baseline column. PUTs into a writable buffer the owner offers
//! beside it are measured the same way against `ucx_perftest -t
//! ucp_put_lat / ucp_put_bw` and NIXL's WRITE (`writes`). What is measured:
//! `docs/benchmarks.md`.

mod nixl;
mod perftest;
mod plot;
mod pool;
mod put_target;
mod report;
mod scatter;
mod writes;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use rdmareg_core::{Descriptor, PeerId};
use rdmareg_registry::PinnedBuf;
use tokio::net::{TcpListener, TcpStream};

use crate::bootstrap::{Message, OfferedRange, Tally};
use crate::cli::{BenchArgs, BenchOwnerArgs, LimitArgs, PeerArg, TransportArg};
use crate::control::{self, Bounds, Control, ControlError};
use crate::node::{self, Node};
use crate::owner_process::{self, LISTENING_PREFIX};
use crate::pattern;
use crate::stats::{Samples, mebibytes_per_second};

pub use report::{GetRow, PoolRow};
pub use scatter::ScatterRow;
pub use writes::PutRow;

/// The owner, as the consumer names it.
const OWNER: PeerId = PeerId(1);
/// Most bytes a bandwidth window may keep outstanding.
const WINDOW_BYTES: u64 = 256 << 20;

/// Run the benchmark.
pub async fn run(args: BenchArgs) -> anyhow::Result<()> {
    let _metrics = crate::metrics::serve(args.metrics_addr).await?;
    if args.sizes.is_empty() || args.transport.is_empty() {
        bail!("nothing to measure: give at least one size and one transport");
    }
    if !(args.scale > 0.0 && args.scale <= 100.0) {
        bail!("--scale must be in (0, 100]");
    }
    let baseline = if args.no_perftest {
        None
    } else {
        Some(perftest::Perftest {
            binary: args
                .perftest
                .clone()
                .unwrap_or_else(|| ucx_sys::install::tool_path("ucx_perftest")),
            library_dir: Some(PathBuf::from(ucx_sys::install::LIB_DIR)),
        })
    };
    let (nixl_python, mut peer_notes) = nixl_peer(&args);
    let mut rows = Vec::new();
    let mut scatter_rows = Vec::new();
    let mut put_rows = Vec::new();
    let mut port = args.perftest_port;
    for &transport in &args.transport {
        let (mut measured, scatter, mut puts) = measure_registry(&args, transport).await?;
        scatter_rows.extend(scatter);
        if let Some(perftest) = baseline.as_ref().filter(|_| !transport.is_ofi()) {
            let environment = transport_environment(transport);
            for row in &mut puts {
                let lat = perftest
                    .run_put(
                        &environment,
                        port,
                        row.size,
                        1,
                        row.latency_iterations,
                        true,
                    )
                    .with_context(|| format!("ucx_perftest PUT latency, {} B", row.size))?;
                port = port.wrapping_add(1).max(1024);
                let bw = perftest
                    .run_put(
                        &environment,
                        port,
                        row.size,
                        row.window.max(2),
                        row.bandwidth_iterations,
                        true,
                    )
                    .with_context(|| format!("ucx_perftest PUT bandwidth, {} B", row.size))?;
                port = port.wrapping_add(1).max(1024);
                row.perftest_latency_p50_us = Some(lat.p50_us);
                row.perftest_bandwidth_mib_s = Some(bw.bandwidth_mib_s);
            }
        }
        // ucx_perftest measures UCX: it is no baseline of a libfabric lane.
        if let Some(perftest) = baseline.as_ref().filter(|_| !transport.is_ofi()) {
            for row in &mut measured {
                let environment = transport_environment(transport);
                let error_handling = true;
                let lat = perftest
                    .run_get(
                        &environment,
                        port,
                        row.size,
                        1,
                        row.latency_iterations,
                        error_handling,
                    )
                    .with_context(|| format!("ucx_perftest latency, {} B", row.size))?;
                port = port.wrapping_add(1).max(1024);
                let bw = perftest
                    .run_get(
                        &environment,
                        port,
                        row.size,
                        row.window,
                        row.bandwidth_iterations,
                        error_handling,
                    )
                    .with_context(|| format!("ucx_perftest bandwidth, {} B", row.size))?;
                port = port.wrapping_add(1).max(1024);
                row.perftest_latency_p50_us = Some(lat.p50_us);
                row.perftest_bandwidth_mib_s = Some(bw.bandwidth_mib_s);
                report::print_get_row_progress(row);
            }
        }
        if let Some(python) = nixl_python.as_ref().filter(|_| !transport.is_ofi()) {
            let environment = transport_environment(transport);
            match nixl::run(python, &args.out, &environment, &nixl::specs(&measured)).await {
                Ok(nixl_rows) => {
                    nixl::merge(&mut measured, &nixl_rows);
                    writes::merge_nixl(&mut puts, &nixl_rows);
                }
                Err(e) => {
                    tracing::warn!(transport = transport.name(), error = %e, "NIXL was not measured");
                    peer_notes.push(format!("NIXL was not run on {}: {e}", transport.name()));
                }
            }
        }
        rows.extend(measured);
        put_rows.extend(puts);
    }
    if args.transport.iter().any(|t| t.is_ofi()) {
        peer_notes.push(OFI_BASELINE_NOTE.to_owned());
    }
    let pool_rows = pool::measure(&args).await?;
    report::write_all(&args.out, &rows, &scatter_rows, &pool_rows)?;
    let puts_csv = args.out.join("puts.csv");
    std::fs::write(&puts_csv, writes::csv(&put_rows))
        .with_context(|| format!("writing {}", puts_csv.display()))?;
    report::print_tables(&rows, &scatter_rows, &pool_rows);
    print!("{}", writes::table(&put_rows));
    for note in &peer_notes {
        println!("{note}");
    }
    println!("results written to {}", args.out.display());
    Ok(())
}

/// The interpreter to run NIXL with, when `--peers nixl` asks for it and
/// one is provisioned; otherwise why NIXL is not run.
fn nixl_peer(args: &BenchArgs) -> (Option<PathBuf>, Vec<String>) {
    if !args.peers.contains(&PeerArg::Nixl) {
        return (
            None,
            vec!["NIXL was not run (add --peers nixl after `cargo xtask nixl`)".to_owned()],
        );
    }
    match args
        .nixl_python
        .clone()
        .map_or_else(nixl::default_python, Ok)
    {
        Ok(python) => (Some(python), Vec::new()),
        Err(e) => {
            tracing::warn!(error = %e, "NIXL was not run");
            (None, vec![format!("NIXL was not run: {e}")])
        }
    }
}

/// Printed after a run with libfabric lanes: what their baseline is not.
const OFI_BASELINE_NOTE: &str = "libfabric lanes (ofi-tcp, ofi-shm) have no baseline column: \
     Debian's libfabric ships no fabtests (fi_rma_bw), and ucx_perftest measures UCX";

/// UCX environment selecting the same transport and tcp segment as the
/// engine, for `ucx_perftest` and NIXL.
fn transport_environment(transport: TransportArg) -> Vec<(String, String)> {
    let mut environment = vec![("UCX_NET_DEVICES".to_owned(), "lo".to_owned())];
    match transport {
        TransportArg::Tcp => environment.push(("UCX_TLS".into(), "tcp".into())),
        TransportArg::Shm | TransportArg::ShmServed => {
            environment.push(("UCX_TLS".into(), "tcp,cma".into()));
            environment.push(("UCX_CMA_MEMORY_INVALIDATE".into(), "y".into()));
        }
        // Not UCX lanes: nothing of UCX's runs on them.
        TransportArg::OfiTcp | TransportArg::OfiShm => return environment,
    }
    // The engine's segment tuning goes to the baseline and the peer too, so
    // ratios measure the library, not a segment size; an operator's own
    // setting reaches every side. `TCP_MAX_IOV` does not: only sends of
    // many ranges feel it, which perftest and NIXL never make.
    let operator_sets = |key: &str| std::env::var_os(key).is_some();
    if !operator_sets("UCX_TCP_TX_SEG_SIZE") && !operator_sets("UCX_TCP_RX_SEG_SIZE") {
        environment.push((
            "UCX_TCP_TX_SEG_SIZE".into(),
            rdmareg_ucx::UcxConfig::DEFAULT_TCP_SEND_SEGMENT.into(),
        ));
    }
    // Everything else stays at UCX's defaults: the baseline is what raw UCX
    // gives a hand-written program on the same transport.
    environment
}

fn latency_iterations(size: u64, scale: f64) -> usize {
    // At least 100 samples: a p99 of fewer is not a percentile.
    scaled((64u64 << 20) / size, 100, 10_000, scale).max(100)
}

fn bandwidth_iterations(size: u64, window: usize, scale: f64) -> usize {
    let n = scaled((1u64 << 30) / size, 32, 20_000, scale);
    n.div_ceil(window) * window
}

fn scaled(base: u64, min: u64, max: u64, scale: f64) -> usize {
    ((base.clamp(min, max) as f64 * scale).round() as usize).max(4)
}

/// Measure every size, then the scatter list, over `transport` through the
/// registry.
async fn measure_registry(
    args: &BenchArgs,
    transport: TransportArg,
) -> anyhow::Result<(Vec<GetRow>, Vec<ScatterRow>, Vec<PutRow>)> {
    let largest = *args.sizes.iter().max().unwrap_or(&8);
    let bounds = Bounds::new(&args.limits);
    let offered_size = largest.max(scatter::SCATTER_SOURCE_BYTES);
    let (mut child, stream, offered) = start_owner(transport, offered_size, &args.limits).await?;
    let mut control = Control::start(stream, bounds);
    let mut config = node::registry_config_for(largest.saturating_mul(8).max(WINDOW_BYTES * 2));
    if let Some(micros) = args.get_busy_poll_us {
        config = config.with_get_busy_poll(Duration::from_micros(micros));
    }
    let node = Node::start(transport, Some("lo"), config, bounds)?;
    let result = async {
        node.engine.add_peer(OWNER, offered.0.clone())?;
        let source = &offered.1.descriptor;
        let mut rows = Vec::new();
        for &size in &args.sizes {
            let window = (args.window as u64).min((WINDOW_BYTES / size).max(1)) as usize;
            let row = measure_size(&node, source, size, window, args.scale, transport).await?;
            report::print_get_row_progress(&row);
            rows.push(row);
        }
        let mut scatter = Vec::new();
        for layout in [scatter::Layout::Gapped, scatter::Layout::Contiguous] {
            let row = scatter::measure(&node, source, layout, args.scale, transport.name()).await?;
            tracing::info!(
                transport = transport.name(),
                layout = layout.name(),
                list_us = row.list_p50_us,
                single_us = row.single_p50_us,
                "measured the scatter list"
            );
            scatter.push(row);
        }
        verify_source(&node, &offered.1).await?;
        let mut puts = Vec::new();
        if let Some(target) = &offered.2 {
            for &size in &args.sizes {
                let window = (args.window as u64).min((WINDOW_BYTES / size).max(1)) as usize;
                let target = &target.descriptor;
                let row =
                    writes::measure(&node, target, size, window, args.scale, transport).await?;
                tracing::info!(
                    transport = transport.name(),
                    size,
                    latency_us = row.latency_p50_us,
                    list_mib_s = row.list_bandwidth_mib_s,
                    "measured PUTs"
                );
                puts.push(row);
            }
        }
        anyhow::Ok((rows, scatter, puts))
    }
    .await;
    if let Err(e) = node.engine.remove_peer(OWNER) {
        tracing::warn!(error = %e, "closing the endpoint to the benchmark owner");
    }
    let done = Message::Done {
        verified: result.is_ok(),
        tally: Tally::default(),
    };
    let owner_report = async {
        control.send(done).await?;
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
    let (owner_report, outcome) = tokio::join!(owner_report, node.shutdown());
    control.close(control::SLACK).await;
    let _ = tokio::time::timeout(bounds.shutdown(), child.wait()).await;
    let measured = result?;
    match owner_report {
        Err(lost) => bail!(
            "lost the benchmark owner after the {} runs: {lost}",
            transport.name()
        ),
        Ok(live) if live != Some(0) => bail!(
            "the benchmark owner's shutdown left {} registrations",
            live.map_or_else(|| "unknown".to_owned(), |n| n.to_string())
        ),
        Ok(_) => {}
    }
    if !outcome.clean {
        bail!(
            "the consumer's shutdown left {} registrations",
            outcome.live_registrations
        );
    }
    Ok(measured)
}

async fn measure_size(
    node: &Node,
    source: &Descriptor,
    size: u64,
    window: usize,
    scale: f64,
    transport: TransportArg,
) -> anyhow::Result<GetRow> {
    let slice = source.slice(0, size)?;
    let len = usize::try_from(size)?;
    // Latency: one GET outstanding.
    let latency_iterations = latency_iterations(size, scale);
    let mut destination = node.registry.alloc_pinned(len).await?;
    for _ in 0..latency_iterations.div_ceil(10).max(10) {
        node.registry.get(OWNER, &slice, &mut destination).await?;
    }
    let mut samples = Samples::with_capacity(latency_iterations);
    for _ in 0..latency_iterations {
        let issued = Instant::now();
        node.registry.get(OWNER, &slice, &mut destination).await?;
        samples.push(issued.elapsed());
    }
    drop(destination);
    let latency = samples.summary().context("no latency samples")?;

    // Bandwidth: `window` GETs outstanding, each into its own buffer.
    let bandwidth_iterations = bandwidth_iterations(size, window, scale);
    let mut buffers: Vec<PinnedBuf> = Vec::with_capacity(window);
    for _ in 0..window {
        buffers.push(node.registry.alloc_pinned(len).await?);
    }
    let per_slot = bandwidth_iterations / window;
    run_window(node, &slice, &mut buffers, per_slot.div_ceil(10)).await?;
    let started = Instant::now();
    run_window(node, &slice, &mut buffers, per_slot).await?;
    let elapsed = started.elapsed();
    let bandwidth = mebibytes_per_second(size * (per_slot * window) as u64, elapsed);
    // The same window as one transfer list: one batch per round.
    let mut list = node.registry.transfer_list(OWNER);
    for buffer in 0..window {
        list.push(&slice, buffer, 0)?;
    }
    run_list(node, &list, &mut buffers, per_slot.div_ceil(10)).await?;
    let started = Instant::now();
    run_list(node, &list, &mut buffers, per_slot).await?;
    let list_bandwidth = mebibytes_per_second(size * (per_slot * window) as u64, started.elapsed());
    // The same list into one buffer, as ucx_perftest's window does: only
    // this compares like with like once `window` buffers outgrow the cache.
    let mut one_destination = node.registry.transfer_list(OWNER);
    for _ in 0..window {
        one_destination.push(&slice, 0, 0)?;
    }
    run_list(node, &one_destination, &mut buffers, per_slot.div_ceil(10)).await?;
    let started = Instant::now();
    run_list(node, &one_destination, &mut buffers, per_slot).await?;
    let list_one_destination =
        mebibytes_per_second(size * (per_slot * window) as u64, started.elapsed());
    // The same window as one list, then a notice to the owner (what an
    // owner waiting for its reader to finish gets).
    run_list_with_notice(node, &list, &mut buffers, per_slot.div_ceil(10)).await?;
    let started = Instant::now();
    run_list_with_notice(node, &list, &mut buffers, per_slot).await?;
    let notice_list_bandwidth =
        mebibytes_per_second(size * (per_slot * window) as u64, started.elapsed());
    drop(buffers);
    // A GET with a notice, one outstanding.
    let notice_latency = {
        let mut destination = node.registry.alloc_pinned(len).await?;
        for round in 0..latency_iterations.div_ceil(10).max(10) {
            node.registry
                .get_with_notice(OWNER, &slice, &mut destination, notice_bytes(round))
                .await?;
        }
        let mut samples = Samples::with_capacity(latency_iterations);
        for round in 0..latency_iterations {
            let issued = Instant::now();
            node.registry
                .get_with_notice(OWNER, &slice, &mut destination, notice_bytes(round))
                .await?;
            samples.push(issued.elapsed());
        }
        samples.summary().context("no latency samples")?
    };
    Ok(GetRow {
        transport: transport.name().to_owned(),
        size,
        window,
        latency_iterations,
        bandwidth_iterations: per_slot * window,
        latency_p50_us: latency.p50_us,
        latency_p99_us: latency.p99_us,
        bandwidth_mib_s: bandwidth,
        list_bandwidth_mib_s: list_bandwidth,
        list_one_destination_mib_s: list_one_destination,
        perftest_latency_p50_us: None,
        perftest_bandwidth_mib_s: None,
        nixl_latency_p50_us: None,
        nixl_bandwidth_mib_s: None,
        nixl_request_window_mib_s: None,
        notice_latency_p50_us: notice_latency.p50_us,
        notice_list_bandwidth_mib_s: notice_list_bandwidth,
        nixl_notice_latency_p50_us: None,
        nixl_notice_bandwidth_mib_s: None,
    })
}

/// The notice of round `round`: eight bytes, as a reader would name what
/// it read.
fn notice_bytes(round: usize) -> Vec<u8> {
    (round as u64).to_le_bytes().to_vec()
}

/// Keep one GET outstanding per buffer, `rounds` times each. Each buffer
/// gets its own task, as concurrent GETs in a service would: in one task a
/// lone GET's busy-poll would hold back the futures joined behind it.
async fn run_window(
    node: &Node,
    slice: &Descriptor,
    buffers: &mut Vec<PinnedBuf>,
    rounds: usize,
) -> anyhow::Result<()> {
    let tasks: Vec<_> = buffers
        .drain(..)
        .map(|mut buffer| {
            let registry = node.registry.clone();
            let slice = slice.clone();
            tokio::spawn(async move {
                for _ in 0..rounds {
                    registry.get(OWNER, &slice, &mut buffer).await?;
                }
                anyhow::Ok(buffer)
            })
        })
        .collect();
    for task in tasks {
        buffers.push(task.await??);
    }
    Ok(())
}

/// Post `list` (one entry per buffer) `rounds` times; every entry must succeed.
async fn run_list(
    node: &Node,
    list: &rdmareg_registry::TransferList,
    buffers: &mut [PinnedBuf],
    rounds: usize,
) -> anyhow::Result<()> {
    for _ in 0..rounds {
        for outcome in node.registry.post(list, buffers).await? {
            outcome?;
        }
    }
    Ok(())
}

/// Post `list` `rounds` times, each followed by a notice to the owner once
/// every entry succeeded.
async fn run_list_with_notice(
    node: &Node,
    list: &rdmareg_registry::TransferList,
    buffers: &mut [PinnedBuf],
    rounds: usize,
) -> anyhow::Result<()> {
    for round in 0..rounds {
        for outcome in node.registry.post(list, buffers).await? {
            outcome?;
        }
        node.registry.notify(OWNER, notice_bytes(round)).await?;
    }
    Ok(())
}

/// Check once that the bytes read are the owner's (a fast benchmark of the
/// wrong bytes is worthless).
async fn verify_source(node: &Node, offered: &OfferedRange) -> anyhow::Result<()> {
    let len = usize::try_from(offered.descriptor.len())?;
    let mut destination = node.registry.alloc_pinned(len).await?;
    node.registry
        .get(OWNER, &offered.descriptor, &mut destination)
        .await?;
    if pattern::checksum(&destination) != offered.crc32 {
        bail!("benchmark source verification failed: bytes differ from the owner's");
    }
    Ok(())
}

/// The owner's worker address, the range it offers to read, and the
/// writable range it offers beside it (none on a backend without writes).
type Offered = (bytes::Bytes, OfferedRange, Option<OfferedRange>);

async fn start_owner(
    transport: TransportArg,
    size: u64,
    limits: &LimitArgs,
) -> anyhow::Result<(tokio::process::Child, TcpStream, Offered)> {
    let bounds = Bounds::new(limits);
    let owner = owner_process::start(&[
        "bench-owner".to_owned(),
        "--transport".to_owned(),
        transport.name().to_owned(),
        "--size".to_owned(),
        size.to_string(),
        "--listen".to_owned(),
        "127.0.0.1:0".to_owned(),
        "--get-deadline".to_owned(),
        format!("{}ms", limits.get_deadline.as_millis()),
        "--teardown-timeout".to_owned(),
        format!("{}ms", limits.teardown_timeout.as_millis()),
    ])
    .await?;
    let (child, address) = (owner.child, owner.address);
    let mut stream = TcpStream::connect(&address).await?;
    stream.set_nodelay(true)?;
    let offer = control::receive_within(&mut stream, bounds.silence())
        .await
        .map_err(|e| anyhow::anyhow!("lost the benchmark owner before its offer: {e}"))?;
    match offer {
        Message::Offer {
            worker_address,
            mut ranges,
        } if matches!(ranges.len(), 1 | 2) => {
            let range = ranges.remove(0);
            let writable = ranges.pop();
            Ok((child, stream, (worker_address, range, writable)))
        }
        other => bail!("unexpected offer from the benchmark owner: {other:?}"),
    }
}

/// `rdmareg bench-owner`: register one buffer, offer it, serve GETs until
/// the consumer is done or lost, shut down.
pub async fn run_owner(args: BenchOwnerArgs) -> anyhow::Result<()> {
    let bounds = Bounds::new(&args.limits);
    let listener = TcpListener::bind(args.listen).await?;
    let node = Node::start(
        args.transport,
        Some("lo"),
        node::registry_config_for(args.size),
        bounds,
    )?;
    let mut buffer = node
        .registry
        .alloc_pinned(usize::try_from(args.size)?)
        .await?;
    pattern::fill(&mut buffer, 42);
    let buffer = buffer.describe().await?;
    let offered = OfferedRange {
        descriptor: buffer.descriptor(),
        crc32: pattern::checksum(&buffer),
    };
    // A writable buffer beside it, for the PUT rows; none on a backend
    // without writes.
    let target =
        put_target::PutTarget::register(&node.registry, usize::try_from(args.size)?).await?;
    let mut ranges = vec![offered];
    if let Some(target) = &target {
        ranges.push(OfferedRange {
            descriptor: target.descriptor()?,
            crc32: 0,
        });
    }
    println!("{LISTENING_PREFIX}{}", listener.local_addr()?);
    // The parent connects as soon as it reads that line.
    let served = async {
        let (mut stream, _) =
            tokio::time::timeout(owner_process::START_PATIENCE, listener.accept())
                .await
                .context("the benchmark did not connect")??;
        stream.set_nodelay(true)?;
        control::send_within(
            &mut stream,
            &Message::Offer {
                worker_address: node.engine.worker_address(),
                ranges,
            },
            bounds.silence(),
        )
        .await?;
        let mut control = Control::start(stream, bounds);
        // The reader's notices are taken as they come, as an owner that
        // frees memory on them would.
        let notices = node.registry.notices().ok().map(|mut notices| {
            tokio::spawn(
                async move { while futures::StreamExt::next(&mut notices).await.is_some() {} },
            )
        });
        // Measurements run for minutes; heartbeats say it is still there.
        let done = control.receive("done message", None).await;
        if let Some(notices) = notices {
            notices.abort();
        }
        anyhow::Ok((control, done))
    }
    .await;
    drop(buffer);
    if let Some(target) = target
        && let Err(e) = target.unregister(bounds.teardown).await
    {
        tracing::warn!(error = %e, "unregistering the PUT target");
    }
    let outcome = node.shutdown().await;
    let lost = match served {
        Ok((control, Ok(_))) => {
            let _ = control
                .send(Message::OwnerShutDown {
                    live_registrations: Some(outcome.live_registrations as u64),
                })
                .await;
            control.close(control::SLACK).await;
            None
        }
        Ok((_, Err(lost))) => Some(anyhow::anyhow!("lost the benchmark: {lost}")),
        Err(e) => Some(e),
    };
    if !outcome.clean {
        bail!("benchmark owner shutdown was not clean");
    }
    if let Some(lost) = lost {
        return Err(lost);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bench_args(extra: &[&str]) -> BenchArgs {
        use clap::Parser as _;
        let argv = ["rdmareg", "bench"].iter().chain(extra);
        match crate::cli::Cli::try_parse_from(argv).unwrap().command {
            crate::cli::Command::Bench(args) => args,
            other => panic!("not a bench command: {other:?}"),
        }
    }

    #[test]
    fn without_peers_nixl_is_not_run_and_the_bench_says_so() {
        let (python, notes) = nixl_peer(&bench_args(&[]));
        assert_eq!(python, None);
        assert_eq!(notes.len(), 1);
        assert!(notes[0].starts_with("NIXL was not run"), "{notes:?}");
    }

    #[test]
    fn peers_nixl_runs_the_interpreter_it_is_given() {
        let (python, notes) = nixl_peer(&bench_args(&[
            "--peers",
            "nixl",
            "--nixl-python",
            "/opt/nixl/bin/python",
        ]));
        assert_eq!(python, Some(PathBuf::from("/opt/nixl/bin/python")));
        assert!(notes.is_empty(), "{notes:?}");
    }

    #[test]
    fn bandwidth_iterations_fill_whole_windows() {
        for size in [8u64, 4096, 1 << 20, 64 << 20] {
            for window in [1usize, 3, 16] {
                let n = bandwidth_iterations(size, window, 1.0);
                assert_eq!(n % window, 0, "size {size} window {window}");
                assert!(n >= window);
            }
        }
    }

    #[test]
    fn iteration_counts_shrink_with_size_and_scale() {
        assert!(latency_iterations(8, 1.0) > latency_iterations(1 << 20, 1.0));
        assert!(latency_iterations(8, 0.1) < latency_iterations(8, 1.0));
        assert!(latency_iterations(64 << 20, 0.01) >= 100);
    }
}
