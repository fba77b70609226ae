//! PUTs through the registry, beside `ucx_perftest -t ucp_put_lat /
//! ucp_put_bw` and NIXL's WRITE, in the same run.
//!
//! The benchmark owner offers a page-aligned writable buffer next to the
//! one it reads from (`put_target`; a backend without writes offers none,
//! and its lane has no PUT rows). Latency is one PUT outstanding, from one
//! pinned source. Bandwidth is the window as one transfer list of PUTs into
//! the same target range, as perftest's window writes one remote buffer:
//! `list` with each entry from its own source buffer (a user's gather
//! write), `list, one source` with every entry from one (perftest's shape,
//! as the GET rows' `list, one destination`).

use std::fmt::Write as _;
use std::time::Instant;

use anyhow::Context as _;
use rdmareg_core::Descriptor;
use rdmareg_registry::PinnedBuf;

use super::{OWNER, bandwidth_iterations, latency_iterations, nixl, run_list};
use crate::cli::TransportArg;
use crate::node::Node;
use crate::pattern;
use crate::stats::{Samples, mebibytes_per_second};

/// One size's PUT figures, with the baselines beside them.
#[derive(Debug, Clone, PartialEq)]
pub struct PutRow {
    /// The lane.
    pub transport: String,
    /// Bytes per PUT.
    pub size: u64,
    /// PUTs outstanding in the bandwidth run.
    pub window: usize,
    /// PUTs in the latency run.
    pub latency_iterations: usize,
    /// PUTs in the bandwidth run.
    pub bandwidth_iterations: usize,
    /// Registry median PUT latency, µs.
    pub latency_p50_us: f64,
    /// Registry bandwidth, MiB/s: the window as one transfer list, a
    /// source buffer per entry.
    pub list_bandwidth_mib_s: f64,
    /// The same list with every entry from one source buffer, MiB/s.
    pub list_one_source_mib_s: f64,
    /// `ucx_perftest -t ucp_put_lat` median latency, µs.
    pub perftest_latency_p50_us: Option<f64>,
    /// `ucx_perftest -t ucp_put_bw` bandwidth, MiB/s.
    pub perftest_bandwidth_mib_s: Option<f64>,
    /// NIXL's median WRITE latency, µs.
    pub nixl_latency_p50_us: Option<f64>,
    /// NIXL's WRITE bandwidth, MiB/s: the window as one request.
    pub nixl_bandwidth_mib_s: Option<f64>,
}

impl PutRow {
    /// Registry latency over perftest's (lower is better).
    pub fn latency_ratio(&self) -> Option<f64> {
        self.perftest_latency_p50_us
            .map(|p| self.latency_p50_us / p)
    }

    /// Registry bandwidth over perftest's.
    pub fn bandwidth_ratio(&self) -> Option<f64> {
        self.perftest_bandwidth_mib_s
            .map(|p| self.list_bandwidth_mib_s / p)
    }

    /// The one-source list's bandwidth over perftest's, which writes from
    /// one buffer too.
    pub fn one_source_ratio(&self) -> Option<f64> {
        self.perftest_bandwidth_mib_s
            .map(|p| self.list_one_source_mib_s / p)
    }

    /// Registry latency over NIXL's (lower is better).
    pub fn nixl_latency_ratio(&self) -> Option<f64> {
        self.nixl_latency_p50_us.map(|n| self.latency_p50_us / n)
    }

    /// Registry bandwidth over NIXL's.
    pub fn nixl_bandwidth_ratio(&self) -> Option<f64> {
        self.nixl_bandwidth_mib_s
            .map(|n| self.list_bandwidth_mib_s / n)
    }
}

