//! NIXL as a peer in the same run (`rdmareg bench --peers nixl`).
//!
//! The driver, `bench-peers/nixl_peer.py` (carried in this binary), runs a
//! NIXL owner and reader over NIXL's UCX backend with the lane's UCX
//! settings, and prints READ latency and windowed bandwidth as JSON lines.
//! `cargo xtask nixl` provisions it ([`default_python`]).

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::io::AsyncWriteExt as _;

use crate::bench::GetRow;

/// The driver, as committed.
const DRIVER: &str = include_str!("../../bench-peers/nixl_peer.py");

/// Where `cargo xtask nixl` records the interpreter that has NIXL.
const RECORDED_PYTHON: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../target/nixl-python");

/// Longest one transport's NIXL run may take before it is abandoned.
const RUN_BOUND: Duration = Duration::from_secs(600);

/// Why NIXL produced no figures.
#[derive(Debug, thiserror::Error)]
pub enum NixlError {
    /// No interpreter with NIXL is known.
    #[error(
        "NIXL is not provisioned: run `cargo xtask nixl`, or pass --nixl-python ({0} names none)"
    )]
    NotProvisioned(String),
    /// The driver could not be written or started.
    #[error("could not start the NIXL driver with {python}: {source}")]
    Spawn {
        /// The interpreter.
        python: String,
        /// Why.
        source: std::io::Error,
    },
    /// The driver ran past [`RUN_BOUND`].
    #[error("the NIXL driver did not finish within {0:?}")]
    TimedOut(Duration),
    /// It failed or printed something unreadable.
    #[error("the NIXL driver failed: {0}")]
    Failed(String),
}

/// One size as the driver is asked to measure it.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Spec {
    /// Bytes per READ.
    pub size: u64,
    /// Descriptors in the bandwidth window.
    pub window: usize,
    /// READs in the latency run.
    pub latency_iterations: usize,
    /// READs in the bandwidth run.
    pub bandwidth_iterations: usize,
}

/// One size as the driver measured it.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
pub struct NixlRow {
    /// Bytes per READ.
    pub size: u64,
    /// Median READ latency, µs.
    pub latency_p50_us: f64,
    /// The window as one request, MiB/s.
    pub bandwidth_mib_s: f64,
    /// `window` single-descriptor requests outstanding, MiB/s.
    pub request_window_mib_s: f64,
    /// Median latency of a READ with a notification, µs (absent from a
    /// driver that does not measure it).
    #[serde(default)]
    pub notice_latency_p50_us: Option<f64>,
    /// The window as one READ request with a notification, MiB/s.
    #[serde(default)]
    pub notice_bandwidth_mib_s: Option<f64>,
    /// Median WRITE latency, µs (absent from a driver that does not
    /// measure it).
    #[serde(default)]
    pub write_latency_p50_us: Option<f64>,
    /// The window as one WRITE request, MiB/s.
    #[serde(default)]
    pub write_bandwidth_mib_s: Option<f64>,
}

/// The interpreter `cargo xtask nixl` recorded, if there is one.
pub fn default_python() -> Result<PathBuf, NixlError> {
    let recorded = Path::new(RECORDED_PYTHON);
    std::fs::read_to_string(recorded)
        .ok()
        .map(|text| PathBuf::from(text.trim()))
        .filter(|python| python.exists())
        .ok_or_else(|| NixlError::NotProvisioned(recorded.display().to_string()))
}

/// The sizes of `rows`, with the registry's windows and iteration counts.
pub fn specs(rows: &[GetRow]) -> Vec<Spec> {
    rows.iter()
        .map(|row| Spec {
            size: row.size,
            window: row.window,
            latency_iterations: row.latency_iterations,
            bandwidth_iterations: row.bandwidth_iterations,
        })
        .collect()
}

/// Reads the driver's JSON lines: one `row` per size, other kinds skipped.
pub fn parse_output(output: &str) -> Result<Vec<NixlRow>, NixlError> {
    #[derive(Deserialize)]
    struct Kind {
        kind: String,
    }
    let mut rows = Vec::new();
    for line in output.lines().map(str::trim).filter(|l| !l.is_empty()) {
        let kind: Kind = serde_json::from_str(line)
            .map_err(|e| NixlError::Failed(format!("unreadable line {line:?}: {e}")))?;
        if kind.kind == "row" {
            let row: NixlRow = serde_json::from_str(line)
                .map_err(|e| NixlError::Failed(format!("unreadable row {line:?}: {e}")))?;
            if !(row.latency_p50_us > 0.0 && row.bandwidth_mib_s > 0.0) {
                return Err(NixlError::Failed(format!("a row without figures: {line}")));
            }
            rows.push(row);
        }
    }
    Ok(rows)
}

/// Copies NIXL's figures into the rows of the same size.
pub fn merge(rows: &mut [GetRow], measured: &[NixlRow]) {
    for row in rows {
        if let Some(nixl) = measured.iter().find(|m| m.size == row.size) {
            row.nixl_latency_p50_us = Some(nixl.latency_p50_us);
            row.nixl_bandwidth_mib_s = Some(nixl.bandwidth_mib_s);
            row.nixl_request_window_mib_s = Some(nixl.request_window_mib_s);
            row.nixl_notice_latency_p50_us = nixl.notice_latency_p50_us;
            row.nixl_notice_bandwidth_mib_s = nixl.notice_bandwidth_mib_s;
        }
    }
}

