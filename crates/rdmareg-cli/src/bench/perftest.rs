//! Running `ucx_perftest -t ucp_get` (and `ucp_put_lat` / `ucp_put_bw`)
//! from the same UCX as the baseline.
//!
//! A server and a client on 127.0.0.1, both with the registry side's
//! transport environment; the client's `-f -v` output is read by
//! [`parse_final_csv`].

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

/// One `ucx_perftest` measurement as printed by `-f -v`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PerftestResult {
    /// Median latency, µs.
    pub p50_us: f64,
    /// Average latency, µs.
    pub average_us: f64,
    /// Average bandwidth, MiB/s.
    pub bandwidth_mib_s: f64,
}

/// What one perftest run moves.
#[derive(Debug, Clone, Copy)]
struct Shape {
    size: u64,
    window: usize,
    iterations: usize,
}

/// How to find and run `ucx_perftest`.
#[derive(Debug, Clone)]
pub struct Perftest {
    /// The binary.
    pub binary: PathBuf,
    /// UCX library directory for the child's `LD_LIBRARY_PATH`.
    pub library_dir: Option<PathBuf>,
}

/// Why a perftest run produced no figures.
#[derive(Debug, thiserror::Error)]
pub enum PerftestError {
    /// The binary could not be started.
    #[error("could not start {binary}: {source}")]
    Spawn {
        /// Which binary.
        binary: String,
        /// Why.
        source: std::io::Error,
    },
    /// It ran but failed or printed something unexpected.
    #[error("ucx_perftest failed: {0}")]
    Failed(String),
}

/// Parse the output of `ucx_perftest -f -v` (a CSV header, then figures).
pub fn parse_final_csv(output: &str) -> Result<PerftestResult, PerftestError> {
    let mut lines = output
        .lines()
        .map(str::trim)
        .skip_while(|line| !line.starts_with("iterations,"));
    let header = lines
        .next()
        .ok_or_else(|| PerftestError::Failed(format!("no CSV header in output: {output:?}")))?;
    let values = lines
        .next()
        .ok_or_else(|| PerftestError::Failed("no CSV figures after header".into()))?;
    let columns: Vec<&str> = header.split(',').collect();
    let figures: Vec<&str> = values.split(',').collect();
    let column = |name_prefix: &str| -> Result<f64, PerftestError> {
        let index = columns
            .iter()
            .position(|c| c.starts_with(name_prefix))
            .ok_or_else(|| PerftestError::Failed(format!("no {name_prefix} column")))?;
        figures
            .get(index)
            .and_then(|v| v.trim().parse::<f64>().ok())
            .ok_or_else(|| PerftestError::Failed(format!("unreadable {name_prefix} figure")))
    };
    Ok(PerftestResult {
        p50_us: column("50.0_percentile_lat")?,
        average_us: column("avg_lat")?,
        bandwidth_mib_s: column("avg_bw")?,
    })
}