/// Measures PUTs of `size` bytes into the start of `target`.
pub async fn measure(
    node: &Node,
    target: &Descriptor,
    size: u64,
    window: usize,
    scale: f64,
    transport: TransportArg,
) -> anyhow::Result<PutRow> {
    let slice = target.slice(0, size)?;
    let len = usize::try_from(size)?;
    let latency_iterations = latency_iterations(size, scale);
    let mut source = node.registry.alloc_pinned(len).await?;
    pattern::fill(&mut source, 7);
    for _ in 0..latency_iterations.div_ceil(10).max(10) {
        node.registry.put(OWNER, &mut source, &slice).await?;
    }
    let mut samples = Samples::with_capacity(latency_iterations);
    for _ in 0..latency_iterations {
        let issued = Instant::now();
        node.registry.put(OWNER, &mut source, &slice).await?;
        samples.push(issued.elapsed());
    }
    drop(source);
    let latency = samples.summary().context("no PUT latency samples")?;

    let bandwidth_iterations = bandwidth_iterations(size, window, scale);
    let mut sources: Vec<PinnedBuf> = Vec::with_capacity(window);
    for _ in 0..window {
        let mut buffer = node.registry.alloc_pinned(len).await?;
        pattern::fill(&mut buffer, 7);
        sources.push(buffer);
    }
    let mut list = node.registry.transfer_list(OWNER);
    for buffer in 0..window {
        list.push_put(&slice, buffer, 0)?;
    }
    let per_slot = bandwidth_iterations / window;
    run_list(node, &list, &mut sources, per_slot.div_ceil(10)).await?;
    let started = Instant::now();
    run_list(node, &list, &mut sources, per_slot).await?;
    let list_bandwidth = mebibytes_per_second(size * (per_slot * window) as u64, started.elapsed());
    let mut one_source = node.registry.transfer_list(OWNER);
    for _ in 0..window {
        one_source.push_put(&slice, 0, 0)?;
    }
    run_list(node, &one_source, &mut sources, per_slot.div_ceil(10)).await?;
    let started = Instant::now();
    run_list(node, &one_source, &mut sources, per_slot).await?;
    let list_one_source =
        mebibytes_per_second(size * (per_slot * window) as u64, started.elapsed());
    Ok(PutRow {
        transport: transport.name().to_owned(),
        size,
        window,
        latency_iterations,
        bandwidth_iterations: per_slot * window,
        latency_p50_us: latency.p50_us,
        list_bandwidth_mib_s: list_bandwidth,
        list_one_source_mib_s: list_one_source,
        perftest_latency_p50_us: None,
        perftest_bandwidth_mib_s: None,
        nixl_latency_p50_us: None,
        nixl_bandwidth_mib_s: None,
    })
}

/// Copies NIXL's WRITE figures into the rows of the same size.
pub fn merge_nixl(rows: &mut [PutRow], measured: &[nixl::NixlRow]) {
    for row in rows {
        if let Some(nixl) = measured.iter().find(|m| m.size == row.size) {
            row.nixl_latency_p50_us = nixl.write_latency_p50_us;
            row.nixl_bandwidth_mib_s = nixl.write_bandwidth_mib_s;
        }
    }
}

fn figure(value: Option<f64>, precision: usize) -> String {
    value.map_or_else(|| "-".to_owned(), |v| format!("{v:.precision$}"))
}

/// The PUT table as printed.
pub fn table(rows: &[PutRow]) -> String {
    let mut out = String::new();
    if rows.is_empty() {
        return out;
    }
    let _ = writeln!(
        out,
        "PUT (registry vs ucx_perftest ucp_put_lat/ucp_put_bw vs NIXL WRITE; latency ratio lower is better)"
    );
    let _ = writeln!(
        out,
        "{:<10} {:>9} {:>6} {:>10} {:>10} {:>7} {:>10} {:>7} {:>11} {:>11} {:>11} {:>7} {:>7} {:>11} {:>7}",
        "transport",
        "size",
        "window",
        "lat p50us",
        "perf us",
        "ratio",
        "nixl us",
        "ratio",
        "list MiB/s",
        "1-src MiB/s",
        "perf MiB/s",
        "ratio",
        "1-src",
        "nixl MiB/s",
        "ratio"
    );
    for r in rows {
        let _ = writeln!(
            out,
            "{:<10} {:>9} {:>6} {:>10.2} {:>10} {:>7} {:>10} {:>7} {:>11.1} {:>11.1} {:>11} {:>7} {:>7} {:>11} {:>7}",
            r.transport,
            r.size,
            r.window,
            r.latency_p50_us,
            figure(r.perftest_latency_p50_us, 2),
            figure(r.latency_ratio(), 2),
            figure(r.nixl_latency_p50_us, 2),
            figure(r.nixl_latency_ratio(), 2),
            r.list_bandwidth_mib_s,
            r.list_one_source_mib_s,
            figure(r.perftest_bandwidth_mib_s, 1),
            figure(r.bandwidth_ratio(), 2),
            figure(r.one_source_ratio(), 2),
            figure(r.nixl_bandwidth_mib_s, 1),
            figure(r.nixl_bandwidth_ratio(), 2),
        );
    }
    out
}

