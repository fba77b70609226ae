//! Benchmark rows, the printed tables, and the CSV / JSON / SVG files.

use std::fmt::Write as _;
use std::path::Path;

use anyhow::Context as _;
use serde::Serialize;

use crate::bench::plot::{self, Chart, Series, format_size};

/// One message size on one transport.
#[derive(Debug, Clone, Serialize)]
pub struct GetRow {
    /// `tcp` or `shm`.
    pub transport: String,
    /// Bytes per GET.
    pub size: u64,
    /// Outstanding GETs in the bandwidth run.
    pub window: usize,
    /// GETs in the latency run.
    pub latency_iterations: usize,
    /// GETs in the bandwidth run.
    pub bandwidth_iterations: usize,
    /// Registry median GET latency, µs.
    pub latency_p50_us: f64,
    /// Registry 99th-percentile GET latency, µs.
    pub latency_p99_us: f64,
    /// Registry bandwidth, MiB/s: the window as separate GETs.
    pub bandwidth_mib_s: f64,
    /// Registry bandwidth, MiB/s: the window posted as one transfer list.
    pub list_bandwidth_mib_s: f64,
    /// ucx_perftest median latency, µs.
    pub perftest_latency_p50_us: Option<f64>,
    /// ucx_perftest bandwidth, MiB/s.
    pub perftest_bandwidth_mib_s: Option<f64>,
}

impl GetRow {
    /// Registry bandwidth over perftest's (≥ 0.95 is the target).
    pub fn bandwidth_ratio(&self) -> Option<f64> {
        self.perftest_bandwidth_mib_s
            .filter(|p| *p > 0.0)
            .map(|p| self.bandwidth_mib_s / p)
    }
    /// List bandwidth over perftest's.
    pub fn list_bandwidth_ratio(&self) -> Option<f64> {
        self.perftest_bandwidth_mib_s
            .filter(|p| *p > 0.0)
            .map(|p| self.list_bandwidth_mib_s / p)
    }
    /// Registry latency over perftest's (lower is better).
    pub fn latency_ratio(&self) -> Option<f64> {
        self.perftest_latency_p50_us
            .filter(|p| *p > 0.0)
            .map(|p| self.latency_p50_us / p)
    }
    /// Registry latency minus perftest's, µs.
    pub fn latency_gap_us(&self) -> Option<f64> {
        self.perftest_latency_p50_us
            .map(|p| self.latency_p50_us - p)
    }
}

/// One pool size.
#[derive(Debug, Clone, Serialize)]
pub struct PoolRow {
    /// Bytes per allocation.
    pub size: u64,
    /// Iterations measured.
    pub iterations: usize,
    /// Median `alloc_pinned` + drop, ns.
    pub alloc_free_p50_ns: f64,
    /// 99th-percentile `alloc_pinned` + drop, ns.
    pub alloc_free_p99_ns: f64,
    /// Median backend `map` + `unmap`, ns.
    pub map_unmap_p50_ns: f64,
    /// 99th-percentile backend `map` + `unmap`, ns.
    pub map_unmap_p99_ns: f64,
}

fn ratio(value: Option<f64>) -> String {
    value.map_or_else(|| "-".to_owned(), |v| format!("{v:.2}"))
}

fn optional(value: Option<f64>, precision: usize) -> String {
    value.map_or_else(|| "-".to_owned(), |v| format!("{v:.precision$}"))
}

/// One line per measured row while the benchmark runs.
pub fn print_get_row_progress(row: &GetRow) {
    tracing::info!(
        transport = %row.transport,
        size = row.size,
        latency_us = row.latency_p50_us,
        bandwidth_mib_s = row.bandwidth_mib_s,
        "measured"
    );
}