/// Waits until `/proc/net/tcp{,6}` shows a listener on `port`, `server`
/// exited, or `limit` passed (connecting would steal the client's slot).
fn wait_until_listening(server: &mut std::process::Child, port: u16, limit: Duration) {
    let started = std::time::Instant::now();
    while started.elapsed() < limit {
        if listening_on(port) || matches!(server.try_wait(), Ok(Some(_)) | Err(_)) {
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Whether `/proc/net/tcp{,6}` lists a socket listening on `port`.
fn listening_on(port: u16) -> bool {
    ["/proc/net/tcp", "/proc/net/tcp6"].iter().any(|table| {
        std::fs::read_to_string(table).is_ok_and(|text| table_lists_listener(&text, port))
    })
}

/// Whether a `/proc/net/tcp`-format `table` has a row in state `0A`
/// (listen) whose local address ends in `port`.
fn table_lists_listener(table: &str, port: u16) -> bool {
    let suffix = format!(":{port:04X}");
    table.lines().skip(1).any(|row| {
        let mut fields = row.split_whitespace();
        let local = fields.nth(1);
        let state = fields.nth(1);
        local.is_some_and(|local| local.ends_with(&suffix)) && state == Some("0A")
    })
}

impl Perftest {
    /// Run one `-t ucp_get` measurement: `size`-byte GETs, `window`
    /// outstanding (1 = latency), `iterations` times, under `environment`.
    pub fn run_get(
        &self,
        environment: &[(String, String)],
        port: u16,
        size: u64,
        window: usize,
        iterations: usize,
        error_handling: bool,
    ) -> Result<PerftestResult, PerftestError> {
        let shape = Shape {
            size,
            window,
            iterations,
        };
        self.run("ucp_get", environment, port, shape, error_handling)
    }

    /// Run one PUT measurement: `-t ucp_put_lat` with one outstanding
    /// (`window` 1), else `-t ucp_put_bw` with `window` outstanding.
    pub fn run_put(
        &self,
        environment: &[(String, String)],
        port: u16,
        size: u64,
        window: usize,
        iterations: usize,
        error_handling: bool,
    ) -> Result<PerftestResult, PerftestError> {
        let test = if window > 1 {
            "ucp_put_bw"
        } else {
            "ucp_put_lat"
        };
        let shape = Shape {
            size,
            window,
            iterations,
        };
        self.run(test, environment, port, shape, error_handling)
    }

    /// Run one measurement of `test`.
    fn run(
        &self,
        test: &str,
        environment: &[(String, String)],
        port: u16,
        shape: Shape,
        error_handling: bool,
    ) -> Result<PerftestResult, PerftestError> {
        let Shape {
            size,
            window,
            iterations,
        } = shape;
        let mut server = self
            .command(environment)
            .args(["-p", &port.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|source| self.spawn_error(source))?;
        // The client connects once: wait until the server listens.
        wait_until_listening(&mut server, port, Duration::from_secs(20));
        let mut client = self.command(environment);
        client.args([
            "127.0.0.1",
            "-p",
            &port.to_string(),
            "-t",
            test,
            "-s",
            &size.to_string(),
            "-n",
            &iterations.to_string(),
            "-w",
            &(iterations / 10).max(10).to_string(),
            "-f",
            "-v",
        ]);
        if window > 1 {
            client.args(["-O", &window.to_string()]);
        }
        if error_handling {
            client.arg("-e");
        }
        let output = client.output().map_err(|source| self.spawn_error(source));
        let _ = server.kill();
        let _ = server.wait();
        let output = output?;
        let stdout = String::from_utf8_lossy(&output.stdout);
        if !output.status.success() {
            return Err(PerftestError::Failed(format!(
                "client exited with {}: {}",
                output.status,
                String::from_utf8_lossy(&output.stderr).trim()
            )));
        }
        parse_final_csv(&stdout)
    }

    fn command(&self, environment: &[(String, String)]) -> Command {
        let mut command = Command::new(&self.binary);
        // A caller's `UCX_*` variables that this UCX does not know would
        // each print a warning into the output the figures are parsed from.
        command.env("UCX_WARN_UNUSED_ENV_VARS", "n");
        if let Some(dir) = &self.library_dir {
            command.env("LD_LIBRARY_PATH", join_library_path(dir));
        }
        command.envs(environment.iter().map(|(k, v)| (k, v)));
        command
    }

    fn spawn_error(&self, source: std::io::Error) -> PerftestError {
        PerftestError::Spawn {
            binary: self.binary.display().to_string(),
            source,
        }
    }
}

fn join_library_path(dir: &Path) -> String {
    match std::env::var("LD_LIBRARY_PATH") {
        Ok(existing) if !existing.is_empty() => format!("{}:{existing}", dir.display()),
        _ => dir.display().to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_listener_is_found_by_its_port_and_state_only() {
        let table = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000:3886 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1 1 0 100 0 0 10 0
   1: 0100007F:3887 0100007F:A1B2 01 00000000:00000000 00:00000000 00000000     0        0 2 1 0 20 4 30 10 -1
";
        assert!(table_lists_listener(table, 0x3886));
        assert!(
            !table_lists_listener(table, 0x3887),
            "an established connection is no listener"
        );
        assert!(!table_lists_listener(table, 0xA1B2), "a remote port");
        assert!(
            !table_lists_listener(table, 0x0886),
            "a port that is only a suffix"
        );
    }

    #[test]
    fn final_csv_output_is_parsed_by_column_name() {
        let output = "iterations,50.0_percentile_lat,avg_lat,overall_lat,avg_bw,overall_bw,avg_mr,overall_mr\n\
                      2000,52.017,52.746,52.746,1184.91,1184.91,18959,18959\n";
        let result = parse_final_csv(output).unwrap();
        assert_eq!(result.p50_us, 52.017);
        assert_eq!(result.average_us, 52.746);
        assert_eq!(result.bandwidth_mib_s, 1184.91);
    }

    #[test]
    fn output_without_figures_is_an_error_not_a_zero() {
        assert!(parse_final_csv("").is_err());
        assert!(parse_final_csv("iterations,avg_lat\n").is_err());
        assert!(
            parse_final_csv("iterations,50.0_percentile_lat,avg_lat,avg_bw\n1,x,2,3\n").is_err()
        );
    }
}