/// The PUT rows as CSV (`puts.csv`).
pub fn csv(rows: &[PutRow]) -> String {
    let mut out = String::from(
        "transport,size,window,latency_iterations,bandwidth_iterations,latency_p50_us,\
         list_bandwidth_mib_s,perftest_latency_p50_us,perftest_bandwidth_mib_s,\
         nixl_latency_p50_us,nixl_bandwidth_mib_s,latency_ratio,bandwidth_ratio,\
         nixl_latency_ratio,nixl_bandwidth_ratio,list_one_source_mib_s,\
         list_one_source_ratio\n",
    );
    for r in rows {
        let _ = writeln!(
            out,
            "{},{},{},{},{},{:.3},{:.1},{},{},{},{},{},{},{},{},{:.1},{}",
            r.transport,
            r.size,
            r.window,
            r.latency_iterations,
            r.bandwidth_iterations,
            r.latency_p50_us,
            r.list_bandwidth_mib_s,
            figure(r.perftest_latency_p50_us, 3),
            figure(r.perftest_bandwidth_mib_s, 1),
            figure(r.nixl_latency_p50_us, 3),
            figure(r.nixl_bandwidth_mib_s, 1),
            figure(r.latency_ratio(), 3),
            figure(r.bandwidth_ratio(), 3),
            figure(r.nixl_latency_ratio(), 3),
            figure(r.nixl_bandwidth_ratio(), 3),
            r.list_one_source_mib_s,
            figure(r.one_source_ratio(), 3),
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row() -> PutRow {
        PutRow {
            transport: "tcp".into(),
            size: 4096,
            window: 16,
            latency_iterations: 100,
            bandwidth_iterations: 160,
            latency_p50_us: 30.0,
            list_bandwidth_mib_s: 900.0,
            list_one_source_mib_s: 1200.0,
            perftest_latency_p50_us: Some(20.0),
            perftest_bandwidth_mib_s: Some(600.0),
            nixl_latency_p50_us: Some(60.0),
            nixl_bandwidth_mib_s: Some(300.0),
        }
    }

    #[test]
    fn put_ratios_compare_the_registry_to_each_baseline() {
        let r = row();
        assert_eq!(r.latency_ratio(), Some(1.5));
        assert_eq!(r.bandwidth_ratio(), Some(1.5));
        assert_eq!(r.one_source_ratio(), Some(2.0));
        assert_eq!(r.nixl_latency_ratio(), Some(0.5));
        assert_eq!(r.nixl_bandwidth_ratio(), Some(3.0));
        let bare = PutRow {
            perftest_latency_p50_us: None,
            nixl_bandwidth_mib_s: None,
            ..row()
        };
        assert_eq!(
            (bare.latency_ratio(), bare.nixl_bandwidth_ratio()),
            (None, None)
        );
    }

    #[test]
    fn the_put_csv_has_a_line_per_row_and_dashes_for_absent_figures() {
        let bare = PutRow {
            perftest_latency_p50_us: None,
            ..row()
        };
        let text = csv(&[row(), bare]);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 3);
        assert_eq!(
            lines[0].split(',').count(),
            lines[1].split(',').count(),
            "{text}"
        );
        assert!(lines[2].contains(",-,"), "{text}");
        assert!(table(&[]).is_empty());
        assert!(table(&[row()]).contains("PUT"));
    }
}