/// The GET and pool tables as text.
pub fn tables(rows: &[GetRow], pool_rows: &[PoolRow]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "| transport | size | window | rdmareg p50 µs | perftest p50 µs | gap µs | latency ratio | rdmareg MiB/s | list MiB/s | perftest MiB/s | bandwidth ratio | list ratio |"
    );
    let _ = writeln!(
        out,
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    );
    for row in rows {
        let _ = writeln!(
            out,
            "| {} | {} | {} | {:.2} | {} | {} | {} | {:.1} | {:.1} | {} | {} | {} |",
            row.transport,
            format_size(row.size),
            row.window,
            row.latency_p50_us,
            optional(row.perftest_latency_p50_us, 2),
            optional(row.latency_gap_us(), 2),
            ratio(row.latency_ratio()),
            row.bandwidth_mib_s,
            row.list_bandwidth_mib_s,
            optional(row.perftest_bandwidth_mib_s, 1),
            ratio(row.bandwidth_ratio()),
            ratio(row.list_bandwidth_ratio()),
        );
    }
    if !pool_rows.is_empty() {
        let _ = writeln!(out);
        let _ = writeln!(
            out,
            "| pool size | alloc+free p50 ns | alloc+free p99 ns | map+unmap p50 ns | map+unmap p99 ns | map+unmap / alloc+free |"
        );
        let _ = writeln!(out, "|---:|---:|---:|---:|---:|---:|");
        for row in pool_rows {
            let _ = writeln!(
                out,
                "| {} | {:.0} | {:.0} | {:.0} | {:.0} | {:.1} |",
                format_size(row.size),
                row.alloc_free_p50_ns,
                row.alloc_free_p99_ns,
                row.map_unmap_p50_ns,
                row.map_unmap_p99_ns,
                row.map_unmap_p50_ns / row.alloc_free_p50_ns.max(1.0),
            );
        }
    }
    out
}

/// Print both tables.
pub fn print_tables(rows: &[GetRow], pool_rows: &[PoolRow]) {
    println!("{}", tables(rows, pool_rows));
}

/// CSV of the GET rows.
pub fn csv(rows: &[GetRow]) -> String {
    let mut out = String::from(
        "transport,size,window,latency_iterations,bandwidth_iterations,latency_p50_us,latency_p99_us,perftest_latency_p50_us,latency_ratio,bandwidth_mib_s,list_bandwidth_mib_s,perftest_bandwidth_mib_s,bandwidth_ratio,list_bandwidth_ratio\n",
    );
    let cell = |v: Option<f64>| v.map_or_else(String::new, |v| format!("{v:.4}"));
    for r in rows {
        let _ = writeln!(
            out,
            "{},{},{},{},{},{:.4},{:.4},{},{},{:.4},{:.4},{},{},{}",
            r.transport,
            r.size,
            r.window,
            r.latency_iterations,
            r.bandwidth_iterations,
            r.latency_p50_us,
            r.latency_p99_us,
            cell(r.perftest_latency_p50_us),
            cell(r.latency_ratio()),
            r.bandwidth_mib_s,
            r.list_bandwidth_mib_s,
            cell(r.perftest_bandwidth_mib_s),
            cell(r.bandwidth_ratio()),
            cell(r.list_bandwidth_ratio()),
        );
    }
    out
}