/// Runs the driver once per spec under the lane's UCX `environment`,
/// writing the driver file into `out`.
pub async fn run(
    python: &Path,
    out: &Path,
    environment: &[(String, String)],
    specs: &[Spec],
) -> Result<Vec<NixlRow>, NixlError> {
    let spawn_error = |source| NixlError::Spawn {
        python: python.display().to_string(),
        source,
    };
    std::fs::create_dir_all(out).map_err(spawn_error)?;
    let driver = out.join("nixl_peer.py");
    std::fs::write(&driver, DRIVER).map_err(spawn_error)?;
    let plan = serde_json::json!({ "sizes": specs }).to_string();
    let mut child = tokio::process::Command::new(python)
        .arg(&driver)
        .arg("reader")
        .env("UCX_WARN_UNUSED_ENV_VARS", "n")
        .env("NIXL_LOG_LEVEL", "WARN")
        .envs(environment.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(spawn_error)?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin
            .write_all(plan.as_bytes())
            .await
            .map_err(spawn_error)?;
    }
    let output = tokio::time::timeout(RUN_BOUND, child.wait_with_output())
        .await
        .map_err(|_| NixlError::TimedOut(RUN_BOUND))?
        .map_err(spawn_error)?;
    if !output.status.success() {
        let stderr = String::from_utf8_lossy(&output.stderr);
        let last = stderr.lines().last().unwrap_or("").trim().to_owned();
        return Err(NixlError::Failed(format!(
            "exited with {}: {last}",
            output.status
        )));
    }
    let rows = parse_output(&String::from_utf8_lossy(&output.stdout))?;
    if rows.len() != specs.len() {
        return Err(NixlError::Failed(format!(
            "measured {} of {} sizes",
            rows.len(),
            specs.len()
        )));
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    const OUTPUT: &str = r#"{"kind": "info", "module": "nixl_cu12", "ucx_tls": "tcp,cma", "pid_owner": 1}
{"kind": "row", "size": 8, "window": 16, "latency_iterations": 500, "bandwidth_iterations": 1600, "latency_p50_us": 4.877, "latency_p99_us": 7.2, "bandwidth_mib_s": 1.15, "request_window_mib_s": 0.33}
{"kind": "row", "size": 1048576, "window": 16, "latency_iterations": 100, "bandwidth_iterations": 320, "latency_p50_us": 104.6, "latency_p99_us": 2025.9, "bandwidth_mib_s": 1314.7, "request_window_mib_s": 1159.0}
"#;

    #[test]
    fn driver_output_yields_one_row_per_size_and_skips_the_info_line() {
        let rows = parse_output(OUTPUT).unwrap();
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[0].size, 8);
        assert_eq!(rows[0].latency_p50_us, 4.877);
        assert_eq!(rows[1].bandwidth_mib_s, 1314.7);
        assert_eq!(rows[1].request_window_mib_s, 1159.0);
    }

    #[test]
    fn garbled_or_empty_driver_rows_are_errors_not_zeros() {
        assert!(parse_output("not json\n").is_err());
        assert!(parse_output(r#"{"kind": "row", "size": 8}"#).is_err());
        let zero = r#"{"kind": "row", "size": 8, "latency_p50_us": 0.0, "bandwidth_mib_s": 1.0, "request_window_mib_s": 1.0}"#;
        assert!(parse_output(zero).is_err());
    }

    #[test]
    fn nixl_figures_go_in_the_rows_of_their_size_only() {
        let mut rows = vec![row(8), row(4096)];
        assert_eq!(
            specs(&rows),
            [
                Spec {
                    size: 8,
                    window: 16,
                    latency_iterations: 100,
                    bandwidth_iterations: 160
                },
                Spec {
                    size: 4096,
                    window: 16,
                    latency_iterations: 100,
                    bandwidth_iterations: 160
                },
            ]
        );
        merge(&mut rows, &parse_output(OUTPUT).unwrap());
        assert_eq!(rows[0].nixl_latency_p50_us, Some(4.877));
        assert_eq!(rows[0].nixl_bandwidth_mib_s, Some(1.15));
        assert_eq!(rows[0].nixl_request_window_mib_s, Some(0.33));
        assert_eq!(rows[1].nixl_latency_p50_us, None);
        assert_eq!(rows[1].nixl_bandwidth_mib_s, None);
    }

    fn row(size: u64) -> GetRow {
        GetRow {
            transport: "shm".into(),
            size,
            window: 16,
            latency_iterations: 100,
            bandwidth_iterations: 160,
            latency_p50_us: 3.0,
            latency_p99_us: 4.0,
            bandwidth_mib_s: 10.0,
            list_bandwidth_mib_s: 12.0,
            list_one_destination_mib_s: 13.0,
            perftest_latency_p50_us: None,
            perftest_bandwidth_mib_s: None,
            nixl_latency_p50_us: None,
            nixl_bandwidth_mib_s: None,
            nixl_request_window_mib_s: None,
            notice_latency_p50_us: 1.0,
            notice_list_bandwidth_mib_s: 1.0,
            nixl_notice_latency_p50_us: None,
            nixl_notice_bandwidth_mib_s: None,
        }
    }
}
