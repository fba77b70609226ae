//! Benchmark rows, the printed tables, and the CSV / JSON / SVG files.

use std::fmt::Write as _;
use std::path::Path;

use anyhow::Context as _;
use serde::Serialize;

use crate::bench::plot::{self, Chart, Series, format_size};
use crate::bench::scatter::ScatterRow;

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
    /// Registry bandwidth, MiB/s: the window as one transfer list whose
    /// entries are all written to one buffer, as ucx_perftest's window does.
    pub list_one_destination_mib_s: f64,
    /// ucx_perftest median latency, µs.
    pub perftest_latency_p50_us: Option<f64>,
    /// ucx_perftest bandwidth, MiB/s.
    pub perftest_bandwidth_mib_s: Option<f64>,
    /// NIXL's median READ latency, µs (`--peers nixl`).
    pub nixl_latency_p50_us: Option<f64>,
    /// NIXL's READ bandwidth, MiB/s: the window posted as one prepared
    /// request of `window` descriptors, NIXL's batched form.
    pub nixl_bandwidth_mib_s: Option<f64>,
    /// NIXL's READ bandwidth, MiB/s: `window` one-descriptor requests kept
    /// outstanding (perftest's shape).
    pub nixl_request_window_mib_s: Option<f64>,
    /// Registry median latency of a GET with a notice (`get_with_notice`),
    /// µs: until the read completed and the transport took the notice.
    pub notice_latency_p50_us: f64,
    /// Registry bandwidth, MiB/s: the window as one transfer list, then one
    /// notice to the owner once every entry completed.
    pub notice_list_bandwidth_mib_s: f64,
    /// NIXL's median latency of a READ with a notification, µs.
    pub nixl_notice_latency_p50_us: Option<f64>,
    /// NIXL's bandwidth of the window as one READ request with a
    /// notification, MiB/s.
    pub nixl_notice_bandwidth_mib_s: Option<f64>,
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
    /// One-destination list bandwidth over perftest's: the like-for-like
    /// form (one destination buffer on both sides).
    pub fn list_one_destination_ratio(&self) -> Option<f64> {
        self.perftest_bandwidth_mib_s
            .filter(|p| *p > 0.0)
            .map(|p| self.list_one_destination_mib_s / p)
    }
    /// Registry latency over perftest's (lower is better).
    pub fn latency_ratio(&self) -> Option<f64> {
        self.perftest_latency_p50_us
            .filter(|p| *p > 0.0)
            .map(|p| self.latency_p50_us / p)
    }
    /// Registry list bandwidth over NIXL's batched READ bandwidth (the same
    /// shape: the window as one submission).
    pub fn nixl_bandwidth_ratio(&self) -> Option<f64> {
        self.nixl_bandwidth_mib_s
            .filter(|n| *n > 0.0)
            .map(|n| self.list_bandwidth_mib_s / n)
    }
    /// Registry latency over NIXL's (lower is better).
    pub fn nixl_latency_ratio(&self) -> Option<f64> {
        self.nixl_latency_p50_us
            .filter(|n| *n > 0.0)
            .map(|n| self.latency_p50_us / n)
    }
    /// Read-with-notice latency over NIXL's READ with a notification
    /// (lower is better).
    pub fn nixl_notice_latency_ratio(&self) -> Option<f64> {
        self.nixl_notice_latency_p50_us
            .filter(|n| *n > 0.0)
            .map(|n| self.notice_latency_p50_us / n)
    }
    /// Read-with-notice list bandwidth over NIXL's batched READ with a
    /// notification.
    pub fn nixl_notice_bandwidth_ratio(&self) -> Option<f64> {
        self.nixl_notice_bandwidth_mib_s
            .filter(|n| *n > 0.0)
            .map(|n| self.notice_list_bandwidth_mib_s / n)
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

/// The GET, scatter and pool tables as text.
pub fn tables(rows: &[GetRow], scatter_rows: &[ScatterRow], pool_rows: &[PoolRow]) -> String {
    let mut out = String::new();
    // The NIXL columns appear when NIXL was measured (`--peers nixl`).
    let with_nixl = rows.iter().any(|r| r.nixl_latency_p50_us.is_some());
    let (nixl_header, nixl_rule) = if with_nixl {
        (
            " NIXL p50 µs | latency / NIXL | NIXL MiB/s | list / NIXL |",
            "---:|---:|---:|---:|",
        )
    } else {
        ("", "")
    };
    let _ = writeln!(
        out,
        "| transport | size | window | rdmareg p50 µs | perftest p50 µs | gap µs | latency ratio | rdmareg MiB/s | list MiB/s | list, one destination MiB/s | perftest MiB/s | bandwidth ratio | list ratio | one-destination list ratio |{nixl_header}"
    );
    let _ = writeln!(
        out,
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|{nixl_rule}"
    );
    for row in rows {
        let nixl = if with_nixl {
            format!(
                " {} | {} | {} | {} |",
                optional(row.nixl_latency_p50_us, 2),
                ratio(row.nixl_latency_ratio()),
                optional(row.nixl_bandwidth_mib_s, 1),
                ratio(row.nixl_bandwidth_ratio()),
            )
        } else {
            String::new()
        };
        let _ = writeln!(
            out,
            "| {} | {} | {} | {:.2} | {} | {} | {} | {:.1} | {:.1} | {:.1} | {} | {} | {} | {} |{nixl}",
            row.transport,
            format_size(row.size),
            row.window,
            row.latency_p50_us,
            optional(row.perftest_latency_p50_us, 2),
            optional(row.latency_gap_us(), 2),
            ratio(row.latency_ratio()),
            row.bandwidth_mib_s,
            row.list_bandwidth_mib_s,
            row.list_one_destination_mib_s,
            optional(row.perftest_bandwidth_mib_s, 1),
            ratio(row.bandwidth_ratio()),
            ratio(row.list_bandwidth_ratio()),
            ratio(row.list_one_destination_ratio()),
        );
    }
    if !rows.is_empty() {
        // Reads with a notice; NIXL's READ with a notification beside them
        // when NIXL was measured.
        let with_nixl = rows.iter().any(|r| r.nixl_notice_latency_p50_us.is_some());
        let _ = writeln!(out);
        if with_nixl {
            let _ = writeln!(
                out,
                "| transport | size | read + notice p50 µs | read + notice list MiB/s | NIXL READ + notification p50 µs | latency / NIXL | NIXL READ + notification MiB/s | list / NIXL |"
            );
            let _ = writeln!(out, "|---|---:|---:|---:|---:|---:|---:|---:|");
        } else {
            let _ = writeln!(
                out,
                "| transport | size | read + notice p50 µs | read + notice list MiB/s |"
            );
            let _ = writeln!(out, "|---|---:|---:|---:|");
        }
        for row in rows {
            let nixl = if with_nixl {
                format!(
                    " {} | {} | {} | {} |",
                    optional(row.nixl_notice_latency_p50_us, 2),
                    ratio(row.nixl_notice_latency_ratio()),
                    optional(row.nixl_notice_bandwidth_mib_s, 1),
                    ratio(row.nixl_notice_bandwidth_ratio()),
                )
            } else {
                String::new()
            };
            let _ = writeln!(
                out,
                "| {} | {} | {:.2} | {:.1} |{nixl}",
                row.transport,
                format_size(row.size),
                row.notice_latency_p50_us,
                row.notice_list_bandwidth_mib_s,
            );
        }
    }
    if !scatter_rows.is_empty() {
        let _ = writeln!(out);
        let _ = writeln!(
            out,
            "| transport | list | source layout | list p50 µs | one GET of the same bytes p50 µs | list / one GET |"
        );
        let _ = writeln!(out, "|---|---|---|---:|---:|---:|");
        for row in scatter_rows {
            let _ = writeln!(
                out,
                "| {} | {} × {} | {} | {:.1} | {:.1} | {:.2} |",
                row.transport,
                row.entries,
                format_size(row.entry_bytes),
                row.layout.name(),
                row.list_p50_us,
                row.single_p50_us,
                row.ratio(),
            );
        }
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

/// Print the tables.
pub fn print_tables(rows: &[GetRow], scatter_rows: &[ScatterRow], pool_rows: &[PoolRow]) {
    println!("{}", tables(rows, scatter_rows, pool_rows));
}

/// CSV of the GET rows.
pub fn csv(rows: &[GetRow]) -> String {
    let mut out = String::from(
        "transport,size,window,latency_iterations,bandwidth_iterations,latency_p50_us,latency_p99_us,perftest_latency_p50_us,latency_ratio,bandwidth_mib_s,list_bandwidth_mib_s,perftest_bandwidth_mib_s,bandwidth_ratio,list_bandwidth_ratio,nixl_latency_p50_us,nixl_latency_ratio,nixl_bandwidth_mib_s,nixl_request_window_mib_s,nixl_bandwidth_ratio,list_one_destination_mib_s,list_one_destination_ratio,notice_latency_p50_us,nixl_notice_latency_p50_us,nixl_notice_latency_ratio,notice_list_bandwidth_mib_s,nixl_notice_bandwidth_mib_s,nixl_notice_bandwidth_ratio\n",
    );
    let cell = |v: Option<f64>| v.map_or_else(String::new, |v| format!("{v:.4}"));
    for r in rows {
        let _ = writeln!(
            out,
            "{},{},{},{},{},{:.4},{:.4},{},{},{:.4},{:.4},{},{},{},{},{},{},{},{},{:.4},{},{:.4},{},{},{:.4},{},{}",
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
            cell(r.nixl_latency_p50_us),
            cell(r.nixl_latency_ratio()),
            cell(r.nixl_bandwidth_mib_s),
            cell(r.nixl_request_window_mib_s),
            cell(r.nixl_bandwidth_ratio()),
            r.list_one_destination_mib_s,
            cell(r.list_one_destination_ratio()),
            r.notice_latency_p50_us,
            cell(r.nixl_notice_latency_p50_us),
            cell(r.nixl_notice_latency_ratio()),
            r.notice_list_bandwidth_mib_s,
            cell(r.nixl_notice_bandwidth_mib_s),
            cell(r.nixl_notice_bandwidth_ratio()),
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
                Series {
                    label: "NIXL".into(),
                    colour: "#9467bd",
                    points: series(transport, |r| r.nixl_latency_p50_us),
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
                Series {
                    label: "NIXL, one request".into(),
                    colour: "#9467bd",
                    points: series(transport, |r| r.nixl_bandwidth_mib_s),
                },
            ],
        });
    }
    // A peer that was not measured (NIXL without `--peers nixl`, perftest
    // with `--no-perftest`) draws no empty line and takes no legend entry.
    for chart in &mut charts {
        chart.series.retain(|series| !series.points.is_empty());
    }
    charts
}

/// Write results.csv, scatter.csv, pool.csv, results.json, results.svg and
/// results.md into `dir`.
pub fn write_all(
    dir: &Path,
    rows: &[GetRow],
    scatter_rows: &[ScatterRow],
    pool_rows: &[PoolRow],
) -> anyhow::Result<()> {
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
    let mut scatter_csv = String::from(
        "transport,layout,entries,entry_bytes,rounds,list_p50_us,single_p50_us,ratio\n",
    );
    for r in scatter_rows {
        let _ = writeln!(
            scatter_csv,
            "{},{},{},{},{},{:.2},{:.2},{:.3}",
            r.transport,
            r.layout.name(),
            r.entries,
            r.entry_bytes,
            r.rounds,
            r.list_p50_us,
            r.single_p50_us,
            r.ratio()
        );
    }
    write("scatter.csv", scatter_csv)?;
    #[derive(Serialize)]
    struct Results<'a> {
        get: &'a [GetRow],
        scatter: &'a [ScatterRow],
        pool: &'a [PoolRow],
    }
    write(
        "results.json",
        serde_json::to_string_pretty(&Results {
            get: rows,
            scatter: scatter_rows,
            pool: pool_rows,
        })?,
    )?;
    write("results.svg", plot::render(&charts(rows)))?;
    write("results.md", tables(rows, scatter_rows, pool_rows))?;
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
            list_one_destination_mib_s: 1300.0,
            perftest_latency_p50_us: perftest.map(|_| 8.0),
            perftest_bandwidth_mib_s: perftest,
            nixl_latency_p50_us: None,
            nixl_bandwidth_mib_s: None,
            nixl_request_window_mib_s: None,
            notice_latency_p50_us: 12.0,
            notice_list_bandwidth_mib_s: 1000.0,
            nixl_notice_latency_p50_us: None,
            nixl_notice_bandwidth_mib_s: None,
        }
    }

    fn with_nixl(mut row: GetRow) -> GetRow {
        row.nixl_latency_p50_us = Some(20.0);
        row.nixl_bandwidth_mib_s = Some(550.0);
        row.nixl_request_window_mib_s = Some(500.0);
        row.nixl_notice_latency_p50_us = Some(24.0);
        row.nixl_notice_bandwidth_mib_s = Some(400.0);
        row
    }

    #[test]
    fn notice_ratios_compare_reads_with_notices_to_nixls() {
        let r = with_nixl(row(Some(1000.0)));
        assert_eq!(r.nixl_notice_latency_ratio(), Some(0.5));
        assert_eq!(r.nixl_notice_bandwidth_ratio(), Some(2.5));
        assert_eq!(row(None).nixl_notice_latency_ratio(), None);
        let text = csv(&[r]);
        let mut lines = text.lines();
        let header: Vec<&str> = lines.next().unwrap().split(',').collect();
        let cells: Vec<&str> = lines.next().unwrap().split(',').collect();
        assert_eq!(header.len(), cells.len());
        let cell = |name: &str| cells[header.iter().position(|h| *h == name).unwrap()];
        assert_eq!(cell("notice_latency_p50_us"), "12.0000");
        assert_eq!(cell("nixl_notice_latency_ratio"), "0.5000");
        assert_eq!(cell("nixl_notice_bandwidth_ratio"), "2.5000");
    }

    #[test]
    fn the_notice_table_has_nixl_columns_only_when_measured() {
        let without = tables(&[row(None)], &[], &[]);
        assert!(without.contains("| read + notice p50 µs | read + notice list MiB/s |\n"));
        assert!(!without.contains("NIXL"), "{without}");
        let with = tables(&[with_nixl(row(None))], &[], &[]);
        assert!(
            with.contains("| 12.00 | 1000.0 | 24.00 | 0.50 | 400.0 | 2.50 |"),
            "{with}"
        );
    }

    #[test]
    fn nixl_ratios_compare_the_registry_to_nixl() {
        let r = with_nixl(row(Some(1000.0)));
        assert_eq!(r.nixl_bandwidth_ratio(), Some(2.0));
        assert_eq!(r.nixl_latency_ratio(), Some(0.5));
        assert_eq!(row(Some(1000.0)).nixl_bandwidth_ratio(), None);
    }

    #[test]
    fn the_table_has_nixl_columns_only_when_nixl_was_measured() {
        let without = tables(&[row(Some(1000.0))], &[], &[]);
        assert!(!without.contains("NIXL"), "{without}");
        let text = tables(&[with_nixl(row(Some(1000.0))), row(Some(1000.0))], &[], &[]);
        let lines: Vec<&str> = text.lines().collect();
        assert!(lines[0].ends_with("| NIXL p50 µs | latency / NIXL | NIXL MiB/s | list / NIXL |"));
        let columns = |line: &str| line.matches('|').count();
        assert!(
            lines[..4]
                .iter()
                .all(|line| columns(line) == columns(lines[0])),
            "{text}"
        );
        assert!(
            lines[2].ends_with("| 20.00 | 0.50 | 550.0 | 2.00 |"),
            "{}",
            lines[2]
        );
        assert!(lines[3].ends_with("| - | - | - | - |"), "{}", lines[3]);
    }

    #[test]
    fn csv_carries_the_nixl_figures_and_ratios() {
        let text = csv(&[with_nixl(row(Some(1000.0)))]);
        let mut lines = text.lines();
        let header: Vec<&str> = lines.next().unwrap().split(',').collect();
        let cells: Vec<&str> = lines.next().unwrap().split(',').collect();
        assert_eq!(header.len(), cells.len());
        let cell = |name: &str| cells[header.iter().position(|h| *h == name).unwrap()];
        assert_eq!(cell("nixl_latency_p50_us"), "20.0000");
        assert_eq!(cell("nixl_bandwidth_mib_s"), "550.0000");
        assert_eq!(cell("nixl_request_window_mib_s"), "500.0000");
        assert_eq!(cell("nixl_bandwidth_ratio"), "2.0000");
        assert_eq!(cell("nixl_latency_ratio"), "0.5000");
    }

    #[test]
    fn ratios_compare_registry_to_perftest() {
        let r = row(Some(1000.0));
        assert_eq!(r.bandwidth_ratio(), Some(0.95));
        assert_eq!(r.list_bandwidth_ratio(), Some(1.1));
        assert_eq!(r.list_one_destination_ratio(), Some(1.3));
        assert_eq!(r.latency_ratio(), Some(1.25));
        assert_eq!(r.latency_gap_us(), Some(2.0));
    }

    #[test]
    fn rows_without_a_baseline_have_no_ratio() {
        let r = row(None);
        assert_eq!(r.bandwidth_ratio(), None);
        assert!(tables(std::slice::from_ref(&r), &[], &[]).contains("| - |"));
        assert_eq!(r.list_one_destination_ratio(), None);
        let text = csv(&[r]);
        let header: Vec<&str> = text.lines().next().unwrap().split(',').collect();
        let cells: Vec<&str> = text.lines().nth(1).unwrap().split(',').collect();
        let cell = |name: &str| cells[header.iter().position(|h| *h == name).unwrap()];
        for ratio in [
            "bandwidth_ratio",
            "list_bandwidth_ratio",
            "list_one_destination_ratio",
            "latency_ratio",
        ] {
            assert_eq!(cell(ratio), "", "{ratio}");
        }
        assert_eq!(cell("list_one_destination_mib_s"), "1300.0000");
    }

    #[test]
    fn the_scatter_table_shows_the_list_against_one_get() {
        let scatter = ScatterRow {
            transport: "tcp".to_owned(),
            layout: crate::bench::scatter::Layout::Gapped,
            entries: 1000,
            entry_bytes: 4096,
            rounds: 10,
            list_p50_us: 3000.0,
            single_p50_us: 2000.0,
        };
        let text = tables(&[], std::slice::from_ref(&scatter), &[]);
        assert!(
            text.contains("| tcp | 1000 × 4 KiB | gapped | 3000.0 | 2000.0 | 1.50 |"),
            "{text}"
        );
        assert!(!tables(&[], &[], &[]).contains("list / one GET"));
    }

    #[test]
    fn csv_has_one_line_per_row_plus_header() {
        assert_eq!(csv(&[row(Some(1.0)), row(None)]).lines().count(), 3);
    }
}