/// The charts: latency and bandwidth per transport, registry against perftest.
pub fn charts(rows: &[GetRow]) -> Vec<Chart> {
    let mut transports: Vec<&str> = rows.iter().map(|r| r.transport.as_str()).collect();
    transports.dedup();
    let series = |transport: &str, pick: fn(&GetRow) -> Option<f64>| -> Vec<(u64, f64)> {
        rows.iter()
            .filter(|r| r.transport == transport)
            .filter_map(|r| pick(r).map(|v| (r.size, v)))
            .collect()
    };
    let mut charts = Vec::new();
    for transport in transports {
        charts.push(Chart {
            title: format!("GET latency, {transport} (median, one outstanding)"),
            y_label: "µs".into(),
            series: vec![
                Series {
                    label: "rdmareg".into(),
                    colour: "#d62728",
                    points: series(transport, |r| Some(r.latency_p50_us)),
                },
                Series {
                    label: "ucx_perftest".into(),
                    colour: "#1f77b4",
                    points: series(transport, |r| r.perftest_latency_p50_us),
                },
            ],
        });
        charts.push(Chart {
            title: format!("GET bandwidth, {transport} (window of outstanding GETs)"),
            y_label: "MiB/s".into(),
            series: vec![
                Series {
                    label: "rdmareg".into(),
                    colour: "#d62728",
                    points: series(transport, |r| Some(r.bandwidth_mib_s)),
                },
                Series {
                    label: "rdmareg, one list".into(),
                    colour: "#2ca02c",
                    points: series(transport, |r| Some(r.list_bandwidth_mib_s)),
                },
                Series {
                    label: "ucx_perftest".into(),
                    colour: "#1f77b4",
                    points: series(transport, |r| r.perftest_bandwidth_mib_s),
                },
            ],
        });
    }
    charts
}

/// Write results.csv, pool.csv, results.json, results.svg and results.md
/// into `dir`.
pub fn write_all(dir: &Path, rows: &[GetRow], pool_rows: &[PoolRow]) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let write = |name: &str, contents: String| {
        let path = dir.join(name);
        std::fs::write(&path, contents).with_context(|| format!("writing {}", path.display()))
    };
    write("results.csv", csv(rows))?;
    let mut pool_csv = String::from(
        "size,iterations,alloc_free_p50_ns,alloc_free_p99_ns,map_unmap_p50_ns,map_unmap_p99_ns\n",
    );
    for r in pool_rows {
        let _ = writeln!(
            pool_csv,
            "{},{},{:.1},{:.1},{:.1},{:.1}",
            r.size,
            r.iterations,
            r.alloc_free_p50_ns,
            r.alloc_free_p99_ns,
            r.map_unmap_p50_ns,
            r.map_unmap_p99_ns
        );
    }
    write("pool.csv", pool_csv)?;
    #[derive(Serialize)]
    struct Results<'a> {
        get: &'a [GetRow],
        pool: &'a [PoolRow],
    }
    write(
        "results.json",
        serde_json::to_string_pretty(&Results {
            get: rows,
            pool: pool_rows,
        })?,
    )?;
    write("results.svg", plot::render(&charts(rows)))?;
    write("results.md", tables(rows, pool_rows))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(perftest: Option<f64>) -> GetRow {
        GetRow {
            transport: "tcp".into(),
            size: 65536,
            window: 16,
            latency_iterations: 10,
            bandwidth_iterations: 16,
            latency_p50_us: 10.0,
            latency_p99_us: 12.0,
            bandwidth_mib_s: 950.0,
            list_bandwidth_mib_s: 1100.0,
            perftest_latency_p50_us: perftest.map(|_| 8.0),
            perftest_bandwidth_mib_s: perftest,
        }
    }

    #[test]
    fn ratios_compare_registry_to_perftest() {
        let r = row(Some(1000.0));
        assert_eq!(r.bandwidth_ratio(), Some(0.95));
        assert_eq!(r.list_bandwidth_ratio(), Some(1.1));
        assert_eq!(r.latency_ratio(), Some(1.25));
        assert_eq!(r.latency_gap_us(), Some(2.0));
    }

    #[test]
    fn rows_without_a_baseline_have_no_ratio() {
        let r = row(None);
        assert_eq!(r.bandwidth_ratio(), None);
        assert!(tables(std::slice::from_ref(&r), &[]).contains("| - |"));
        assert!(csv(&[r]).lines().nth(1).unwrap().ends_with(",,"));
    }

    #[test]
    fn csv_has_one_line_per_row_plus_header() {
        assert_eq!(csv(&[row(Some(1.0)), row(None)]).lines().count(), 3);
    }
}
